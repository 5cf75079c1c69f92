"""The language model's projections on CPU: oneDNN's GEMM on weights packed once.

A GEMM with few rows (a decode step has one per running request) spends much of
its time reordering the weight into the blocked layout the kernel reads. oneDNN
takes that layout ahead of time: the engine reorders every projection once at
load and calls oneDNN's linear on it, as vLLM's CPU backend does
(`create_onednn_mm` in `vllm/model_executor/layers/utils.py`). Measured on a
2-core AVX2 EPYC, the small demo's projections at 16 rows: 1.3-2.1x faster than
`F.linear`; at 2048 rows (prefill): the same. `bench/engine.py --linear` compares.
"""

from __future__ import annotations

import torch
from torch import nn

from services.language.engine.model import Experts

# the row count oneDNN tunes the packed layout for (vLLM's choice); any count runs
BATCH_HINT = 32


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


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)


def _linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swaps every nn.Linear in `model` for a PackedLinear and every MoE layer's
    Experts for PackedExperts; returns how many modules it swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | Experts)
    ]
    for parent, name, child in swaps:
        setattr(
            parent,
            name,
            PackedLinear(child) if isinstance(child, nn.Linear) else PackedExperts(child),
        )
    return len(swaps)
