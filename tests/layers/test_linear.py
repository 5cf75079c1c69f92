"""The projections: stacked at load, then on CPU EPD's kernel for few rows,
EPD's bfloat16 kernel for few rows (AMX or AVX512-BF16), or oneDNN's packed GEMM
(the greedy tests against HF in test_engine.py run every float32 backend;
test_bfloat16.py holds the bfloat16 engine, on this CPU's default kernel, to HF
in bfloat16)."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.layers import backends, cpu_kernels
from services.layers.backends import linear_backend
from services.layers.language_model import LanguageModel, stack_projections
from services.layers.linear import (
    KERNEL_MAX_ROWS,
    Bf16PackedLinear,
    F32PackedLinear,
    KernelLinear,
    PackedLinear,
    onednn_supports,
    pack_linears,
    use_bf16_linears,
    use_linear_kernel,
)
from services.model.checkpoint import load_language_weights
from services.model.spec import load_spec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    expected = linear(x)
    torch.testing.assert_close(PackedLinear(linear)(x), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.LinearKernel:
    built = cpu_kernels.linear_kernel()
    assert built is not None, "no C compiler or no AVX2: the CPU default would be oneDNN's"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, KERNEL_MAX_ROWS])
@pytest.mark.parametrize(
    ("k", "n"), [(64, 96), (100, 200), (7, 5), (512, 1024)]
)  # k: whole 8-lane steps or a tail; n: whole 3-row tiles or a tail
@pytest.mark.parametrize("bias", [True, False])
def test_linear_kernel_equals_f_linear(
    kernel: cpu_kernels.LinearKernel, rows: int, k: int, n: int, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    # another summation order than MKL's: float32 rounding of a k-term sum
    torch.testing.assert_close(kernel(x, weight, b), F.linear(x, weight, b), atol=5e-5, rtol=1e-5)


def test_linear_kernel_takes_rows_strided_apart(kernel: cpu_kernels.LinearKernel) -> None:
    """As a slice of a wider tensor leaves them (the columns of a fused projection)."""
    wide = torch.randn(9, 300)
    x = wide[:, 40:140]
    weight = torch.randn(33, 100)
    torch.testing.assert_close(kernel(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 16, KERNEL_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_linear_equals_f_linear_on_either_side_of_its_row_limit(
    kernel: cpu_kernels.LinearKernel, rows: int, bias: bool
) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    expected = linear(x)
    module = KernelLinear(linear, kernel)
    module.kernel = counting = Mock(wraps=kernel)
    torch.testing.assert_close(module(x), expected)
    torch.testing.assert_close(module(x.unsqueeze(0)), expected.unsqueeze(0))  # [1, rows, 96]
    assert counting.call_count == (2 if rows <= KERNEL_MAX_ROWS else 0)


def test_every_projection_uses_the_kernel(
    tiny_checkpoint: Path, kernel: cpu_kernels.LinearKernel
) -> None:
    spec = load_spec(tiny_checkpoint)
    model = LanguageModel.from_weights(spec.text, load_language_weights(tiny_checkpoint, spec), CPU)
    x = torch.randn(5, spec.text.hidden_size)
    mlp = model.layers[1].mlp
    expected = mlp(x)
    assert use_linear_kernel(model, kernel) == 4 * spec.text.num_layers + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(mlp(x), expected)


def test_every_projection_is_stacked_and_packed(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    weights = load_language_weights(tiny_checkpoint, spec)
    q, k, v = (weights[f"layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    gate, up = (weights[f"layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))

    model = LanguageModel.from_weights(spec.text, weights, CPU)
    assert not any(p in name for name in weights for p in (".q_proj.", ".gate_proj.", ".up_proj."))
    assert torch.equal(model.layers[0].self_attn.qkv_proj.bias, torch.cat([q, k, v]))
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate, up]))

    x = torch.randn(5, spec.text.hidden_size)
    mlp = model.layers[1].mlp
    expected = mlp(x)
    # each layer's qkv, o, gate_up and down, and the lm_head
    assert pack_linears(model) == 4 * spec.text.num_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_stacking_leaves_other_tensors_alone() -> None:
    weights = {
        "layers.0.mlp.gate.weight": torch.ones(4, 2),  # an MoE router, not gate_proj
        "layers.0.mlp.experts.gate_up_proj": torch.ones(4, 6, 2),
        "layers.0.self_attn.o_proj.weight": torch.ones(2, 2),
    }
    assert set(stack_projections(dict(weights))) == set(weights)


def test_linear_backend_choice(
    kernel: cpu_kernels.LinearKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32: EPD's AVX-512 kernel where the CPU (and its build) has AVX-512; else
    EPD's AVX2 kernel, or oneDNN's GEMM where torch runs AVX-512 but EPD's kernels
    were built for AVX2."""
    has_avx512 = cpu_kernels.f32_linear() is not None
    expected = "avx512" if has_avx512 else ("onednn" if backends.avx512() else "cpu")
    assert linear_backend("auto", torch.float32, CPU) == expected
    monkeypatch.setattr(backends, "f32_linear", lambda: None)
    for wide, chosen in ((True, "onednn"), (False, "cpu")):
        monkeypatch.setattr(backends, "avx512", lambda wide=wide: wide)
        assert linear_backend("auto", torch.float32, CPU) == chosen
    with pytest.raises(ValueError, match="avx512 linear kernel needs a CPU with AVX-512"):
        linear_backend("avx512", torch.float32, CPU)
    monkeypatch.undo()
    if has_avx512:
        assert linear_backend("avx512", torch.float32, CPU) == "avx512"
    with pytest.raises(ValueError, match="avx512 linear kernel"):
        linear_backend("avx512", torch.bfloat16, CPU)
    assert linear_backend("onednn", torch.float32, CPU) == "onednn"
    assert linear_backend("auto", torch.bfloat16, CUDA) == "torch"
    assert linear_backend("torch", torch.float32, CPU) == "torch"
    packs = onednn_supports(torch.bfloat16)
    kernels = [kind for kind in cpu_kernels.BF16_KINDS if packs and cpu_kernels.bf16_linear(kind)]
    bf16 = kernels[0] if kernels else "onednn" if packs else "torch"
    assert linear_backend("auto", torch.bfloat16, CPU) == bf16
    with pytest.raises(ValueError, match="oneDNN"):
        linear_backend("onednn", torch.bfloat16, CUDA)
    with pytest.raises(ValueError, match="float32"):
        linear_backend("cpu", torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="AMX"):
        linear_backend("amx", torch.float32, CPU)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        linear_backend("avx512bf16", torch.float32, CPU)


