"""The vision towers' attention with EPD's fused rotary embedding, on the CPU.

HF's Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision attention rotates q and k in
float32 as a dozen operators (casts up and back, rotate_half's slices, negation
and concat, four multiplies, two adds), each a pass over every patch: 39 of the
small demo's 300 ms an image in bfloat16 on a 2-core AVX512-BF16 EPYC.
csrc/fused_ops.c's rotary does it in one pass over the fused QKV projection's
output, in float32 and rounded once, as HF does: the tower's output stays
bit-equal to HF's (tests/encoder compare Triton's to HF's with torch.equal).
Windows of the same length attend in one SDPA call instead of one call each.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.language.engine.cpu_kernels import FusedOps, fused_ops

logger = logging.getLogger(__name__)


class FusedVisionAttention(nn.Module):
    """An HF vision attention's weights (qkv, proj), its forward with the fused
    rotary embedding."""

    def __init__(self, attention: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.qkv = attention.get_submodule("qkv")
        self.proj = attention.get_submodule("proj")
        self.num_heads: int = cast(int, attention.num_heads)
        self.head_dim: int = cast(int, attention.head_dim)
        self.scaling: float = cast(float, attention.scaling)
        self.ops = ops

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert position_embeddings is not None, "the towers this serves pass cos/sin"
        n, heads = hidden_states.shape[0], self.num_heads
        qkv = self.qkv(hidden_states).view(n, 3 * heads, self.head_dim)
        cos, sin = (t.float() for t in position_embeddings)  # float32, as HF rotates
        self.ops.rotary(qkv[:, : 2 * heads], cos, sin)
        q, k, v = qkv.view(n, 3, heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
        out = torch.empty(n, heads, self.head_dim, dtype=qkv.dtype)
        for start, length, count in _runs(cu_seqlens):
            end = start + length * count
            attended = F.scaled_dot_product_attention(
                _windows(q, start, length, count),
                _windows(k, start, length, count),
                _windows(v, start, length, count),
                scale=self.scaling,
            )
            out[start:end] = attended.transpose(1, 2).reshape(end - start, heads, self.head_dim)
        return self.proj(out.view(n, -1))


def _windows(x: torch.Tensor, start: int, length: int, count: int) -> torch.Tensor:
    """count windows of x [heads, tokens, dim] from token `start` as a view
    [count, heads, length, dim]."""
    return x[:, start : start + length * count].unflatten(1, (count, length)).transpose(0, 1)


def _runs(cu_seqlens: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """(start, length, count) for each run of consecutive windows of one length."""
    start = 0
    for length, windows in itertools.groupby(torch.diff(cu_seqlens).tolist()):
        count = len(list(windows))
        if length:
            yield start, length, count
        start += length * count


def fuse_vision_attention(tower: nn.Module) -> int:
    """Swaps each block's attention of a CPU vision tower (`load_vision_tower`'s)
    for a FusedVisionAttention; returns how many (0 where the kernels cannot be
    built, or the tower is not on the CPU)."""
    if next(tower.parameters()).device.type != "cpu":
        return 0
    ops = fused_ops()
    if ops is None:
        return 0
    blocks = cast(nn.ModuleList, tower.get_submodule("blocks"))
    for block in blocks:
        block.attn = FusedVisionAttention(block.get_submodule("attn"), ops)
    logger.info("vision tower: fused rotary embedding in %d attention layers", len(blocks))
    return len(blocks)
