"""CUDA IPC: a pool exported by one process, written by another (GPU only):
from a GPU pool, and from pinned host memory as the encoder's send buffer is."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.transports.base import Part
from services.transfer.transports.cuda_ipc import CudaIpcMemory, CudaIpcWriter
from services.wire.messages import PoolDescriptor, Register, Role

pytestmark = pytest.mark.gpu

LAYOUT = PoolLayout(8, 16, embedding_planes(32, deepstack_levels=2), torch.bfloat16)


def _receiver(queue: mp.Queue, done: mp.Event) -> None:  # type: ignore[type-arg]
    exported = CudaIpcMemory(LAYOUT, torch.device("cuda", 0))
    queue.put(exported.endpoint())
    done.wait(60)
    # bits by value: a tensor would go by a file descriptor this process takes
    # with it when it exits, before the test reads it (seen on an H100)
    queue.put(
        [plane.cpu().view(torch.int16).numpy() for plane in exported.pool.read([5, 2], 0, 20)]
    )
    exported.close()


@pytest.mark.parametrize("source_kind", ["cuda", "pinned-host"])
def test_cuda_ipc_write_is_bit_exact(source_kind: str) -> None:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_receiver, args=(queue, done))
    child.start()
    endpoint = queue.get(timeout=60)
    assert endpoint.pci_bus_id  # the writer finds the GPU by it, not by index
    peer = Register(
        Role.LANGUAGE,
        "gpu-lang",
        "",
        "h",
        (),
        "m",
        PoolDescriptor(
            LAYOUT.num_blocks,
            LAYOUT.block_size,
            LAYOUT.planes,
            LAYOUT.dtype,
            cuda_ipc=endpoint,
        ),
    )
    if source_kind == "cuda":
        source = EmbeddingPool.on_cuda(LAYOUT, torch.device("cuda", 0))
    else:
        source = EmbeddingPool.in_host_memory(LAYOUT, pin=True)
        assert source.tensors[0].is_pinned()
    device = "cuda" if source_kind == "cuda" else "cpu"
    values = [torch.randn(20, p.width, dtype=LAYOUT.dtype, device=device) for p in LAYOUT.planes]
    source.write([1, 3], 0, values)
    writer = CudaIpcWriter()
    asyncio.run(writer.write(peer, source, Part("r", [1, 3], 0, 20, [5, 2])))
    done.set()
    received = queue.get(timeout=60)
    child.join(60)
    assert all(
        torch.equal(torch.from_numpy(r).view(LAYOUT.dtype), v.cpu())
        for r, v in zip(received, values, strict=True)
    )
    asyncio.run(writer.close())
