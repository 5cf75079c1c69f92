"""BlockPool: a BlockAllocator that callers can wait on.

The send buffer and the receive pool both hand out blocks to requests that
may have to wait for others to give theirs back. Waiters are served in
arrival order (a large request is not starved by small ones behind it), each
up to its own deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from services.transfer.allocator import BlockAllocator
from services.transfer.state import PoolExhaustedError


@dataclass(slots=True)
class _Waiter:
    num_tokens: int
    up_to: bool  # any number of blocks (at least one), at most num_tokens' worth
    future: asyncio.Future[list[int]]


class BlockPool:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._waiters: deque[_Waiter] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def allocate(self, num_tokens: int, wait_s: float) -> list[int]:
        """Blocks for all of num_tokens, once they are free; PoolExhaustedError after wait_s."""
        if self.allocator.blocks_for(num_tokens) > self.allocator.num_blocks:
            raise PoolExhaustedError(
                f"{num_tokens} tokens exceed the whole pool "
                f"({self.allocator.num_blocks * self.allocator.block_size} tokens)"
            )
        return await self._wait(_Waiter(num_tokens, False, self._future()), wait_s)

    async def allocate_up_to(self, num_tokens: int, wait_s: float) -> list[int]:
        """At least one block, at most num_tokens' worth: what is free, once something is."""
        return await self._wait(_Waiter(num_tokens, True, self._future()), wait_s)

    def free(self, blocks: list[int]) -> None:
        if blocks:
            self.allocator.free(blocks)
            self._serve()

    @staticmethod
    def _future() -> asyncio.Future[list[int]]:
        return asyncio.get_running_loop().create_future()

    async def _wait(self, waiter: _Waiter, wait_s: float) -> list[int]:
        self._waiters.append(waiter)
        self._serve()
        try:
            async with asyncio.timeout(wait_s):  # not wait_for: on 3.11 it can swallow a cancel
                return await asyncio.shield(waiter.future)
        except BaseException as exc:
            if waiter.future.done():  # served as the caller gave up: give the blocks back
                self.free(waiter.future.result())
            else:
                self._waiters.remove(waiter)
                waiter.future.cancel()
                self._serve()  # those behind it may fit now
            if isinstance(exc, TimeoutError):
                raise PoolExhaustedError(
                    f"no room for {waiter.num_tokens} tokens within {wait_s:g}s"
                ) from None
            raise

    def _serve(self) -> None:
        """Hands free blocks to the waiters at the head of the line."""
        while self._waiters:
            waiter = self._waiters[0]
            free_tokens = self.allocator.num_free_blocks * self.allocator.block_size
            if waiter.up_to:
                tokens = min(waiter.num_tokens, free_tokens)
                if tokens <= 0:
                    return
            elif not self.allocator.can_allocate(waiter.num_tokens):
                return
            else:
                tokens = waiter.num_tokens
            blocks = self.allocator.allocate(tokens)
            assert blocks is not None
            self._waiters.popleft()
            waiter.future.set_result(blocks)
