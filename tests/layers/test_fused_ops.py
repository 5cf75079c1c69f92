"""The compiled fused operations (csrc/fused_ops.c) against the model's torch
code, in float32 and in bfloat16: rotary embedding bit-equal, in place, on the
fused QKV projection's strided rows and on contiguous heads; RMSNorm within a
rounding of torch's (only the order of the sum of squares differs), its
residual add bit-equal; the MLP's SiLU and product (bfloat16) bit-equal. Then
where the model uses them, and when the engine does (without a compiler:
test_cpu_attention.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.layers import cpu_kernels
from services.layers.backends import ops_backend
from services.layers.language_model import MLP, RMSNorm, apply_rotary
from services.model.spec import load_spec

HEADS, KV_HEADS, DIM = 8, 4, 64
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@pytest.fixture(scope="module")
def ops() -> cpu_kernels.FusedOps:
    built = cpu_kernels.fused_ops()
    assert built is not None, "no C compiler: the CPU default would be torch's path"
    return built


def cos_sin(
    tokens: int, dim: int = DIM, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """As MRotaryEmbedding makes them: each frequency's angle twice, [tokens, dim]."""
    angles = torch.randn(tokens, dim // 2) * 10
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def norm(size: int, dtype: torch.dtype = torch.float32) -> RMSNorm:
    module = RMSNorm(size, 1e-6)
    module.weight.data = torch.randn(size)
    return module.to(dtype)


@DTYPES
@pytest.mark.parametrize("tokens", [1, 16, 300, 2048])
def test_rotary_on_the_qkv_rows_equals_torch_bit_for_bit(
    ops: cpu_kernels.FusedOps, tokens: int, dtype: torch.dtype
) -> None:
    """q and k rotated in place in the projection's output, v left alone."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
    cos, sin = cos_sin(tokens, dtype=dtype)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    want_q = apply_rotary(q.reshape(tokens, HEADS, DIM), cos, sin)
    want_k = apply_rotary(k.reshape(tokens, KV_HEADS, DIM), cos, sin)
    want_v = v.clone()
    heads = qkv[:, : (HEADS + KV_HEADS) * DIM].view(tokens, HEADS + KV_HEADS, DIM)
    assert ops.rotary(heads, cos, sin) is heads
    assert torch.equal(q.reshape(tokens, HEADS, DIM), want_q)
    assert torch.equal(k.reshape(tokens, KV_HEADS, DIM), want_k)
    assert torch.equal(v, want_v)


@DTYPES
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_on_contiguous_heads_equals_torch_bit_for_bit(
    ops: cpu_kernels.FusedOps, dim: int, dtype: torch.dtype
) -> None:
    """As Qwen3's q/k norms leave them: their own tensors."""
    torch.manual_seed(dim)
    x = torch.randn(37, 5, dim).to(dtype)
    cos, sin = cos_sin(37, dim, dtype)
    want = apply_rotary(x, cos, sin)
    assert torch.equal(ops.rotary(x, cos, sin), want)


@DTYPES
def test_rotary_by_float32_cos_equals_hf_vision_rotary_bit_for_bit(
    ops: cpu_kernels.FusedOps, dtype: torch.dtype
) -> None:
    """With float32 cos/sin, x of either dtype is rotated in float32 and rounded
    once, as HF's vision towers do (not per operator, as bfloat16 cos/sin are)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    torch.manual_seed(5)
    qkv = torch.randn(300, 3 * HEADS, DIM).to(dtype)
    cos, sin = cos_sin(300)
    q, k = qkv[:, :HEADS].clone(), qkv[:, HEADS : 2 * HEADS].clone()
    want_q, want_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    v = qkv[:, 2 * HEADS :].clone()
    ops.rotary(qkv[:, : 2 * HEADS], cos, sin)
    assert torch.equal(qkv[:, :HEADS], want_q) and torch.equal(qkv[:, HEADS : 2 * HEADS], want_k)
    assert torch.equal(qkv[:, 2 * HEADS :], v)
    if dtype == torch.bfloat16:  # the other rounding, the language model's, differs here
        per_operator = apply_rotary(q, cos.to(dtype), sin.to(dtype))
        assert not torch.equal(per_operator, want_q)


@DTYPES
@pytest.mark.parametrize("rows", [1, 16, 2048])
@pytest.mark.parametrize("size", [64, 512, 1000])
def test_rms_norm_matches_torch(
    ops: cpu_kernels.FusedOps, rows: int, size: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(rows + size)
    module = norm(size, dtype)
    x = (torch.randn(rows, size) * 3).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, module.weight, module.eps), module(x))


@DTYPES
def test_rms_norm_reads_rows_strided_apart(ops: cpu_kernels.FusedOps, dtype: torch.dtype) -> None:
    module = norm(64, dtype)
    wide = torch.randn(10, 200).to(dtype)
    rows = wide[:, 100:164]  # 64 elements, rows 200 apart
    torch.testing.assert_close(ops.rms_norm(rows, module.weight, module.eps), module(rows))


@DTYPES
def test_add_rms_norm_adds_exactly_then_normalises(
    ops: cpu_kernels.FusedOps, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    module = norm(512, dtype)
    x, delta = torch.randn(33, 512).to(dtype), torch.randn(33, 512).to(dtype)
    total, normed = ops.add_rms_norm(x, delta, module.weight, module.eps)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, module(x + delta))


@pytest.mark.parametrize("rows", [1, 16, 2048])
@pytest.mark.parametrize("n", [256, 1376, 1000])
def test_silu_mul_equals_torch_bit_for_bit(ops: cpu_kernels.FusedOps, rows: int, n: int) -> None:
    x = (torch.randn(rows, 2 * n) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("inf"), 0.0, -100.0, 90.0])
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(ops.silu_mul(x), expected)


def test_silu_mul_reads_rows_strided_apart(ops: cpu_kernels.FusedOps) -> None:
    wide = torch.randn(40, 3 * 512).to(torch.bfloat16)
    x = wide[:, : 2 * 512]
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(ops.silu_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 16, 2048])
@pytest.mark.parametrize("n", [256, 1376, 1000])
def test_silu_mul_in_float32_is_within_a_few_ulp_of_torch(
    ops: cpu_kernels.FusedOps, rows: int, n: int
) -> None:
    """Its own e^x: within 2 ulp of libm's, and so of torch's; the SiLU of large
    gates of either sign stays finite (the gate itself, or a signed zero)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * n) * 6
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = x.chunk(2, dim=-1)
    got = ops.silu_mul(x)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)
    assert got[0, 2] == 100.0 * up[0, 2] and abs(got[0, 3]) < 1e-30 * abs(up[0, 3])
    wide = torch.randn(40, 3 * n)  # rows strided apart
    gate, up = wide[:, : 2 * n].chunk(2, dim=-1)
    got = ops.silu_mul(wide[:, : 2 * n])
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=0.0)


