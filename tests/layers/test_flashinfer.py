"""FlashInfer attention against the torch reference (GPU only): shuffled,
non-contiguous page tables; query-per-KV-head ratios 4, 5 and 7 (5 and 7 only
exist on FlashInfer's tensor-core decode); bf16 and fp16; head_dim 64 and 128;
prefill-only, decode-only and mixed steps, and one wrapper re-planned across
them. And the rule that picks tensor cores, which runs anywhere."""

from __future__ import annotations

import pytest
import torch

from services.layers.attention import (
    FlashInferAttention,
    TorchAttention,
    decode_uses_tensor_cores,
)
from tests.layers.paged_cases import NUM_PAGES, STEPS, paged_metadata


def _check_step(
    flash: FlashInferAttention,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    step: str,
    seed: int,
) -> None:
    device, page = torch.device("cuda"), 16
    q_lens, seq_lens = STEPS[step]
    meta = paged_metadata(q_lens, seq_lens, page, device, seed)
    tokens = sum(q_lens)
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    q, k, v = randn(tokens, heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    prefix = randn(2, NUM_PAGES, page, kv_heads, dim)  # keys, values
    reference = TorchAttention(dim**-0.5)
    cache_ref = prefix.clone()
    reference.plan(meta)
    expected = reference.forward(q, k, v, (cache_ref[0], cache_ref[1]))
    cache = prefix.clone()
    flash.plan(meta)
    got = flash.forward(q, k, v, (cache[0], cache[1]))
    torch.testing.assert_close(cache, cache_ref)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dtype"),
    [
        (8, 2, 64, torch.float16),  # ratio 4: CUDA-core decode
        (8, 2, 128, torch.bfloat16),
        (40, 8, 128, torch.bfloat16),  # ratio 5 (Qwen2.5-VL-32B): tensor cores
        (28, 4, 128, torch.bfloat16),  # ratio 7 (Qwen2.5-VL-7B): tensor cores
    ],
    ids=["r4-d64-fp16", "r4-d128-bf16", "r5-d128-bf16", "r7-d128-bf16"],
)
def test_flashinfer_matches_torch(
    step: str, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    flash = FlashInferAttention(heads, kv_heads, dim, dim**-0.5, dtype, torch.device("cuda"))
    _check_step(flash, heads, kv_heads, dim, dtype, step, seed=0)


@pytest.mark.gpu
def test_one_wrapper_replanned_across_step_kinds() -> None:
    """As the engine does: one backend, planned anew every step."""
    heads, kv_heads, dim, dtype = 28, 4, 128, torch.bfloat16
    flash = FlashInferAttention(heads, kv_heads, dim, dim**-0.5, dtype, torch.device("cuda"))
    for seed, step in enumerate(["prefill-only", "mixed", "decode-only", "mixed", "prefill-only"]):
        _check_step(flash, heads, kv_heads, dim, dtype, step, seed)


def test_tensor_core_decode_for_ratios_above_four() -> None:
    assert [decode_uses_tensor_cores(h, 1) for h in (1, 2, 4, 5, 7, 8)] == [
        False,
        False,
        False,
        True,
        True,
        True,
    ]
    assert decode_uses_tensor_cores(28, 4) and not decode_uses_tensor_cores(16, 4)
