"""EmbeddingPool: embedding storage in blocks, in memory a transport can reach.
One tensor per plane of its layout, all indexed by the same flat rows:

    embeddings  [num_blocks * block_size, hidden]
    deepstack   [num_blocks * block_size, levels * hidden]     (only with deepstack)

The language side receives into one (POSIX shared memory on CPU, a CUDA
tensor on GPU; NIXL registers either once at start-up); the encoder's send
buffer is one in its own memory. Block bookkeeping is the BlockAllocator.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Sequence

import torch

from services.transfer.allocator import BlockAllocator
from services.transfer.layout import PoolLayout, token_rows
from services.transfer.shared_memory import SharedSegment


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor (any dtype, bfloat16 included)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A read-only [n, width] view of received bytes, to be copied into a pool."""
    if len(data) % (width * torch.empty((), dtype=dtype).element_size()):
        raise ValueError(f"{len(data)} bytes is not a whole number of {width}-wide {dtype} rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(data, dtype=dtype).view(-1, width)


def write_tokens(
    rows: torch.Tensor, blocks: Sequence[int], block_size: int, start: int, values: torch.Tensor
) -> None:
    """rows[...] for tokens [start, start + len(values)) of the block list <- values."""
    done = 0
    for row, length in token_rows(blocks, block_size, start, values.shape[0]):
        copy_rows(rows[row : row + length], values[done : done + length])
        done += length


def read_tokens(
    rows: torch.Tensor, blocks: Sequence[int], block_size: int, start: int, count: int
) -> torch.Tensor:
    """A copy of tokens [start, start + count) of the block list."""
    out = rows.new_empty((count, *rows.shape[1:]))
    done = 0
    for row, length in token_rows(blocks, block_size, start, count):
        copy_rows(out[done : done + length], rows[row : row + length])
        done += length
    return out


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Between contiguous CPU tensors of one dtype, a memmove on this
    thread: torch's copy_ splits a copy of more than 32K elements over its OpenMP
    threads, and their fork/join waits for cores that the network keeps busy
    (py-spy on a gRPC receiver: most of its pool writes were libgomp barriers)."""
    if dst.shape != src.shape:
        raise ValueError(f"cannot copy {tuple(src.shape)} rows into {tuple(dst.shape)}")
    on_cpu = dst.device.type == src.device.type == "cpu"
    if on_cpu and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
    else:
        dst.copy_(src)


class EmbeddingPool:
    def __init__(
        self,
        layout: PoolLayout,
        tensors: Sequence[torch.Tensor],
        segments: Sequence[SharedSegment] = (),
    ) -> None:
        assert [tuple(t.shape) for t in tensors] == [
            (layout.num_rows, p.width) for p in layout.planes
        ]
        self.layout = layout
        self.tensors = list(tensors)  # one per plane, in the layout's order
        self.segments = list(segments)
        self.allocator = BlockAllocator(layout.num_blocks, layout.block_size)

    @classmethod
    def in_host_memory(cls, layout: PoolLayout, pin: bool = False) -> EmbeddingPool:
        def alloc(width: int) -> torch.Tensor:
            t = torch.zeros(layout.num_rows, width, dtype=layout.dtype)
            return t.pin_memory() if pin else t

        return cls(layout, [alloc(p.width) for p in layout.planes])

    @classmethod
    def in_shared_memory(cls, layout: PoolLayout) -> EmbeddingPool:
        segments = [SharedSegment.create(layout.plane_bytes(p), p.name) for p in layout.planes]
        tensors = [
            s.tensor(layout.dtype, (layout.num_rows, p.width))
            for s, p in zip(segments, layout.planes, strict=True)
        ]
        return cls(layout, tensors, segments)

    @classmethod
    def on_cuda(cls, layout: PoolLayout, device: torch.device) -> EmbeddingPool:
        return cls(
            layout,
            [
                torch.zeros(layout.num_rows, p.width, dtype=layout.dtype, device=device)
                for p in layout.planes
            ],
        )

    @property
    def shm_names(self) -> tuple[str, ...]:
        """The shared-memory segment of each plane."""
        if not self.segments:
            raise ValueError("this pool is not in shared memory")
        return tuple(s.name for s in self.segments)

    def write(self, blocks: Sequence[int], start: int, planes: Sequence[torch.Tensor]) -> None:
        """Tokens [start, start + n) of the block list <- one [n, width] tensor per plane."""
        if len(planes) != len(self.tensors):
            raise ValueError(f"{len(planes)} planes given; the pool holds {self.layout.describe()}")
        for rows, values in zip(self.tensors, planes, strict=True):
            write_tokens(rows, blocks, self.layout.block_size, start, values.to(self.layout.dtype))

    def read(self, blocks: Sequence[int], start: int, count: int) -> list[torch.Tensor]:
        """A copy of tokens [start, start + count) of the block list, per plane,
        finished when this returns: the blocks may be freed and written again (on a
        GPU, by another process over CUDA IPC) straight away."""
        parts, copied = self.stage(blocks, start, count)
        if copied is not None:
            copied.synchronize()
        return parts

    def stage(
        self, blocks: Sequence[int], start: int, count: int
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """`read` without waiting: in host memory the copies are done (None); on a
        GPU they are queued on the device's stream, behind what it holds (the
        engine's step in flight), and the event marks their end: only then may the
        blocks be written again. Work queued on that stream later (the engine's
        use of the copies) sees them whole."""
        bs = self.layout.block_size
        parts = [read_tokens(rows, blocks, bs, start, count) for rows in self.tensors]
        if not (self.tensors and self.tensors[0].is_cuda):
            return parts, None
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.tensors[0].device))
        return parts, copied

    def close(self) -> None:
        # Views first: a segment cannot close while a tensor still exports its buffer.
        self.tensors = []
        for segment in self.segments:
            segment.close()
        self.segments = []
