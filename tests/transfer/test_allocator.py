from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.transfer.allocator import BlockAllocator


def test_allocates_whole_blocks_and_frees() -> None:
    a = BlockAllocator(num_blocks=4, block_size=16)
    blocks = a.allocate(17)
    assert blocks is not None and len(blocks) == 2
    assert a.num_free_blocks == 2
    assert a.can_allocate(32) and not a.can_allocate(33)
    assert a.allocate(33) is None
    a.free(blocks)
    assert a.num_free_blocks == 4
    a.check_integrity()


def test_double_free_and_bad_ids_are_errors() -> None:
    a = BlockAllocator(2, 8)
    blocks = a.allocate(8)
    assert blocks is not None
    a.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(blocks)
    with pytest.raises(ValueError, match="out of range"):
        a.free([7])
    with pytest.raises(ValueError, match="positive"):
        a.allocate(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 100)), max_size=60))
def test_random_allocate_free_keeps_integrity(ops: list[tuple[bool, int]]) -> None:
    a = BlockAllocator(num_blocks=10, block_size=8)
    held: list[list[int]] = []
    for allocate, n in ops:
        if allocate or not held:
            blocks = a.allocate(n)
            if blocks is None:
                assert not a.can_allocate(n)
            else:
                held.append(blocks)
        else:
            a.free(held.pop(n % len(held)))
        a.check_integrity()
        assert a.num_used_blocks == sum(len(b) for b in held)
    for blocks in held:
        a.free(blocks)
    assert a.num_free_blocks == 10
