"""PoolLayout and the token-run index math every transport shares.

A pool stores tokens in blocks, for each of its planes (the embeddings, the
deepstack features; later KV): block b, slot o is flat row b * block_size + o
of each plane's [num_blocks * block_size, width] tensor. Copying n tokens from
one block list to another splits into runs that are contiguous on both sides,
the same runs for every plane:

    src blocks (bs=4): [7      ][2      ]        token i -> row 7*4+i, then 2*4+(i-4)
    dst blocks (bs=2): [0  ][5  ][6  ][1  ]
    runs:              |0-1|2-3|4-5|6-7|          one copy (or NIXL descriptor) per run
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.wire.dtypes import DTYPE_NAMES
from services.wire.messages import Plane


def embedding_planes(hidden_size: int, deepstack_levels: int = 0) -> tuple[Plane, ...]:
    """A vision-language model's planes: the embeddings, and with deepstack the
    features of every level side by side."""
    planes: tuple[Plane, ...] = (Plane("embeddings", hidden_size),)
    if deepstack_levels:
        planes += (Plane("deepstack", deepstack_levels * hidden_size),)
    return planes


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Blocks of `block_size` tokens; per plane, a [num_rows, width] tensor."""

    num_blocks: int
    block_size: int
    planes: tuple[Plane, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size) <= 0 or not self.planes:
            raise ValueError(f"a pool needs blocks and planes: {self}")
        if min(p.width for p in self.planes) <= 0:
            raise ValueError(f"plane widths must be positive: {self}")
        if len({p.name for p in self.planes}) != len(self.planes):
            raise ValueError(f"plane names must differ: {self}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported embedding dtype {self.dtype}")

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def row_bytes(self, plane: Plane) -> int:
        return plane.width * self.element_size

    def plane_bytes(self, plane: Plane) -> int:
        return self.num_rows * self.row_bytes(plane)

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in the pool, all planes together."""
        return sum(self.row_bytes(p) for p in self.planes)

    def describe(self) -> str:
        return f"{', '.join(map(str, self.planes))} x {DTYPE_NAMES[self.dtype]}"


@dataclass(frozen=True, slots=True)
class Run:
    """`length` consecutive tokens at flat row src_row on one side, dst_row on the other."""

    src_row: int
    dst_row: int
    length: int


def token_rows(
    blocks: Sequence[int], block_size: int, start: int, count: int
) -> list[tuple[int, int]]:
    """(flat row, length) runs for tokens [start, start + count) of a block list."""
    runs: list[tuple[int, int]] = []
    token = start
    end = start + count
    while token < end:
        index, offset = divmod(token, block_size)
        if index >= len(blocks):
            raise ValueError(f"token {token} is past the {len(blocks)} blocks given")
        length = min(block_size - offset, end - token)
        row = blocks[index] * block_size + offset
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((row, length))
        token += length
    return runs


def copy_runs(
    src_blocks: Sequence[int],
    src_block_size: int,
    src_start: int,
    dst_blocks: Sequence[int],
    dst_block_size: int,
    dst_start: int,
    count: int,
) -> list[Run]:
    """Runs that copy `count` tokens, contiguous on both sides."""
    src = token_rows(src_blocks, src_block_size, src_start, count)
    dst = token_rows(dst_blocks, dst_block_size, dst_start, count)
    runs: list[Run] = []
    si = di = 0
    s_row, s_left = src[0] if src else (0, 0)
    d_row, d_left = dst[0] if dst else (0, 0)
    while si < len(src) and di < len(dst):
        length = min(s_left, d_left)
        runs.append(Run(s_row, d_row, length))
        s_row, s_left, d_row, d_left = (
            s_row + length,
            s_left - length,
            d_row + length,
            d_left - length,
        )
        if s_left == 0:
            si += 1
            if si < len(src):
                s_row, s_left = src[si]
        if d_left == 0:
            di += 1
            if di < len(dst):
                d_row, d_left = dst[di]
    return runs
