"""MoE experts: which implementation the engine picks, oneDNN's packed experts
and FlashInfer's fused kernel (GPU only) against the grouped torch experts."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.layers import backends
from services.layers.backends import moe_backend
from services.layers.cpu_kernels import linear_kernel
from services.layers.language_model import Experts, LanguageModel
from services.layers.linear import KernelExperts, PackedExperts
from services.layers.moe import FlashInferExperts, autotuning, fuse_experts
from services.model.checkpoint import load_language_weights
from services.model.demo import build_demo_checkpoint
from services.model.spec import MoeSpec, TextSpec, load_spec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("moe"), arch="qwen3_vl_moe")


def test_auto_picks_flashinfer_only_on_cuda_in_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends, "flashinfer_installed", lambda: True)
    assert moe_backend("auto", torch.float32, CPU) == "torch"
    assert moe_backend("auto", torch.bfloat16, CPU) == "torch"
    assert moe_backend("auto", torch.float32, CUDA) == "torch"
    assert moe_backend("auto", torch.bfloat16, CUDA) == "flashinfer"
    assert moe_backend("torch", torch.bfloat16, CUDA) == "torch"
    with pytest.raises(ValueError, match="CUDA and float16 or bfloat16"):
        moe_backend("flashinfer", torch.float32, CUDA)
    with pytest.raises(ValueError, match="CUDA and float16 or bfloat16"):
        moe_backend("flashinfer", torch.bfloat16, CPU)


def _experts(
    text: TextSpec, hidden: int, inter: int, num_experts: int, top_k: int, device: torch.device
) -> Experts:
    moe = MoeSpec(num_experts=num_experts, top_k=top_k, intermediate_size=inter, layers=())
    experts = Experts(dataclasses.replace(text, hidden_size=hidden), moe)
    torch.manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=hidden**-0.5)
        experts.down_proj.normal_(std=inter**-0.5)
    return experts.to(device)


def _routing(
    tokens: int, num_experts: int, top_k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, num_experts, device=device)
    weights, chosen = logits.softmax(-1).topk(top_k, dim=-1)
    return chosen, weights / weights.sum(-1, keepdim=True)


def test_fused_layout_is_the_checkpoints_with_gate_and_up_swapped(moe_checkpoint: Path) -> None:
    """fc1 is the checkpoint's gate_up_proj with its halves swapped; fc2 is down_proj."""
    experts = _experts(load_spec(moe_checkpoint).text, 16, 8, 4, 2, CPU)
    fused = FlashInferExperts(experts, torch.empty(0, dtype=torch.uint8), 16)
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    assert torch.equal(fused.fc1[:, :8], up) and torch.equal(fused.fc1[:, 8:], gate)
    assert torch.equal(fused.fc2, experts.down_proj)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_packed_experts_match_the_grouped_torch_experts(moe_checkpoint: Path, tokens: int) -> None:
    """oneDNN's packed matrices under the same routing."""
    experts = _experts(load_spec(moe_checkpoint).text, 256, 96, 8, 2, CPU)
    x = torch.randn(tokens, 256)
    chosen, weights = _routing(tokens, 8, 2, CPU)
    expected = experts(x, chosen, weights)
    packed = PackedExperts(experts)
    assert not list(packed.parameters())  # the packed copies replace the weights
    torch.testing.assert_close(packed(x, chosen, weights), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_kernel_experts_match_the_grouped_torch_experts(moe_checkpoint: Path, tokens: int) -> None:
    """EPD's linear kernel (the CPU default in float32) for the experts few tokens
    chose, F.linear for the rest, on the same weights."""
    kernel = linear_kernel()
    assert kernel is not None, "no C compiler or no AVX2: the CPU default would be oneDNN's"
    experts = _experts(load_spec(moe_checkpoint).text, 256, 96, 8, 2, CPU)
    x = torch.randn(tokens, 256)
    chosen, weights = _routing(tokens, 8, 2, CPU)
    expected = experts(x, chosen, weights)
    fast = KernelExperts(experts, kernel)
    assert fast.gate_up_proj is experts.gate_up_proj  # no copy
    torch.testing.assert_close(fast(x, chosen, weights), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("hidden", "inter", "num_experts", "top_k"),
    [(256, 96, 8, 2), (2048, 768, 128, 8)],  # the demo's routing; Qwen3-VL-30B-A3B's shapes
)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_flashinfer_experts_match_the_grouped_torch_experts(
    moe_checkpoint: Path,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    tokens: int,
) -> None:
    text = load_spec(moe_checkpoint).text
    experts = _experts(text, hidden, inter, num_experts, top_k, CUDA).to(dtype)
    x = torch.randn(tokens, hidden, device=CUDA, dtype=dtype)
    chosen, weights = _routing(tokens, num_experts, top_k, CUDA)
    expected = experts(x, chosen, weights)
    from flashinfer.fused_moe import cutlass_fused_moe_workspace_size

    size = cutlass_fused_moe_workspace_size(
        tokens,
        hidden,
        inter,
        num_experts,
        top_k,
        x_dtype=dtype,
        weight_dtype=dtype,
        output_dtype=dtype,
        device=CUDA,
    )
    workspace = torch.empty(size, dtype=torch.uint8, device=CUDA)
    got = FlashInferExperts(experts, workspace, tokens)(x, chosen, weights)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_every_sparse_layer_is_fused_on_cuda(moe_checkpoint: Path) -> None:
    spec = load_spec(moe_checkpoint)
    weights = load_language_weights(moe_checkpoint, spec)
    model = LanguageModel.from_weights(
        spec.text, {k: v.to(torch.bfloat16) for k, v in weights.items()}, CUDA
    )
    assert spec.text.moe is not None
    assert fuse_experts(model, 2048) == len(spec.text.moe.layers)
    fused = [m for m in model.modules() if isinstance(m, FlashInferExperts)]
    assert len({id(m.workspace) for m in fused}) == 1


class _FusedMoeStandIn:
    """Stands in for flashinfer (not installed without CUDA): records what the
    engine's MoE code asks of it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []
        self.tuning = 0

    def cutlass_fused_moe_workspace_size(
        self, max_num_tokens: int, *args: object, **kw: object
    ) -> int:
        return 1000 + max_num_tokens

    def cutlass_fused_moe(self, **kwargs: object) -> None:
        self.calls.append(kwargs)

    @contextlib.contextmanager
    def autotune(self, tune_mode: bool) -> Iterator[None]:
        assert tune_mode
        self.tuning += 1
        yield
        self.tuning -= 1


def test_every_layer_runs_on_one_workspace_and_warm_up_autotunes(
    moe_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel allocates several GiB per call without a workspace: every
    layer gets the one allocated for the engine's token budget, and the calls
    made under `autotuning` (the engine's warm-up) are FlashInfer's tuning runs."""
    stand_in = _FusedMoeStandIn()
    for name in ("flashinfer", "flashinfer.fused_moe", "flashinfer.autotuner"):
        monkeypatch.setitem(sys.modules, name, stand_in)  # type: ignore[arg-type]
    spec = load_spec(moe_checkpoint)
    model = LanguageModel.from_weights(spec.text, load_language_weights(moe_checkpoint, spec), CPU)
    assert fuse_experts(model, 2048) == len(spec.text.moe.layers)  # type: ignore[union-attr]
    fused = [m for m in model.modules() if isinstance(m, FlashInferExperts)]
    workspace = fused[0].workspace
    assert workspace.numel() == 1000 + 2048 and workspace.dtype == torch.uint8
    x = torch.randn(3, spec.text.hidden_size)
    chosen, weights = _routing(3, spec.text.moe.num_experts, spec.text.moe.top_k, CPU)  # type: ignore[union-attr]
    with autotuning(model):
        assert stand_in.tuning == 1
        for experts in fused:
            experts(x, chosen, weights)
    assert stand_in.tuning == 0
    assert [c["workspace_buffer"] for c in stand_in.calls] == [workspace] * len(fused)
    assert {c["tune_max_num_tokens"] for c in stand_in.calls} == {2048}


def test_no_autotuning_without_fused_experts(moe_checkpoint: Path) -> None:
    """On the CPU (no flashinfer to import) warm-up runs as it is."""
    spec = load_spec(moe_checkpoint)
    model = LanguageModel.from_weights(spec.text, load_language_weights(moe_checkpoint, spec), CPU)
    with autotuning(model):
        pass
