"""BlockAllocator: fixed-size token blocks handed out from a free list.

Pure bookkeeping, no device code. Both block pools of the project use it: the
embedding pools (language receive pool, encoder send buffer) and the KV cache.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need positive num_blocks and block_size, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks covering num_tokens (at least one), or None if too few are free."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(need)]
        for block in blocks:
            self._used[block] = True
        return blocks

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        return self.allocate(num_blocks * self.block_size) if num_blocks > 0 else []

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} is out of range [0, {self.num_blocks})")
            if not self._used[block]:
                raise ValueError(f"block {block} is freed twice")
            self._used[block] = False
            self._free.append(block)

    def check_integrity(self) -> None:
        """Every block is either free (once) or used, never both."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert (block in free) != self._used[block], (
                f"block {block} is both/neither free and used"
            )
