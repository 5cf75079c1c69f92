"""Staging a finished part out of a GPU receive pool: its blocks go back only
once the copy out of them has run, and nothing waits for that on the event loop
(the copy may queue behind an engine step). Here the pool is in host memory and
its copy's CUDA event a stand-in that ends when the test says; the gpu test
queues the copy behind real GPU work."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from services.transfer.embedding_pool import EmbeddingPool, tensor_bytes
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.transports.grpc_stream import GrpcReceiveEnd
from services.wire.messages import EmbeddingMeta, TransferDone
from services.wire.transport import Transport
from tests.until import until

LAYOUT = PoolLayout(4, 4, embedding_planes(3))


class _HeldCopy:
    """A copy that runs until `done` is set (what a CUDA event's synchronize waits for)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "the copy was never let finish"


class _HeldCopies(EmbeddingPool):
    copies: list[_HeldCopy]

    def stage(
        self, blocks: Sequence[int], start: int, count: int
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        parts, _ = super().stage(blocks, start, count)
        self.copies.append(_HeldCopy())
        return parts, self.copies[-1]  # type: ignore[return-value]


async def _received(driver: ReceiverDriver, values: torch.Tensor) -> None:
    """Eight tokens over the gRPC stream, in the two blocks expect() preallocates."""
    await driver.expect("r", 8)
    planes = LAYOUT.planes
    await driver.on_message(
        EmbeddingMeta("r", "L", 8, (), planes, torch.float32, "E", Transport.GRPC)
    )
    driver.write_chunk("r", 0, 8, [tensor_bytes(values)], "E")
    await driver.on_message(TransferDone("r", 8, 8, Transport.GRPC))
    await driver.wait("r")


async def test_staged_blocks_go_back_once_their_copy_has_run() -> None:
    pool = _HeldCopies.in_host_memory(LAYOUT)
    pool.copies = []
    driver = ReceiverDriver(pool, lambda message: None, {Transport.GRPC: GrpcReceiveEnd(str)})
    values = torch.randn(8, 3)
    await _received(driver, values)
    planes = await driver.take("r")  # returns while the copy runs
    assert torch.equal(planes["embeddings"], values)
    assert pool.allocator.num_free_blocks == 2  # both of its blocks still held
    ticks = 0
    for _ in range(5):  # the loop goes on meanwhile
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and pool.allocator.num_free_blocks == 2
    (copy,) = pool.copies
    copy.done.set()
    await until(lambda: pool.allocator.num_free_blocks == 4)
    pool.allocator.check_integrity()


async def test_host_memory_frees_at_once() -> None:
    pool = EmbeddingPool.in_host_memory(LAYOUT)
    driver = ReceiverDriver(pool, lambda message: None, {Transport.GRPC: GrpcReceiveEnd(str)})
    await _received(driver, torch.randn(8, 3))
    await driver.take("r")
    assert pool.allocator.num_free_blocks == 4


@pytest.mark.gpu
async def test_a_gpu_pool_stages_without_blocking_the_loop() -> None:
    """The copy out of a CUDA pool queues behind a second of GPU work on the
    device's stream (as it would behind an engine step): take() returns before it
    runs, the loop keeps ticking, and the blocks come back after it."""
    device = torch.device("cuda")
    pool = EmbeddingPool.on_cuda(LAYOUT, device)
    driver = ReceiverDriver(pool, lambda message: None, {Transport.GRPC: GrpcReceiveEnd(str)})
    values = torch.randn(8, 3)
    await _received(driver, values)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy device stream
    started = time.monotonic()
    planes = await driver.take("r")
    assert time.monotonic() - started < 0.2
    assert pool.allocator.num_free_blocks == 2
    await until(lambda: pool.allocator.num_free_blocks == 4, timeout_s=10)
    assert torch.equal(planes["embeddings"].cpu(), values)
