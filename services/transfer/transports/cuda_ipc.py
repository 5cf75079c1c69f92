"""cuda_ipc: same node, GPU. The language pool is cudaMalloc'd through CuPy and
exported by IPC handle; the encoder opens the handle once and copies runs on
the device. Written against the CUDA runtime API as CuPy exposes it; it needs
a GPU and is covered only by `gpu`-marked tests."""

from __future__ import annotations

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout
from services.transfer.transports.base import (
    MappedWriter,
    Part,
    ThreadCopies,
    WrittenBeforeDone,
    copy_part,
    receiver_layout,
)
from services.wire.messages import CudaIpcPool, Register
from services.wire.transport import Transport


def cuda_ipc_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def _view(ptr: int, nbytes: int, device: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """A torch tensor over raw device memory (CuPy has no bfloat16: go through bytes)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device)
    raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(raw).view(dtype).view(rows, -1)


# The planes this process exports, by IPC handle. CUDA refuses to open a handle
# in the process that made it (cudaErrorDeviceUninitialized, seen on an H100), so
# a writer whose peer lives in this process (instances started in one test
# process) copies into the plane itself, as PyTorch's own IPC does.
_EXPORTED: dict[bytes, torch.Tensor] = {}


class CudaIpcMemory(WrittenBeforeDone):
    """Receive-pool memory allocated for export: the pool and its IPC endpoint
    (the writer's copy is synchronised before it sends TransferDone)."""

    transport = Transport.CUDA_IPC

    def __init__(self, layout: PoolLayout, device: torch.device) -> None:
        import cupy

        self.device_id = device.index or 0
        self._ptrs: list[int] = []
        handles: list[bytes] = []
        tensors: list[torch.Tensor] = []
        with cupy.cuda.Device(self.device_id):
            for plane in layout.planes:
                nbytes = layout.plane_bytes(plane)
                ptr = cupy.cuda.runtime.malloc(nbytes)
                cupy.cuda.runtime.memset(ptr, 0, nbytes)
                self._ptrs.append(ptr)
                handles.append(bytes(cupy.cuda.runtime.ipcGetMemHandle(ptr)))
                tensors.append(_view(ptr, nbytes, self.device_id, layout.dtype, layout.num_rows))
        self._handles = handles
        _EXPORTED.update(zip(handles, tensors, strict=True))
        self.pool = EmbeddingPool(layout, tensors)
        self._endpoint = CudaIpcPool(
            plane_handles=tuple(handles),
            device_id=self.device_id,
            pci_bus_id=cupy.cuda.runtime.deviceGetPCIBusId(self.device_id),
        )

    def endpoint(self) -> CudaIpcPool:
        return self._endpoint

    def close(self) -> None:
        import cupy

        for handle in self._handles:
            _EXPORTED.pop(handle, None)
        self.pool.close()
        with cupy.cuda.Device(self.device_id):
            for ptr in self._ptrs:
                cupy.cuda.runtime.free(ptr)
        self._ptrs = []


class _OpenedPool:
    def __init__(self, peer: Register) -> None:
        import cupy

        assert peer.pool is not None and peer.pool.cuda_ipc is not None
        endpoint = peer.pool.cuda_ipc
        self.layout = receiver_layout(peer)
        # the receiver's GPU in this process's numbering (its index may differ here)
        self.device_id = (
            cupy.cuda.runtime.deviceGetByPCIBusId(endpoint.pci_bus_id)
            if endpoint.pci_bus_id
            else endpoint.device_id
        )
        self._ptrs: list[int] = []
        self.copies = ThreadCopies()
        if len(endpoint.plane_handles) != len(self.layout.planes):
            raise ValueError(
                f"{peer.instance_id}: {len(endpoint.plane_handles)} handles "
                f"for {self.layout.describe()}"
            )
        with cupy.cuda.Device(self.device_id):
            self.tensors = [
                self._open(handle, self.layout.plane_bytes(plane))
                for handle, plane in zip(endpoint.plane_handles, self.layout.planes, strict=True)
            ]

    def _open(self, handle: bytes, nbytes: int) -> torch.Tensor:
        import cupy

        if handle in _EXPORTED:
            return _EXPORTED[handle]
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        self._ptrs.append(ptr)
        return _view(ptr, nbytes, self.device_id, self.layout.dtype, self.layout.num_rows)

    def close(self) -> None:
        import cupy

        self.tensors = []
        with cupy.cuda.Device(self.device_id):
            for ptr in self._ptrs:
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self._ptrs = []


class CudaIpcWriter(MappedWriter[_OpenedPool]):
    transport = Transport.CUDA_IPC

    def _map(self, peer: Register) -> _OpenedPool:
        return _OpenedPool(peer)

    def _copy(self, source: EmbeddingPool, target: _OpenedPool, part: Part) -> None:
        with torch.cuda.device(target.device_id):
            copy_part(source, target.tensors, target.layout.block_size, part, non_blocking=True)
            torch.cuda.current_stream().synchronize()
