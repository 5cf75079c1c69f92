"""The vision towers as EPD runs them on the CPU: HF's, with two parts swapped.

- The attention, with EPD's fused rotary embedding. HF's Qwen2-VL, Qwen2.5-VL
  and Qwen3-VL vision attention rotates q and k in float32 as a dozen operators
  (casts up and back, rotate_half's slices, negation and concat, four
  multiplies, two adds), each a pass over every patch: 39 of the small demo's
  300 ms an image in bfloat16 on a 2-core AVX512-BF16 EPYC. csrc/fused_ops.c's
  rotary does it in one pass over the fused QKV projection's output, in float32
  and rounded once, as HF does: bit-equal to HF's. Windows of the same length
  attend in one SDPA call instead of one call each; in bfloat16 where the CPU
  has AMX or AVX512-BF16, all windows in one call of csrc/paged_attention.c's
  window kernel (the language model's prefill kernel, unmasked), which reads q,
  k and v from the QKV projection's output in place. torch's CPU flash attention
  was 38 % of the small demo's tower in bfloat16 on a 2-core AVX512-BF16 EPYC
  (33 of 87 ms an image); one 448x448 image a forward: 92 -> 67 ms (small),
  384 -> 304 ms (medium). Within bfloat16 rounding of SDPA, not bit-equal.
- Wherever oneDNN packs the dtype, the patch embedding. HF's is a Conv3d
  whose kernel is its stride: each patch's pixels times the weight, a GEMM,
  which vLLM runs as one
  (`Conv3dLayer`). torch's bfloat16 Conv3d takes 47 ms for a 448x448 image's
  1024 patches on a 2-core AMX Xeon, the GEMM 1.2 ms (float32: 24 ms and 3.8
  ms). The GEMM sums the products in another order: in float32 the tower is
  within float32 rounding of HF's, in bfloat16 within a bfloat16 step.
- In bfloat16, the projections and norms as the language model runs them: every
  nn.Linear on oneDNN's packed weights (linear.PackedLinear; torch's unpacked
  bf16 addmm ran the medium tower's at ~1.3 TFLOPS on a 2-core AMX Xeon, the
  packed GEMM the language model's at ~2.2), and Qwen2.5-VL's RMSNorms, the
  residual add before the second one included, in csrc/fused_ops.c (HF's is
  seven operators, the add an eighth: 3.8 ms against 0.3 for one norm of 2048
  patches of 768). One 448x448 image a forward, the two towers alternating in
  one process: the small tower 64 -> 52 ms, the medium one 265 -> 233. Both
  round differently from HF's operators (another blocking of the GEMM; the
  norm's sum in another order), so in bfloat16 the tower is close to HF's
  (tests/layers/test_vision_tower.py) rather than equal to it, as the
  language model in bfloat16 is.
- In both dtypes, Qwen2.5-VL's norms (above) and its gated MLP as the language
  model runs them: gate and up one GEMM on stacked weights, SiLU(gate) * up one
  pass (HF's: two GEMMs and three operators). float32, one 448x448 image a
  forward, the old and new towers alternating in one process on a 2-core AVX2
  Zen 3 EPYC: the small tower 442 -> 427 ms, the medium one 2063 -> 1979
  (medians); within 1.2e-6 of the tower before (relative).
- In float32 where torch runs AVX-512, the projections on oneDNN's packed
  weights as well: F.linear's GEMM is MKL's, which on AMD CPUs runs its AVX2
  code there (~200 GFLOPS on a 2-core Zen 5, oneDNN's ~1.9x that): one 448x448
  image a forward (bench/vision.py), the small tower 284 -> 170 ms, the medium
  one 1369 -> 743; the patch embedding as a GEMM there too: 170 -> 161 and 743
  -> 707. Without AVX-512 the projections stay on F.linear, as the language
  model's prompt-sized ones do (linear.py's "cpu"): on a 2-core AVX2 Zen 3 EPYC
  (torch 2.13) MKL ran the tower's at ~160 GFLOPS, oneDNN's packed GEMM at
  ~145; the small tower 367 ms packed, 338 on F.linear (329 with
  malloc.keep_freed_memory, which Triton's model calls), the medium one 1703
  and 1538. (On another such host a session had measured the reverse, MKL
  ~100-115 against oneDNN's ~120-135, with the whole tower ~1.8x slower.) Both
  are within float32 rounding of HF's tower, as the language model is.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.layers.backends import avx512
from services.layers.cpu_kernels import (
    FusedOps,
    Kernel,
    bf16_window_attention,
    fused_ops,
)
from services.layers.language_model import MLP, RMSNorm
from services.layers.linear import onednn_supports, pack_linears

logger = logging.getLogger(__name__)


class FusedVisionAttention(nn.Module):
    """An HF vision attention's weights (qkv, proj), its forward with the fused
    rotary embedding and, given one (bfloat16), the compiled window kernel."""

    def __init__(self, attention: nn.Module, ops: FusedOps, kernel: Kernel | None = None) -> None:
        super().__init__()
        self.qkv = attention.get_submodule("qkv")
        self.proj = attention.get_submodule("proj")
        self.num_heads: int = cast(int, attention.num_heads)
        self.head_dim: int = cast(int, attention.head_dim)
        self.scaling: float = cast(float, attention.scaling)
        self.ops = ops
        self.kernel = kernel

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
        out = torch.empty(n, heads, self.head_dim, dtype=qkv.dtype)
        if self.kernel is not None and qkv.dtype == torch.bfloat16:
            starts = cu_seqlens.to(torch.int64).contiguous()
            failed = self.kernel(
                out.data_ptr(),
                qkv.data_ptr(),
                qkv[:, heads].data_ptr(),
                qkv[:, 2 * heads].data_ptr(),
                starts.data_ptr(),
                len(starts) - 1,
                heads,
                self.head_dim,
                qkv.stride(0),
                self.scaling,
                torch.get_num_threads(),
            )
            if failed:
                raise MemoryError("vision attention: no memory for its tiles")
            return self.proj(out.view(n, -1))
        q, k, v = qkv.view(n, 3, heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
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


class FusedVisionMLP(MLP):
    """Qwen2.5-VL's gated MLP (gate_proj, up_proj, down_proj; SiLU) as the language
    model's MLP, whose forward it runs: gate and up one GEMM on their stacked
    weights (and biases), SiLU(gate) * up one pass (FusedOps.silu_mul)."""

    def __init__(self, mlp: nn.Module, ops: FusedOps) -> None:
        nn.Module.__init__(self)  # the HF MLP's weights replace MLP's parameters
        gate = cast(nn.Linear, mlp.get_submodule("gate_proj"))
        up = cast(nn.Linear, mlp.get_submodule("up_proj"))
        biased = gate.bias is not None
        self.gate_up_proj = nn.Linear(
            gate.in_features, gate.out_features + up.out_features, biased, device="meta"
        )
        self.gate_up_proj.weight = nn.Parameter(
            torch.cat([gate.weight, up.weight]).detach(), requires_grad=False
        )
        if biased:
            self.gate_up_proj.bias = nn.Parameter(
                torch.cat([gate.bias, up.bias]).detach(), requires_grad=False
            )
        self.down_proj = cast(nn.Linear, mlp.get_submodule("down_proj"))
        self.ops = ops


class FusedVisionBlock(nn.Module):
    """A Qwen2.5-VL vision block (RMSNorms) with the language model's norms: the
    second norm takes the residual add with it, in one pass."""

    def __init__(self, block: nn.Module, ops: FusedOps) -> None:
        super().__init__()
        self.norm1 = _fused_norm(block.get_submodule("norm1"), ops)
        self.norm2 = _fused_norm(block.get_submodule("norm2"), ops)
        self.attn = block.get_submodule("attn")
        self.mlp = block.get_submodule("mlp")

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attended = self.attn(
            self.norm1(hidden_states),
            cu_seqlens=cu_seqlens,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states, normed = self.norm2.add(hidden_states, attended)
        return hidden_states + self.mlp(normed)


def _is_rms_norm(norm: nn.Module) -> bool:
    """Whether `norm` is HF's Qwen2RMSNorm (Qwen2.5-VL's tower), not a LayerNorm
    (Qwen2-VL's, Qwen3-VL's)."""
    return hasattr(norm, "variance_epsilon")


def _is_gated_silu(tower: nn.Module, mlp: nn.Module) -> bool:
    """Whether `mlp` is Qwen2.5-VL's gated MLP on SiLU (Qwen2-VL's and Qwen3-VL's
    are two projections around a GELU)."""
    act = getattr(getattr(tower, "config", None), "hidden_act", None)
    return hasattr(mlp, "gate_proj") and act == "silu"


def _fused_norm(norm: nn.Module, ops: FusedOps) -> RMSNorm:
    """HF's Qwen2RMSNorm (`weight`, `variance_epsilon`) as the language model's."""
    weight = cast(nn.Parameter, norm.weight)
    fused = RMSNorm(weight.shape[0], cast(float, norm.variance_epsilon))
    fused.weight = weight
    fused.ops = ops
    return fused


class LinearPatchEmbedding(nn.Module):
    """A patch embedding's Conv3d whose kernel is its stride, as the GEMM it is:
    patches [N, channels, t, h, w] -> [N, out, 1, 1, 1], the shape HF's patch
    embedding reads the convolution's output in."""

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        assert tuple(conv.kernel_size) == tuple(conv.stride) and conv.padding == (0, 0, 0)
        self.weight = nn.Parameter(conv.weight.detach().flatten(1), requires_grad=False)
        self.bias = None if conv.bias is None else conv.bias.detach()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        out = F.linear(patches.flatten(1), self.weight, self.bias)
        return out.view(*out.shape, 1, 1, 1)


