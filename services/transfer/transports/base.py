"""Both ends of a transport: the encoder's Writer and the language side's
ReceiveEnd. Each transport module implements the two; callers hold them by
`Transport` and never branch on which one they have."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, copy_runs
from services.wire.messages import PoolDescriptor, PoolEndpoint, Register
from services.wire.transport import Transport


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a request's embeddings: `count` tokens from token `start` of the
    sender's blocks into the receiver's blocks (starting at their first slot)."""

    request_id: str
    src_blocks: Sequence[int]
    start: int
    count: int
    dst_blocks: Sequence[int]


class Writer(Protocol):
    @property
    def transport(self) -> Transport: ...

    async def write(self, peer: Register, source: EmbeddingPool, part: Part) -> None:
        """Returns once the part is in the receiver's memory."""

    async def forget(self, instance_id: str) -> None:
        """Drops what is kept for a peer that left."""

    async def close(self) -> None: ...


class ReceiveEnd(Protocol):
    """The language side: how the receive pool is reached, and when a part is in it."""

    @property
    def transport(self) -> Transport: ...

    @property
    def polled(self) -> bool:
        """Arrivals are polled for: faster while `busy()` (see `start`)."""

    def endpoint(self) -> PoolEndpoint:
        """What the language instance's registration carries for this transport."""

    def start(self, busy: Callable[[], bool]) -> None: ...

    def announced(self, request_id: str) -> None:
        """A request's data will come this way (its metadata said so)."""

    async def confirm(
        self, request_id: str, encoder_id: str, sent_tokens: int, timeout_s: float
    ) -> None:
        """Returns once the part that ends at sent_tokens is in the pool."""

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that ended (or changed encoder)."""

    def close(self) -> None: ...


class WrittenBeforeDone:
    """A receive end for transports whose writer finishes before it sends
    TransferDone (shm, CUDA IPC; gRPC, whose chunks the receiver counts): the
    part is in the pool when TransferDone arrives."""

    polled = False

    def start(self, busy: Callable[[], bool]) -> None:
        pass

    def announced(self, request_id: str) -> None:
        pass

    async def confirm(
        self, request_id: str, encoder_id: str, sent_tokens: int, timeout_s: float
    ) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadCopies:
    """Copies into a peer's mapped memory, each on a worker thread, which a
    cancelled write does not stop: the mapping may close only once `settled`
    returns, or a copy still running writes into memory no longer mapped
    (SIGSEGV: a prefill instance died so when its decode instance died
    mid-hand-off)."""

    def __init__(self) -> None:
        self.running: set[asyncio.Future[None]] = set()

    async def run(self, copy: Callable[..., None], *args: Any) -> None:
        task = asyncio.ensure_future(asyncio.to_thread(copy, *args))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        await asyncio.shield(task)  # a cancelled caller leaves the copy running, and counted

    async def settled(self) -> None:
        await asyncio.gather(*self.running, return_exceptions=True)


class MappedPool(Protocol):
    """A peer's pool mapped into this process (shm segments, CUDA IPC handles)."""

    layout: PoolLayout
    tensors: list[torch.Tensor]
    copies: ThreadCopies

    def close(self) -> None: ...


M = TypeVar("M", bound=MappedPool)


class MappedWriter(Generic[M]):
    """A writer that maps each peer's pool once, on its first part, and copies
    parts into it on worker threads (shm, CUDA IPC): `_map` opens a peer's pool,
    `_copy` copies a part into it. A peer's mapping closes only once its copies
    have settled (ThreadCopies)."""

    def __init__(self) -> None:
        self._mapped: dict[str, M] = {}

    def _map(self, peer: Register) -> M:
        raise NotImplementedError

    def _copy(self, source: EmbeddingPool, mapped: M, part: Part) -> None:
        raise NotImplementedError

    async def write(self, peer: Register, source: EmbeddingPool, part: Part) -> None:
        mapped = self._mapped.get(peer.instance_id)
        if mapped is None:
            mapped = self._mapped[peer.instance_id] = self._map(peer)
        check_compatible(source.layout, mapped.layout, peer.instance_id)
        await mapped.copies.run(self._copy, source, mapped, part)

    async def forget(self, instance_id: str) -> None:
        mapped = self._mapped.pop(instance_id, None)
        if mapped is not None:
            await mapped.copies.settled()
            mapped.close()

    async def close(self) -> None:
        for instance_id in list(self._mapped):
            await self.forget(instance_id)


def copy_part(
    source: EmbeddingPool,
    targets: Sequence[torch.Tensor],
    target_block_size: int,
    part: Part,
    non_blocking: bool = False,
) -> None:
    """Copies a part into the receiver's tensors (one per plane), one copy per run
    that is contiguous on both sides: the data plane of shm and cuda_ipc."""
    runs = copy_runs(
        part.src_blocks,
        source.layout.block_size,
        part.start,
        part.dst_blocks,
        target_block_size,
        0,
        part.count,
    )
    for src, dst in zip(source.tensors, targets, strict=True):
        for run in runs:
            dst[run.dst_row : run.dst_row + run.length].copy_(
                src[run.src_row : run.src_row + run.length], non_blocking=non_blocking
            )


def receiver_layout(peer: Register) -> PoolLayout:
    pool: PoolDescriptor | None = peer.pool
    if pool is None:
        raise ValueError(f"{peer.instance_id} has no receive pool")
    return PoolLayout(pool.num_blocks, pool.block_size, pool.planes, pool.dtype)


def check_compatible(source: PoolLayout, target: PoolLayout, peer: str) -> None:
    if (source.planes, source.dtype) != (target.planes, target.dtype):
        raise ValueError(
            f"embeddings ({source.describe()}) do not fit {peer}'s pool ({target.describe()})"
        )
