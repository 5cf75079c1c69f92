"""The experts of a sparse MoE layer on CUDA: FlashInfer's fused CUTLASS kernel.

`model.Experts` runs the experts as grouped torch matmuls on any device. On
CUDA in half precision the engine swaps each layer's experts for
`FlashInferExperts`, which takes the same call (tokens, chosen experts,
routing weights) and runs permute, both GEMMs, SwiGLU and the weighted sum in
`flashinfer.fused_moe.cutlass_fused_moe` (the kernel vLLM's and TensorRT-LLM's
FlashInfer MoE backends call), on one workspace for every layer, its tactics
chosen by FlashInfer's autotuner during the engine's warm-up. Written against
FlashInfer's documented API (0.7.2); not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from services.layers.language_model import Experts, LanguageModel, SparseMoeBlock


class FlashInferExperts(nn.Module):
    """The experts of one layer as FlashInfer's CUTLASS MoE wants them: `fc1`
    [E, 2I, H] holds the up rows before the gate rows (the reverse of the
    checkpoint's `gate_up_proj`), `fc2` is `down_proj` [E, H, I]. `workspace`:
    the kernel's scratch, allocated once for `max_num_tokens` and shared by
    every layer (they run one after another on one stream); without it the
    kernel allocates and frees several GiB on every call."""

    def __init__(self, experts: Experts, workspace: torch.Tensor, max_num_tokens: int) -> None:
        super().__init__()
        gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
        self.fc1 = nn.Parameter(torch.cat([up, gate], dim=1), requires_grad=False)
        self.fc2 = nn.Parameter(experts.down_proj.detach(), requires_grad=False)
        self.workspace = workspace
        self.max_num_tokens = max_num_tokens

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
            tune_max_num_tokens=self.max_num_tokens,
            workspace_buffer=self.workspace,
        )
        return out


def fuse_experts(model: LanguageModel, max_num_tokens: int) -> int:
    """Swaps every sparse layer's experts for FlashInferExperts, one layer at a
    time (so the extra memory is one layer's fc1), all of them on one workspace
    sized for steps of up to max_num_tokens; returns how many."""
    from flashinfer.fused_moe import cutlass_fused_moe_workspace_size

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return 0
    experts = blocks[0].experts
    assert isinstance(experts, Experts)
    num_experts, hidden, inter = experts.down_proj.shape
    dtype, device = experts.down_proj.dtype, experts.down_proj.device
    size = cutlass_fused_moe_workspace_size(
        max_num_tokens,
        hidden,
        inter,
        num_experts,
        blocks[0].top_k,
        x_dtype=dtype,
        weight_dtype=dtype,
        output_dtype=dtype,
        device=device,
    )
    workspace = torch.empty(size, dtype=torch.uint8, device=device)
    for block in blocks:
        assert isinstance(block.experts, Experts)
        block.experts = FlashInferExperts(block.experts, workspace, max_num_tokens)
    return len(blocks)


@contextmanager
def autotuning(model: LanguageModel) -> Iterator[None]:
    """FlashInfer's autotuner, around the engine's warm-up, where the model's experts
    are FlashInfer's: each fused MoE shape is profiled there and its fastest
    tactic kept for serving (vLLM tunes the same way before it serves)."""
    if not any(isinstance(m, FlashInferExperts) for m in model.modules()):
        yield
        return
    from flashinfer.autotuner import autotune

    with autotune(True):
        yield