def test_the_mlp_uses_silu_mul_in_both_dtypes(
    ops: cpu_kernels.FusedOps, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16: torch's result bit for bit; float32: within its rounding."""
    spec = load_spec(tiny_checkpoint).text
    mlp = MLP(spec)
    plain = MLP(spec)
    plain.load_state_dict(mlp.state_dict())
    mlp.ops = ops
    calls = []
    for name in ("_silu_mul", "_silu_mul_f32"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *args, kernel=kernel, name=name: calls.append((name, kernel(*args)))
        )
    x = torch.randn(5, spec.hidden_size)
    torch.testing.assert_close(mlp(x), plain(x), rtol=1e-5, atol=1e-6)
    assert [name for name, _ in calls] == ["_silu_mul_f32"]
    mlp, plain, x = mlp.to(torch.bfloat16), plain.to(torch.bfloat16), x.to(torch.bfloat16)
    assert torch.equal(mlp(x), plain(x))
    assert [name for name, _ in calls] == ["_silu_mul_f32", "_silu_mul"]


def test_the_model_modules_use_them_where_they_take_the_tensors(
    ops: cpu_kernels.FusedOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2-D rows go to the kernel (float32 and bfloat16); 3-D heads (Qwen3's
    q/k norms) and float16 stay on torch, with torch's result."""
    calls: list[str] = []
    monkeypatch.setattr(ops, "_rms_norm", lambda *args: calls.append("kernel"), raising=True)
    module = norm(64)
    module.ops = ops
    module(torch.randn(4, 64))
    assert calls == ["kernel"]
    heads = torch.randn(4, 3, 64)
    torch.testing.assert_close(module(heads), norm_like(module)(heads))
    module.to(torch.bfloat16)(torch.randn(4, 64, dtype=torch.bfloat16))
    assert calls == ["kernel", "kernel"]
    half = torch.randn(4, 64, dtype=torch.float16)
    assert torch.equal(module.to(torch.float16)(half), norm_like(module)(half))
    assert calls == ["kernel", "kernel"]


def norm_like(module: RMSNorm) -> RMSNorm:
    """The same norm without the kernels."""
    twin = RMSNorm(module.weight.numel(), module.eps).to(module.weight.dtype)
    twin.weight.data = module.weight.data.clone()
    return twin


def test_the_cpu_default_is_the_fused_ops(ops: cpu_kernels.FusedOps) -> None:
    cpu = torch.device("cpu")
    assert ops_backend("auto", torch.float32, cpu) == "cpu"
    assert ops_backend("auto", torch.bfloat16, cpu) == "cpu"
    assert ops_backend("auto", torch.float16, cpu) == "torch"
    assert ops_backend("torch", torch.float32, cpu) == "torch"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops_backend("cpu", torch.float16, cpu)
