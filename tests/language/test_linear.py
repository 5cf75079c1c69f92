"""The projections: stacked at load, then on CPU EPD's kernel for few rows or
oneDNN's packed GEMM (the greedy tests against HF in test_engine.py run every
linear backend)."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.language.engine import cpu_kernels
from services.language.engine.config import linear_backend
from services.language.engine.linear import (
    KERNEL_MAX_ROWS,
    KernelLinear,
    PackedLinear,
    onednn_supports,
    pack_linears,
    use_linear_kernel,
)
from services.language.engine.model import LanguageModel, stack_projections
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


def test_linear_backend_choice(kernel: cpu_kernels.LinearKernel) -> None:
    assert linear_backend("auto", torch.float32, CPU) == "cpu"
    assert linear_backend("onednn", torch.float32, CPU) == "onednn"
    assert linear_backend("auto", torch.bfloat16, CUDA) == "torch"
    assert linear_backend("torch", torch.float32, CPU) == "torch"
    bf16 = "onednn" if onednn_supports(torch.bfloat16) else "torch"
    assert linear_backend("auto", torch.bfloat16, CPU) == bf16
    with pytest.raises(ValueError, match="oneDNN"):
        linear_backend("onednn", torch.bfloat16, CUDA)
    with pytest.raises(ValueError, match="float32"):
        linear_backend("cpu", torch.bfloat16, CPU)
