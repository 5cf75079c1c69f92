"""The factory the language engine calls: its network built from the loader's
weights, with the backends its `auto` choices resolve to here (backends.py),
and the compiled decode step over its KV cache. The engine imports nothing
else of this package."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.layers.attention import AttentionBackend, FlashInferAttention, TorchAttention
from services.layers.backends import (
    attention_backend,
    linear_backend,
    moe_backend,
    ops_backend,
)
from services.layers.cpu_decode import CompiledDecode, compiled_decode
from services.layers.cpu_kernels import (
    BF16_KINDS,
    bf16_linear,
    bf16_prefill_attention,
    f32_linear,
    fused_ops,
    kv_writer,
    linear_kernel,
    paged_decode_attention,
)
from services.layers.language_model import LanguageModel
from services.layers.linear import (
    pack_linears,
    use_bf16_linears,
    use_f32_linears,
    use_linear_kernel,
)
from services.layers.moe import autotuning, fuse_experts
from services.model.spec import TextSpec

__all__ = ["Backends", "Network", "autotuning", "build_network", "compiled_decode"]


@dataclass(frozen=True, slots=True)
class Backends:
    """An engine's backend choices, each a name or "auto" (EngineConfig's fields
    of the same names say what each can be)."""

    attention: str = "auto"
    linear: str = "auto"
    ops: str = "auto"
    moe: str = "auto"


@dataclass(frozen=True, slots=True)
class Network:
    """The language model and the attention backend it runs with."""

    model: LanguageModel
    attention: AttentionBackend
    # decode steps may replay CUDA graphs: FlashInfer attention, and MoE experts
    # without host syncs (FlashInfer's fused ones)
    capturable: bool
    dtype: torch.dtype

    def compiled_decode(
        self, choice: str, caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int
    ) -> CompiledDecode | None:
        """EngineConfig.decode_layers' compiled decode step over these KV caches."""
        return compiled_decode(choice, self.model, self.attention, caches, page_size, self.dtype)


def build_network(
    spec: TextSpec,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    backends: Backends,
    max_num_tokens: int,
) -> Network:
    """The model in `dtype` on its backends. `weights` (the loader's tensors by
    checkpoint name) are converted in place. `max_num_tokens`: the most tokens a
    step computes (FlashInfer's fused experts size their workspace by it)."""
    for name, tensor in weights.items():
        weights[name] = tensor.to(dtype)
    model = LanguageModel.from_weights(spec, weights, device)
    fused_moe = spec.moe is not None and moe_backend(backends.moe, dtype, device) == "flashinfer"
    if fused_moe:
        fuse_experts(model, max_num_tokens)
    _use_linears(model, linear_backend(backends.linear, dtype, device))
    if ops_backend(backends.ops, dtype, device) == "cpu":
        ops = fused_ops()
        assert ops is not None  # ops_backend checked
        model.use_fused_ops(ops)
    attention = _attention(spec, backends.attention, dtype, device)
    capturable = isinstance(attention, FlashInferAttention) and (spec.moe is None or fused_moe)
    return Network(model, attention, capturable, dtype)


def _use_linears(model: LanguageModel, linear: str) -> None:
    """The model's projections on the backend linear_backend chose (and checked)."""
    if linear == "onednn":
        pack_linears(model)
    elif linear == "cpu":
        kernel = linear_kernel()
        assert kernel is not None
        use_linear_kernel(model, kernel)
    elif linear == "avx512":
        f32 = f32_linear()
        assert f32 is not None
        use_f32_linears(model, f32)
    elif linear in BF16_KINDS:
        bf16 = bf16_linear(linear)
        assert bf16 is not None
        use_bf16_linears(model, bf16)


def _attention(
    spec: TextSpec, choice: str, dtype: torch.dtype, device: torch.device
) -> AttentionBackend:
    scale = spec.head_dim**-0.5
    backend = attention_backend(choice, dtype, device)
    if backend == "flashinfer":
        return FlashInferAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, scale, dtype, device
        )
    if backend != "cpu":
        return TorchAttention(scale)
    prefill = bf16_prefill_attention() if dtype == torch.bfloat16 else None
    return TorchAttention(scale, paged_decode_attention(), prefill, kv_writer())
