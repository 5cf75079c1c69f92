"""The projections: stacked at load, packed for oneDNN on CPU (the greedy tests
against HF in test_engine.py run both linear backends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.language.engine.engine import linear_backend
from services.language.engine.linear import PackedLinear, onednn_supports, pack_linears
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


def test_linear_backend_choice() -> None:
    assert linear_backend("auto", torch.float32, CPU) == "onednn"
    assert linear_backend("auto", torch.bfloat16, CUDA) == "torch"
    assert linear_backend("torch", torch.float32, CPU) == "torch"
    bf16 = "onednn" if onednn_supports(torch.bfloat16) else "torch"
    assert linear_backend("auto", torch.bfloat16, CPU) == bf16
    with pytest.raises(ValueError, match="oneDNN"):
        linear_backend("onednn", torch.bfloat16, CUDA)
