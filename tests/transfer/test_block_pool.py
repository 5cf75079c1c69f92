"""BlockPool: waiting for blocks, in order, with deadlines, giving back what a
caller that left was handed."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.transfer.allocator import BlockAllocator
from services.transfer.block_pool import BlockPool
from services.transfer.state import PoolExhaustedError

pytestmark = pytest.mark.asyncio


def _pool() -> BlockPool:
    return BlockPool(BlockAllocator(num_blocks=4, block_size=10))


async def test_waiters_are_served_in_arrival_order() -> None:
    pool = _pool()
    held = await pool.allocate(40, 1)
    big = asyncio.create_task(pool.allocate(30, 5))
    await asyncio.sleep(0)
    small = asyncio.create_task(pool.allocate(10, 5))
    await asyncio.sleep(0)
    pool.free(held[:1])  # room for the small one only: it waits behind the big one
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done()
    pool.free(held[1:])
    assert len(await big) == 3 and len(await small) == 1
    assert pool.num_waiting == 0


async def test_allocate_up_to_takes_what_is_free() -> None:
    pool = _pool()
    held = await pool.allocate(30, 1)
    assert len(await pool.allocate_up_to(35, 1)) == 1
    waiting = asyncio.create_task(pool.allocate_up_to(100, 5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    pool.free(held)
    assert len(await waiting) == 3


async def test_a_deadline_is_pool_exhausted_and_leaves_the_line() -> None:
    pool = _pool()
    held = await pool.allocate(40, 1)
    with pytest.raises(PoolExhaustedError, match=r"no room for 10 tokens within 0\.05s"):
        await pool.allocate(10, 0.05)
    assert pool.num_waiting == 0
    pool.free(held)
    pool.allocator.check_integrity()
    assert pool.allocator.num_free_blocks == 4


async def test_a_request_larger_than_the_pool_fails_at_once() -> None:
    with pytest.raises(PoolExhaustedError, match="exceed the whole pool"):
        await _pool().allocate(41, 10)


async def test_a_cancelled_waiter_leaves_the_line_and_leaks_nothing() -> None:
    pool = _pool()
    held = await pool.allocate(40, 1)
    before = asyncio.create_task(pool.allocate(20, 5))
    behind = asyncio.create_task(pool.allocate(20, 5))
    await asyncio.sleep(0)
    before.cancel()
    with pytest.raises(asyncio.CancelledError):
        await before
    assert pool.num_waiting == 1
    pool.free(held[:2])  # enough for the one left in line
    assert len(await behind) == 2

    racing = asyncio.create_task(pool.allocate(20, 5))
    await asyncio.sleep(0)
    pool.free(held[2:])  # served, then cancelled before it resumes
    racing.cancel()
    with contextlib.suppress(asyncio.CancelledError):  # if it lost, the pool took them back
        pool.free(await racing)  # it won the race: its blocks are its own
    assert pool.allocator.num_free_blocks == 2
    pool.allocator.check_integrity()


@pytest.mark.parametrize("turns", [0, 1])  # event-loop turns between serving and cancelling
async def test_a_caller_cancelled_as_it_is_served_is_cancelled_and_gives_them_back(
    turns: int,
) -> None:
    """Cancelled at any moment between being served and resuming: the caller sees
    CancelledError, never blocks that it would then hold without knowing it was
    cancelled (asyncio.wait_for on Python 3.11 can swallow such a cancel)."""
    pool = _pool()
    held = await pool.allocate(40, 1)
    caller = asyncio.create_task(pool.allocate(20, 5))
    await asyncio.sleep(0)
    pool.free(held[:2])
    for _ in range(turns):
        await asyncio.sleep(0)
    assert not caller.done()  # served, not resumed yet
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert pool.allocator.num_free_blocks == 2
    pool.allocator.check_integrity()
