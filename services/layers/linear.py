"""The language model's projections on CPU, ways to run them faster than
`F.linear`, at the few rows of a decode step (one per running request) and at
a prompt's.

- "cpu" (float32): EPD's kernel (csrc/linear.c) for calls of up to
  KERNEL_MAX_ROWS rows, on the weights as loaded; `F.linear` above (prefill
  chunks, where MKL's GEMM is as fast as any here). Measured on a 2-core AVX2
  EPYC, the small demo's projections, 8 layers: at 16 rows 7.2 ms against
  oneDNN's 10.3-11.5 and F.linear's 18.8; at 64 rows 0.8x F.linear's time;
  above ~90 rows F.linear is as fast or faster. The compiled decode step
  (cpu_decode.py) calls it too: a float32 decode step of 16 sequences
  (bench/engine_ab.py, 2-core Zen 5) small 10.8 -> 8.9 ms, medium 62.9 -> 59.3.
  The kernel is AVX2 code: where the CPU has AVX-512, "auto" takes "avx512".
- "avx512" (float32, where the CPU has AVX-512): EPD's kernel on its own packing
  of the weights (groups of 64 outputs, each [K, 64]), 6 rows of x by 64 outputs
  a time, at every size of call, so each weight is held once. Measured on a
  2-core Zen 5, the small demo's 32 projections against oneDNN's packed GEMM and
  the AVX2 kernel: 1 row 0.6 / 1.0 / 1.0 ms, 16 rows 1.8 / 2.1 / 3.7, 64 rows
  6.5 / 6.7 / 14.5, 2048 rows 197 / 192 / 543 (F.linear, MKL's AVX2 code on this
  AMD CPU, 458); the medium demo's at 16 rows 9.1 / 9.6, at 2048 905 / 896. The
  compiled decode step calls it.
- "onednn": oneDNN's GEMM on weights packed once into its blocked layout (a
  GEMM of few rows otherwise spends much of its time reordering the weight), as
  vLLM's CPU backend does (`create_onednn_mm` in
  `vllm/model_executor/layers/utils.py`): 1.3-2.1x faster than F.linear at 16
  rows, the same at 2048; it also runs bfloat16 where the CPU has AVX512-BF16.
- "amx" (bfloat16, where the CPU has AMX): EPD's AMX kernel (csrc/linear_bf16.c)
  for calls of up to its `max_rows` rows, on its own packing of the weights,
  oneDNN's packed GEMM above. Measured on a 2-core Sapphire Rapids, the small
  demo's 32 projections: at 16 rows 1.5 ms against oneDNN's 2.3 (2.1 against
  3.4 with the weights out of cache), at 64 rows 2.6 against 3.2; at 256 rows
  oneDNN is faster. Each weight is held twice (the tiles and oneDNN's layout).
- "avx512bf16" (bfloat16, where the CPU has AVX512-BF16 but no AMX): the same
  packing, multiplied with AVX512-BF16's dot products (linear_bf16.c), at every
  size of call: measured on a 2-core Zen 5 EPYC, the small demo's 32 projections
  at 16 rows 1.37 ms against oneDNN's 1.65, at 1 row 0.71 against 0.97, at 128
  rows 6.5 against 6.9, at 2048 104.6 against 103.7; the medium demo's 80 at 16
  rows 14.2 against 14.6 ms, at 2048 1057 against 1085. So each weight is held
  once. A decode step of 16 sequences (bench/engine_ab.py): small 4.57 -> 3.32
  ms, medium 27.2 -> 22.2 ms, with the decode step compiled (cpu_decode.py),
  which calls it.

`bench/engine.py --linear` and `bench/engine_ab.py linear A B` compare them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.layers.cpu_kernels import Bf16Linear, F32Linear, LinearKernel
from services.layers.language_model import Experts

# the row count oneDNN tunes the packed layout for (vLLM's choice); any count runs
BATCH_HINT = 32
# the most rows a call runs in EPD's kernel; F.linear's GEMM above (measured:
# the kernel 0.7-0.8x F.linear's time at 32-64 rows, no faster from ~90)
KERNEL_MAX_ROWS = 64


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build pack weights of this dtype (bfloat16 needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """An nn.Linear's weight in oneDNN's packed layout (an opaque mkldnn tensor;
    the original is dropped, unless something else holds it, as a tied lm_head's
    embedding does)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed, self.bias)


