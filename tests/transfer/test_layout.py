from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.transfer.embedding_pool import EmbeddingPool, copy_rows, read_tokens, write_tokens
from services.transfer.layout import PoolLayout, copy_runs, embedding_planes, token_rows
from services.wire.messages import Plane


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
    layout = PoolLayout(6, 4, embedding_planes(3, deepstack_levels=2))
    assert [(p.name, p.width) for p in layout.planes] == [("embeddings", 3), ("deepstack", 6)]
    pool = EmbeddingPool.in_shared_memory(layout)
    try:
        blocks = pool.allocator.allocate(10)
        assert blocks is not None
        embeds = torch.randn(10, 3)
        deep = torch.randn(10, 6)
        pool.write(blocks, 0, [embeds, deep])
        got, got_deep = pool.read(blocks, 0, 10)
        assert torch.equal(got, embeds)
        assert torch.equal(got_deep, deep)
        assert len(set(pool.shm_names)) == 2  # a segment per plane
        with pytest.raises(ValueError, match="1 planes given"):
            pool.write(blocks, 0, [embeds])
    finally:
        pool.close()


@pytest.mark.parametrize(
    "planes",
    [(), (Plane("embeddings", 0),), (Plane("a", 2), Plane("a", 3))],
    ids=["none", "zero-width", "same-name"],
)
def test_layout_refuses_bad_planes(planes: tuple[Plane, ...]) -> None:
    with pytest.raises(ValueError):
        PoolLayout(4, 4, planes)


def test_shared_memory_segments_are_private_and_removed() -> None:
    import os
    import stat

    pool = EmbeddingPool.in_shared_memory(PoolLayout(2, 4, embedding_planes(8)))
    name = pool.shm_names[0]
    path = f"/dev/shm/{name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    pool.close()
    assert not os.path.exists(path)


def test_write_tokens_at_an_offset() -> None:
    rows = torch.zeros(16, 1)
    write_tokens(rows, [2, 0], 4, 3, torch.tensor([[1.0], [2.0], [3.0]]))
    assert rows[11, 0] == 1 and rows[0, 0] == 2 and rows[1, 0] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_rows_copies_exactly_whatever_the_layout(dtype: torch.dtype) -> None:
    """The pools' copy: a memmove between contiguous CPU rows of one dtype
    (300K elements: torch would have split it over threads), copy_ otherwise
    (a strided source, another dtype); the same bytes either way."""
    src = torch.randn(1200, 256).to(dtype)
    dst = torch.zeros(1200, 256, dtype=dtype)
    copy_rows(dst, src)
    assert torch.equal(dst, src)
    strided = torch.randn(256, 1200).to(dtype).t()
    copy_rows(dst, strided)
    assert torch.equal(dst, strided)
    wider = torch.randn(1200, 256, dtype=torch.float64)
    copy_rows(dst, wider)
    assert torch.equal(dst, wider.to(dtype))
    with pytest.raises(ValueError, match="cannot copy"):
        copy_rows(dst[:10], src[:11])
