"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) language model, over the paged KV cache.

Token-flattened: a step's tokens from all requests form one [T, hidden]
batch. M-RoPE is applied here, outside the attention kernel, from 3-D
positions [3, T] (temporal, height, width); text tokens carry the same
position on all three axes. Qwen3-VL adds QK-norm, interleaved M-RoPE,
deepstack (vision features added to the image tokens' hidden states after
the first layers) and, in the MoE model, sparse MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.layers.attention import AttentionBackend, KVLayer
from services.layers.cpu_kernels import FusedOps
from services.model.spec import MoeSpec, TextSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: FusedOps | None = None  # LanguageModel.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """HF's Qwen2RMSNorm: normalised in float32, scaled in the input's dtype."""
        if self.ops is not None and x.dim() == 2 and self.ops.supports(x):
            return self.ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this norm: (x + delta, its norm)."""
        if self.ops is not None and self.ops.supports(x) and x.is_contiguous():
            return self.ops.add_rms_norm(x, delta.contiguous(), self.weight, self.eps)
        x = x + delta
        return x, self(x)


class MRotaryEmbedding:
    """cos/sin [T, head_dim] for 3-D positions. Each rotary frequency takes its
    angle from one axis: Qwen2-VL splits the half-dimension into mrope_section
    blocks (chunk i from axis i % 3); Qwen3-VL interleaves them (t, h, w, t, h,
    w, ...: frequency j from axis j % 3 within 3 * section[axis], t elsewhere)."""

    def __init__(self, spec: TextSpec, device: torch.device) -> None:
        dim = spec.head_dim
        self.inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim)
        )
        section = spec.mrope_section
        axis = torch.zeros(dim // 2, dtype=torch.long)
        if spec.mrope_interleaved:
            for a in (1, 2):
                axis[a : section[a] * 3 : 3] = a
        else:
            axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self.axis = axis.to(device)  # [dim / 2]: the axis each frequency takes its angle from

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, dim / 2]
        freq = freqs.gather(0, self.axis.expand(1, freqs.shape[1], -1))[0]  # [T, dim / 2]
        emb = torch.cat([freq, freq], dim=-1)  # [T, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.sizes = [q_dim, kv_dim, kv_dim]
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.sizes), bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_dim, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()
        self.ops: FusedOps | None = None  # LanguageModel.use_fused_ops

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVLayer,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.ops is None or not self.ops.supports(qkv):
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        elif isinstance(self.q_norm, nn.Identity):  # q and k still side by side in qkv
            heads = self.num_heads + self.num_kv_heads
            self.ops.rotary(qkv[:, : heads * self.head_dim].view(t, heads, -1), cos, sin)
        else:  # the norms made new tensors
            q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        out = attention.forward(q, k, v, cache)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.ops: FusedOps | None = None  # LanguageModel.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and self.ops.supports(gate_up) and gate_up.dim() == 2:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, spec: TextSpec, moe: MoeSpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size))


class Experts(nn.Module):
    """The experts' weights as checkpoints hold them (`gate_up_proj` [E, 2I, H]:
    gate rows then up rows; `down_proj` [E, H, I]), run as grouped torch matmuls:
    one sort of the (token, expert) pairs and one pair of matmuls per expert that
    received tokens; contributions summed in expert order. The engine swaps in
    `moe.FlashInferExperts` (the same call) on CUDA."""

    def __init__(self, spec: TextSpec, moe: MoeSpec) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, spec.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, spec.hidden_size, inter))

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.down_proj[expert])

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], chosen [T, k] expert ids, weights [T, k] -> [T, H]."""
        top_k = chosen.shape[1]
        flat = chosen.flatten()
        weights = weights.to(x.dtype).flatten()
        order = flat.argsort(stable=True)
        tokens = order // top_k  # the token of each (token, expert) pair, by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            rows = tokens[start : start + count]
            gate, up = self.gate_up(expert, x[rows]).chunk(2, dim=-1)
            y = self.down(expert, F.silu(gate) * up)
            out.index_add_(0, rows, y * weights[pairs, None])
            start += count
        return out


class SparseMoeBlock(nn.Module):
    """Top-k routing (softmax, top k, renormalised), then the experts."""

    def __init__(self, spec: TextSpec, moe: MoeSpec) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.gate = Router(spec, moe)
        self.experts: nn.Module = Experts(spec, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        return self.experts(x, chosen, weights / weights.sum(dim=-1, keepdim=True))


class DecoderLayer(nn.Module):
    def __init__(self, spec: TextSpec, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        moe = spec.moe
        self.mlp = SparseMoeBlock(spec, moe) if moe and index in moe.layers else MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVLayer,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states are `residual + x` (x alone where residual is None):
        the previous layer's residual add is done with this layer's first norm, in one
        pass where the fused ops run (vLLM's layers do the same). Returns (this
        layer's MLP output, the residual it adds to)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add(residual, x)
        residual, h = self.post_attention_layernorm.add(
            residual, self.self_attn(h, cos, sin, cache, attention)
        )
        return self.mlp(h), residual


# each fused projection and the checkpoint's projections it stacks, in order
STACKED = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


def stack_projections(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenates each layer's q/k/v and gate/up weights (and biases) along the
    output dimension into `qkv_proj` and `gate_up_proj`, in place: one matmul
    where there were three and two (vLLM's stacked parameters). The parts leave
    the dict as they are stacked, so a caller that holds no other reference never
    has both in memory. Returns `weights`."""
    for name in list(weights):
        for fused, parts in STACKED:
            layer, found, param = name.rpartition(parts[0] + ".")
            if found:
                weights[layer + fused + "." + param] = torch.cat(
                    [weights.pop(layer + part + "." + param) for part in parts]
                )
    return weights


@dataclass(frozen=True, slots=True)
class Deepstack:
    """A step's deepstack features: `values[:, level]` is added to the hidden
    states of the tokens at flat `offsets` after decoder layer `level`."""

    offsets: torch.Tensor  # [K] flat token indices in the step's batch
    values: torch.Tensor  # [K, levels, hidden]


class LanguageModel(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(spec, i) for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @classmethod
    def from_weights(
        cls, spec: TextSpec, weights: dict[str, torch.Tensor], device: torch.device
    ) -> LanguageModel:
        """Builds on the meta device and takes the loaded tensors (checkpoint names, as
        `load_language_weights` returns them) as they are, no random init. The
        projections are stacked in `weights` itself (`stack_projections`)."""
        with torch.device("meta"):
            model = cls(spec)
        model.load_state_dict(stack_projections(weights), strict=True, assign=True)
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device).eval()

    def use_fused_ops(self, ops: FusedOps) -> None:
        """RMSNorm, the residual add before the post-attention norm, rotary
        embedding and (bfloat16) the MLP's SiLU and product from `ops`
        (cpu_kernels.py) wherever it takes the tensors."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.ops = ops

    def forward(
        self,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[KVLayer],
        attention: AttentionBackend,
        deepstack: Deepstack | None = None,
    ) -> torch.Tensor:
        """embeds [T, hidden] -> final normed hidden states [T, hidden]."""
        x, residual = embeds, None
        levels = deepstack.values.shape[1] if deepstack is not None else 0
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            x, residual = layer(x, residual, cos, sin, cache, attention)
            if deepstack is not None and i < levels:
                x, residual = x + residual, None
                x[deepstack.offsets] = x[deepstack.offsets] + deepstack.values[:, i]
        return self.norm(x) if residual is None else self.norm.add(residual, x)[1]