class PackedExperts(Experts):
    """MoE experts routed and summed as `Experts` does, each expert's two
    matrices packed: its gate/up and down are small GEMMs of a few rows each."""

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)  # the packed matrices replace Experts' parameters
        self.num_experts = experts.num_experts
        self.packed_gate_up = [_pack(w) for w in experts.gate_up_proj.detach()]
        self.packed_down = [_pack(w) for w in experts.down_proj.detach()]

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed_gate_up[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed_down[expert])


class Bf16PackedLinear(nn.Module):
    """An nn.Linear (bfloat16, on the CPU) whose calls of up to the kernel's
    max_rows rows (any, where it has no limit) run EPD's bfloat16 kernel (AMX or
    AVX512-BF16) on its tiles, the others oneDNN's GEMM on its packed layout (held
    only where the kernel has a limit)."""

    def __init__(self, linear: nn.Linear, kernel: Bf16Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.tiles = kernel.pack(weight)
        self.packed = None if kernel.max_rows is None else _pack(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, limit = x.numel() // x.shape[-1], self.kernel.max_rows
        if limit is not None and (rows > limit or x.stride(-1) != 1):
            assert self.packed is not None  # held wherever the kernel has a limit
            return _linear(x, self.packed, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:  # the kernel's rows must be contiguous
            flat = flat.contiguous()
        y = self.kernel(flat, self.tiles, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class F32PackedLinear(nn.Module):
    """An nn.Linear (float32, on the CPU) whose calls all run EPD's AVX-512 kernel,
    on its packing of the weight (the original is dropped, unless something else
    holds it)."""

    def __init__(self, linear: nn.Linear, kernel: F32Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tiles = kernel.pack(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:  # the kernel's rows must be contiguous
            flat = flat.contiguous()
        y = self.kernel(flat, self.tiles, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class KernelLinear(nn.Module):
    """An nn.Linear (float32, on the CPU) whose calls of up to KERNEL_MAX_ROWS
    rows run EPD's kernel, the others F.linear, on the same weight."""

    def __init__(self, linear: nn.Linear, kernel: LinearKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _kernel_or_torch(self.kernel, x, self.weight, self.bias)


class KernelExperts(Experts):
    """MoE experts routed and summed as `Experts` does (the same weights), each
    expert's matmuls in EPD's kernel when few tokens chose it."""

    def __init__(self, experts: Experts, kernel: LinearKernel) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts.num_experts
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.kernel = kernel

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _kernel_or_torch(self.kernel, x, self.gate_up_proj[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return _kernel_or_torch(self.kernel, x, self.down_proj[expert])


def use_bf16_linears(model: nn.Module, kernel: Bf16Linear) -> int:
    """Swaps every nn.Linear in `model` for a Bf16PackedLinear and every MoE layer's
    Experts for PackedExperts (oneDNN's); returns how many modules it swapped."""
    return _swap(model, lambda linear: Bf16PackedLinear(linear, kernel), PackedExperts)


def use_f32_linears(model: nn.Module, kernel: F32Linear) -> int:
    """Swaps every nn.Linear in `model` for an F32PackedLinear and every MoE layer's
    Experts for PackedExperts (oneDNN's); returns how many modules it swapped."""
    return _swap(model, lambda linear: F32PackedLinear(linear, kernel), PackedExperts)


def _kernel_or_torch(
    kernel: LinearKernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > KERNEL_MAX_ROWS or x.stride(-1) != 1:
        return F.linear(x, weight, bias)
    y = kernel(x.reshape(rows, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def use_linear_kernel(model: nn.Module, kernel: LinearKernel) -> int:
    """Swaps every nn.Linear in `model` for a KernelLinear and every MoE layer's
    Experts for KernelExperts; returns how many modules it swapped."""
    return _swap(
        model, lambda linear: KernelLinear(linear, kernel), lambda e: KernelExperts(e, kernel)
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)


def _linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swaps every nn.Linear in `model` for a PackedLinear and every MoE layer's
    Experts for PackedExperts; returns how many modules it swapped."""
    return _swap(model, PackedLinear, PackedExperts)


def _swap(
    model: nn.Module,
    linear: Callable[[nn.Linear], nn.Module],
    experts: Callable[[Experts], nn.Module],
) -> int:
    """Replaces every nn.Linear and Experts in `model` with linear(it) or experts(it)."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | Experts)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, linear(child) if isinstance(child, nn.Linear) else experts(child))
    return len(swaps)
