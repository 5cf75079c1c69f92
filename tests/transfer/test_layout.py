from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.transfer.embedding_pool import EmbeddingPool, read_tokens, write_tokens
from services.transfer.layout import PoolLayout, copy_runs, token_rows


def test_token_rows_merge_adjacent_blocks() -> None:
    assert token_rows([3, 4, 9], 4, 2, 7) == [(14, 6), (36, 1)]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 20),
    st.integers(1, 40),
    st.randoms(use_true_random=False),
)
def test_copy_runs_move_every_token_to_its_place(
    src_bs: int, dst_bs: int, start: int, count: int, rng: object
) -> None:
    import random

    assert isinstance(rng, random.Random)
    src_blocks = rng.sample(range(64), -(-(start + count) // src_bs))
    dst_blocks = rng.sample(range(64), -(-count // dst_bs))
    src = torch.arange(64 * src_bs, dtype=torch.float32)[:, None]
    dst = torch.full((64 * dst_bs, 1), -1.0)
    for run in copy_runs(src_blocks, src_bs, start, dst_blocks, dst_bs, 0, count):
        dst[run.dst_row : run.dst_row + run.length] = src[run.src_row : run.src_row + run.length]
    expected = read_tokens(src, src_blocks, src_bs, start, count)
    assert torch.equal(read_tokens(dst, dst_blocks, dst_bs, 0, count), expected)


def test_pool_write_read_round_trip_with_deepstack() -> None:
    layout = PoolLayout(num_blocks=6, block_size=4, hidden_size=3, deepstack_levels=2)
    pool = EmbeddingPool.in_shared_memory(layout)
    try:
        blocks = pool.allocator.allocate(10)
        assert blocks is not None
        embeds = torch.randn(10, 3)
        deep = torch.randn(10, 6)
        pool.write(blocks, 0, embeds, deep)
        got, got_deep = pool.read(blocks, 0, 10)
        assert torch.equal(got, embeds)
        assert got_deep is not None and torch.equal(got_deep, deep)
        names = pool.shm_names
        assert all(names)
    finally:
        pool.close()


def test_shared_memory_segments_are_private_and_removed() -> None:
    import os
    import stat

    pool = EmbeddingPool.in_shared_memory(PoolLayout(2, 4, 8))
    name = pool.shm_names[0]
    path = f"/dev/shm/{name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    pool.close()
    assert not os.path.exists(path)


def test_write_tokens_at_an_offset() -> None:
    rows = torch.zeros(16, 1)
    write_tokens(rows, [2, 0], 4, 3, torch.tensor([[1.0], [2.0], [3.0]]))
    assert rows[11, 0] == 1 and rows[0, 0] == 2 and rows[1, 0] == 3