@pytest.fixture(scope="module")
def f32_kernel() -> cpu_kernels.F32Linear:
    built = cpu_kernels.f32_linear()
    if built is None:
        pytest.skip("this CPU (or its build) has no AVX-512: float32 projections are another's")
    return built


# around the 6-row passes and 96-row tasks, and a prompt's 2048
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 95, 96, 97, 300, 2048])
# n: whole 64-output groups, a tail of one, of 16 and more, fewer than 16 in all
@pytest.mark.parametrize(("k", "n"), [(64, 128), (512, 1024), (100, 200), (33, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_avx512_kernel_equals_f_linear(
    f32_kernel: cpu_kernels.F32Linear, rows: int, k: int, n: int, bias: bool
) -> None:
    """float32 sums along k in another order than MKL's: within its rounding."""
    generator = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    y = f32_kernel(x, f32_kernel.pack(weight), n, b)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, F.linear(x, weight, b), atol=1e-4 * k**0.5, rtol=1e-5)


def test_an_f32_packed_linear_takes_any_rows_strided_or_not(
    f32_kernel: cpu_kernels.F32Linear,
) -> None:
    """Every call in the kernel, the weight held once (its packing only), rows of a
    3-D x, and a transposed x (made contiguous)."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    module = F32PackedLinear(linear, f32_kernel)
    assert [name for name, _ in module.named_parameters()] == []
    module.kernel = counting = Mock(wraps=f32_kernel)
    x = torch.randn(300, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(module(x), expected, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(
        module(x.view(3, 100, 96)), expected.view(3, 100, 200), atol=1e-3, rtol=1e-5
    )
    torch.testing.assert_close(module(x.t().contiguous().t()), expected, atol=1e-3, rtol=1e-5)
    assert counting.call_count == 3


@pytest.fixture(scope="module", params=cpu_kernels.BF16_KINDS)
def bf16_kernel(request: pytest.FixtureRequest) -> cpu_kernels.Bf16Linear:
    built = cpu_kernels.bf16_linear(request.param)
    if built is None:
        pytest.skip(f"this CPU has no {request.param} kernel: its projections are another's")
    return built


def assert_rounded_once(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """y (bfloat16) is the float32 product, plus bias, rounded once: within half a
    bfloat16 step of it (at most 2^-8 of it), plus float32 summation-order slack."""
    exact = x.float() @ w.float().t() + (0 if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    slack = 2**-8 * exact.abs() + 1e-4 * x.shape[1] ** 0.5
    assert ((y.float() - exact).abs() <= slack).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 15, 16, 17, 31, 32, 33, 48, 50, 128])
@pytest.mark.parametrize(
    ("k", "n"), [(64, 128), (512, 1024), (100, 200), (32, 5)]
)  # k: whole 32-column tiles or a tail; n: whole 64-output groups or a tail
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_kernel_rounds_the_product_once(
    bf16_kernel: cpu_kernels.Bf16Linear, rows: int, k: int, n: int, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    y = bf16_kernel(x, bf16_kernel.pack(weight), n, b)
    assert_rounded_once(y, x, weight, b)
    # oneDNN's GEMM rounds the same sums, added in another order
    torch.testing.assert_close(y, F.linear(x, weight, b), atol=0.05, rtol=2**-7)


def test_bf16_kernel_takes_rows_strided_apart(bf16_kernel: cpu_kernels.Bf16Linear) -> None:
    """As a slice of a wider tensor leaves them (the columns of a fused projection)."""
    wide = torch.randn(20, 300).bfloat16()
    x = wide[:, 40:104]
    weight = torch.randn(70, 64).bfloat16()
    assert_rounded_once(bf16_kernel(x, bf16_kernel.pack(weight), 70), x, weight, None)


# either side of the AMX kernel's row limit (128) and of the AVX512-BF16 kernel's
# 96-row tasks; a prompt's 2048
@pytest.mark.parametrize("rows", [1, 95, 96, 97, 127, 128, 129, 300, 2048])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_linear_equals_onednn_at_any_rows(
    bf16_kernel: cpu_kernels.Bf16Linear, rows: int, bias: bool
) -> None:
    """The kernel takes calls up to its max_rows (all, without one: then no oneDNN
    layout is held), oneDNN's packed GEMM the rest, and a transposed x too."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    module = Bf16PackedLinear(linear, bf16_kernel)
    assert (module.packed is None) == (bf16_kernel.max_rows is None)
    module.kernel = counting = Mock(wraps=bf16_kernel)
    counting.max_rows = bf16_kernel.max_rows
    expected = PackedLinear(linear)(x)
    torch.testing.assert_close(module(x), expected, atol=0.05, rtol=2**-7)
    torch.testing.assert_close(module(x.unsqueeze(0)), expected.unsqueeze(0), atol=0.05, rtol=2**-7)
    in_kernel = bf16_kernel.max_rows is None or rows <= bf16_kernel.max_rows
    assert counting.call_count == (2 if in_kernel else 0)
    if bf16_kernel.max_rows is None:  # no oneDNN layout to fall back on
        transposed = x.t().contiguous().t()
        torch.testing.assert_close(module(transposed), expected, atol=0.05, rtol=2**-7)


def test_every_projection_uses_the_bf16_kernel(
    tiny_checkpoint: Path, bf16_kernel: cpu_kernels.Bf16Linear
) -> None:
    spec = load_spec(tiny_checkpoint)
    weights = {
        name: t.bfloat16() for name, t in load_language_weights(tiny_checkpoint, spec).items()
    }
    model = LanguageModel.from_weights(spec.text, weights, CPU)
    x = torch.randn(5, spec.text.hidden_size).bfloat16()
    mlp = model.layers[1].mlp
    expected = mlp(x)
    assert use_bf16_linears(model, bf16_kernel) == 4 * spec.text.num_layers + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(mlp.down_proj, Bf16PackedLinear)
    torch.testing.assert_close(mlp(x), expected, atol=0.05, rtol=2**-6)


def test_bfloat16_projections_on_the_kernel_by_default(
    bf16_kernel: cpu_kernels.Bf16Linear,
) -> None:
    """AMX where the CPU has it, else AVX512-BF16 (every AMX CPU has AVX512-BF16 too)."""
    amx = cpu_kernels.bf16_linear("amx") is not None
    assert linear_backend("auto", torch.bfloat16, CPU) == ("amx" if amx else "avx512bf16")
    assert linear_backend(bf16_kernel.kind, torch.bfloat16, CPU) == bf16_kernel.kind
    assert linear_backend("onednn", torch.bfloat16, CPU) == "onednn"