def fuse_vision_tower(tower: nn.Module) -> int:
    """Swaps, in a CPU vision tower (`load_vision_tower`'s), where the kernels
    build: each block's attention for a FusedVisionAttention, a gated SiLU MLP for
    a FusedVisionMLP, each RMSNorm block for a FusedVisionBlock, the merger's
    RMSNorm for the language model's; where oneDNN packs the tower's dtype
    (float32 wherever torch has oneDNN, bfloat16 where the CPU has the
    instructions), the patch embedding's convolution for a LinearPatchEmbedding
    and, in bfloat16 and in float32 where torch runs AVX-512, every nn.Linear for
    a PackedLinear. Returns how many modules it swapped (0 for a tower that is
    not on the CPU)."""
    weight = next(tower.parameters())
    if weight.device.type != "cpu":
        return 0
    bf16 = weight.dtype == torch.bfloat16
    packs = onednn_supports(weight.dtype)
    swapped = 0
    if packs:
        embedding = tower.get_submodule("patch_embed")
        embedding.proj = LinearPatchEmbedding(cast(nn.Conv3d, embedding.proj))
        swapped += 1
    ops = fused_ops()
    if ops is not None:
        blocks = cast(nn.ModuleList, tower.get_submodule("blocks"))
        for i, block in enumerate(blocks):
            attention = block.get_submodule("attn")
            head_dim = cast(int, attention.head_dim)
            kernel = bf16_window_attention(head_dim) if bf16 else None
            block.attn = FusedVisionAttention(attention, ops, kernel)
            if _is_gated_silu(tower, block.get_submodule("mlp")):
                block.mlp = FusedVisionMLP(block.get_submodule("mlp"), ops)
            if _is_rms_norm(block.get_submodule("norm1")):
                blocks[i] = FusedVisionBlock(block, ops)
        swapped += len(blocks)
        merger = tower.get_submodule("merger")
        ln_q = getattr(merger, "ln_q", None)  # Qwen3-VL's merger has a `norm`
        if ln_q is not None and _is_rms_norm(ln_q):
            merger.ln_q = _fused_norm(ln_q, ops)
            swapped += 1
    if packs and (bf16 or avx512()):
        swapped += pack_linears(tower)
    logger.info("vision tower: %d modules swapped for faster ones (vision_tower.py)", swapped)
    return swapped
