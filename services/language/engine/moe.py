"""The experts of a sparse MoE layer on CUDA: FlashInfer's fused CUTLASS kernel.

`model.Experts` runs the experts as grouped torch matmuls on any device. On
CUDA in half precision the engine swaps each layer's experts for
`FlashInferExperts`, which takes the same call (tokens, chosen experts,
routing weights) and runs permute, both GEMMs, SwiGLU and the weighted sum in
`flashinfer.fused_moe.cutlass_fused_moe` (the kernel vLLM's and TensorRT-LLM's
FlashInfer MoE backends call). Written against FlashInfer's documented API;
not yet run on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from services.language.engine.model import Experts, LanguageModel, SparseMoeBlock


class FlashInferExperts(nn.Module):
    """The experts of one layer as FlashInfer's CUTLASS MoE wants them: `fc1`
    [E, 2I, H] holds the up rows before the gate rows (the reverse of the
    checkpoint's `gate_up_proj`), `fc2` is `down_proj` [E, H, I]."""

    def __init__(self, experts: Experts) -> None:
        super().__init__()
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
        self.fc1 = nn.Parameter(torch.cat([up, gate], dim=1), requires_grad=False)
        self.fc2 = nn.Parameter(experts.down_proj.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], chosen [T, k] expert ids, weights [T, k] -> [T, H]."""
        from flashinfer.fused_moe import cutlass_fused_moe

        out = torch.empty_like(x)
        cutlass_fused_moe(
            input=x.contiguous(),
            token_selected_experts=chosen.to(torch.int32).contiguous(),
            token_final_scales=weights.float().contiguous(),
            fc1_expert_weights=self.fc1,
            fc2_expert_weights=self.fc2,
            output_dtype=x.dtype,
            quant_scales=[],
            output=out,
        )
        return out


def fuse_experts(model: LanguageModel) -> int:
    """Swaps every sparse layer's experts for FlashInferExperts, one layer at a
    time (so the extra memory is one layer's fc1); returns how many."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        assert isinstance(block.experts, Experts)
        block.experts = FlashInferExperts(block.experts)
    return len(blocks)
