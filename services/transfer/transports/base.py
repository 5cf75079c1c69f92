"""The sender-side interface every transport implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, copy_runs
from services.wire.messages import PoolDescriptor, Register
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


def copy_part(
    source: EmbeddingPool,
    targets: Sequence[torch.Tensor],
    target_block_size: int,
    part: Part,
    non_blocking: bool = False,
) -> None:
    """Copies a part into the receiver's tensors (`source.tensors` order), one copy
    per run that is contiguous on both sides: the data plane of shm and cuda_ipc."""
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
    return PoolLayout(
        pool.num_blocks, pool.block_size, pool.hidden_size, pool.deepstack_levels, pool.dtype
    )


def check_compatible(source: PoolLayout, target: PoolLayout, peer: str) -> None:
    if (source.hidden_size, source.deepstack_levels, source.dtype) != (
        target.hidden_size,
        target.deepstack_levels,
        target.dtype,
    ):
        raise ValueError(
            f"embeddings ({source.hidden_size} x {source.dtype}, "
            f"deepstack {source.deepstack_levels}) do not fit {peer}'s pool "
            f"({target.hidden_size} x {target.dtype}, deepstack {target.deepstack_levels})"
        )
