"""FlashInfer attention against the torch reference (GPU only)."""

from __future__ import annotations

import pytest
import torch

from services.language.engine.attention import (
    AttentionMetadata,
    FlashInferAttention,
    TorchAttention,
)

pytestmark = pytest.mark.gpu


def _metadata(
    q_lens: list[int], seq_lens: list[int], page_size: int, device: torch.device
) -> AttentionMetadata:
    tables, slots, next_page = [], [], 0
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        pages = -(-seq_len // page_size)
        table = list(range(next_page, next_page + pages))
        next_page += pages
        tables.append(table)
        slots += [
            table[i // page_size] * page_size + i % page_size
            for i in range(seq_len - q_len, seq_len)
        ]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        starts,
        seq_lens,
        tables,
        torch.tensor(slots, device=device),
        num_prefills=sum(1 for q in q_lens if q > 1),
        page_size=page_size,
    )


def test_flashinfer_matches_torch_for_mixed_prefill_and_decode() -> None:
    device = torch.device("cuda")
    heads, kv_heads, dim, page = 8, 2, 64, 16
    q_lens, seq_lens = [37, 5, 1, 1], [37, 20, 70, 3]  # full prefill, chunked prefill, two decodes
    meta = _metadata(q_lens, seq_lens, page, device)
    tokens = sum(q_lens)
    torch.manual_seed(0)
    q = torch.randn(tokens, heads, dim, device=device, dtype=torch.float16)
    k = torch.randn(tokens, kv_heads, dim, device=device, dtype=torch.float16)
    v = torch.randn(tokens, kv_heads, dim, device=device, dtype=torch.float16)
    prefix = torch.randn(16, 2, page, kv_heads, dim, device=device, dtype=torch.float16)
    scale = dim**-0.5

    reference = TorchAttention(scale)
    cache_ref = prefix.clone()
    reference.plan(meta)
    expected = reference.forward(q, k, v, cache_ref)

    flash = FlashInferAttention(heads, kv_heads, dim, scale, torch.float16, device)
    cache = prefix.clone()
    flash.plan(meta)
    got = flash.forward(q, k, v, cache)
    torch.testing.assert_close(cache, cache_ref)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
