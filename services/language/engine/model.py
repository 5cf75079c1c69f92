"""The Qwen2 / Qwen2.5-VL language model, over the paged KV cache.

Token-flattened: a step's tokens from all requests form one [T, hidden]
batch. M-RoPE is applied here, outside the attention kernel, from 3-D
positions [3, T] (temporal, height, width); text tokens carry the same
position on all three axes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.language.engine.attention import AttentionBackend
from services.model.spec import TextSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MRotaryEmbedding:
    """cos/sin [T, head_dim] for 3-D positions: the rotary half-dimension is split
    by mrope_section, chunk i taking its angle from axis i % 3."""

    def __init__(self, spec: TextSpec, device: torch.device) -> None:
        dim = spec.head_dim
        self.inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim)
        )
        self.section = list(spec.mrope_section)

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, dim / 2]
        chunks = freqs.split(self.section, dim=-1)
        freq = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
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
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=True)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=True)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=True)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        out = attention.forward(q, k, v, cache)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    def __init__(self, spec: TextSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(spec) for _ in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @classmethod
    def from_weights(
        cls, spec: TextSpec, weights: dict[str, torch.Tensor], device: torch.device
    ) -> LanguageModel:
        """Builds on the meta device and takes the loaded tensors as they are (no random init)."""
        with torch.device("meta"):
            model = cls(spec)
        model.load_state_dict(weights, strict=True, assign=True)
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device).eval()

    def forward(
        self,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """embeds [T, hidden] -> final normed hidden states [T, hidden]."""
        x = embeds
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, attention)
        return self.norm(x)
