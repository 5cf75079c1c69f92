"""The vision towers as EPD runs them (services/layers/vision_tower.py)
against HF's own: each architecture, float32 and bfloat16, images whose windows
are all one length and images whose windows are not (a run of equal windows
attends in one call; the runs must split where lengths change). In float32
within float32 rounding of HF's on either GEMM (F.linear's without AVX-512,
oneDNN's packed one with it). In bfloat16 the attention on SDPA is bit for bit
HF's; the compiled window kernel is within bfloat16 rounding of SDPA; the whole
tower is close to HF's, not equal: its patch embedding is a GEMM (within a
bfloat16 step of the convolution), its projections oneDNN's packed GEMM, its
attention the window kernel where the CPU has one, and Qwen2.5-VL's norms the
language model's kernels, each rounding in its own order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.layers import vision_tower
from services.layers.cpu_kernels import (
    BF16_KINDS,
    bf16_window_attention,
    fused_ops,
    window_attention,
)
from services.layers.linear import PackedLinear, onednn_supports
from services.layers.vision_tower import (
    FusedVisionAttention,
    FusedVisionBlock,
    FusedVisionMLP,
    LinearPatchEmbedding,
    _runs,
    fuse_vision_tower,
)
from services.model.checkpoint import load_vision_tower
from services.model.demo import build_demo_checkpoint
from services.model.spec import ModelSpec, load_spec

GRIDS = {
    "equal windows": [[1, 32, 32], [1, 32, 32]],
    "ragged windows": [[1, 22, 30], [1, 8, 8], [2, 14, 36]],
}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    return build_demo_checkpoint(tmp_path_factory.mktemp(arch), size="tiny", seed=0, arch=arch)


def _tower(checkpoint: Path, spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's tower, its norms' weights made random (the same in every
    tower this loads): the demos' are ones, under which one norm passes for another."""
    tower = load_vision_tower(checkpoint, spec, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    for name, param in sorted(tower.named_parameters()):
        if "norm" in name or "ln_q" in name:
            param.data = (1 + 0.5 * torch.randn(param.shape, generator=generator)).to(dtype)
    return tower


def _pixels(spec: ModelSpec, grid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    vision = spec.vision
    torch.manual_seed(0)
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    return torch.randn(int(grid.prod(-1).sum()), patch).to(dtype)


def _outputs(
    tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor
) -> list[torch.Tensor]:
    """The pooled embeddings, then Qwen3-VL's deepstack features."""
    with torch.inference_mode():
        out = tower(pixels, grid_thw=grid)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius), in float32."""
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_the_fused_attention_computes_what_hfs_does(
    checkpoint: Path, dtype: torch.dtype, grids: list[list[int]]
) -> None:
    ops = fused_ops()
    assert ops is not None
    spec = load_spec(checkpoint)
    hf = _tower(checkpoint, spec, dtype)
    fused = _tower(checkpoint, spec, dtype)
    for block in fused.blocks:
        block.attn = FusedVisionAttention(block.attn, ops)
    grid = torch.tensor(grids)
    pixels = _pixels(spec, grid, dtype)
    for got, want in zip(_outputs(fused, pixels, grid), _outputs(hf, pixels, grid), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_the_fused_tower_computes_what_hf_does(
    checkpoint: Path, dtype: torch.dtype, grids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32: within 1e-5 in relative error on oneDNN's projections (bit for bit
    with HF's where torch has no oneDNN and the tower keeps them; F.linear's are
    the next test's). bfloat16: from the same patch embeddings, within 2**-6 of
    HF's in relative (Frobenius) error; the demos' towers measured 0.0057 (small)
    and 0.0094 (medium, 12 blocks)."""
    spec = load_spec(checkpoint)
    hf = _tower(checkpoint, spec, dtype)
    fused = _tower(checkpoint, spec, dtype)
    bf16 = dtype == torch.bfloat16
    monkeypatch.setattr(vision_tower, "avx512", lambda: True)  # oneDNN's GEMM on any class
    assert fuse_vision_tower(fused) >= len(fused.blocks)
    assert all(isinstance(block.attn, FusedVisionAttention) for block in fused.blocks)
    kernels = [block.attn.kernel for block in fused.blocks]
    assert kernels == [bf16_window_attention(hf.blocks[0].attn.head_dim) if bf16 else None] * len(
        kernels
    )
    packed = onednn_supports(dtype)
    assert isinstance(fused.patch_embed.proj, LinearPatchEmbedding) == packed
    rms_norms = hasattr(hf.blocks[0].norm1, "variance_epsilon")  # Qwen2.5-VL's
    blocks = [isinstance(block, FusedVisionBlock) for block in fused.blocks]
    assert blocks == [rms_norms] * len(blocks)
    gated = hasattr(hf.blocks[0].mlp, "gate_proj")  # Qwen2.5-VL's, on SiLU
    assert [isinstance(block.mlp, FusedVisionMLP) for block in fused.blocks] == [gated] * len(
        blocks
    )
    assert all(not isinstance(m, torch.nn.Linear) for m in fused.modules()) == packed
    assert any(isinstance(m, PackedLinear) for m in fused.modules()) == packed
    if bf16:  # HF's tower from the same patch embeddings
        hf.patch_embed.proj = LinearPatchEmbedding(hf.patch_embed.proj)
    grid = torch.tensor(grids)
    pixels = _pixels(spec, grid, dtype)
    for got, want in zip(_outputs(fused, pixels, grid), _outputs(hf, pixels, grid), strict=True):
        if bf16:
            error = _relative_error(got, want)
            assert error <= 2**-6, f"relative error {error:.4f}"
        elif packed:
            error = _relative_error(got, want)
            assert error <= 1e-5, f"relative error {error:.2e}"
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("pack", [True, False], ids=["oneDNN", "F.linear"])
def test_a_float32_tower_on_either_gemm_is_within_float32_rounding_of_hfs(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, pack: bool
) -> None:
    """oneDNN's packed GEMM or F.linear's (MKL's), whichever the CPU class runs
    (next test): the tower within 1e-5 of HF's either way, on any class."""
    assert onednn_supports(torch.float32), "torch's CPU build has oneDNN"
    spec = load_spec(checkpoint)
    hf = _tower(checkpoint, spec, torch.float32)
    fused = _tower(checkpoint, spec, torch.float32)
    monkeypatch.setattr(vision_tower, "avx512", lambda: pack)  # packs only there in float32
    fuse_vision_tower(fused)
    assert isinstance(fused.patch_embed.proj, LinearPatchEmbedding)
    assert any(isinstance(m, PackedLinear) for m in fused.modules()) == pack
    assert any(type(m) is torch.nn.Linear for m in fused.modules()) != pack
    grid = torch.tensor(GRIDS["ragged windows"])
    pixels = _pixels(spec, grid, torch.float32)
    for got, want in zip(_outputs(fused, pixels, grid), _outputs(hf, pixels, grid), strict=True):
        error = _relative_error(got, want)
        assert error <= 1e-5, f"relative error {error:.2e}"


@pytest.mark.parametrize("avx512", [True, False], ids=["AVX-512", "AVX2"])
def test_a_float32_tower_packs_its_projections_where_torch_runs_avx512(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, avx512: bool
) -> None:
    """Asked nothing: oneDNN's packed GEMM where torch runs AVX-512 (~1.9x MKL's
    AVX2 code on a 2-core Zen 5), F.linear's (MKL's) without it (~1.1x oneDNN's
    on a 2-core AVX2 Zen 3); the patch embedding a GEMM either way."""
    monkeypatch.setattr(vision_tower, "avx512", lambda: avx512)
    tower = _tower(checkpoint, load_spec(checkpoint), torch.float32)
    fuse_vision_tower(tower)
    assert any(isinstance(m, PackedLinear) for m in tower.modules()) == avx512
    assert any(type(m) is torch.nn.Linear for m in tower.modules()) != avx512
    assert isinstance(tower.patch_embed.proj, LinearPatchEmbedding)


def test_a_fused_block_adds_what_hfs_adds(tiny_checkpoint: Path) -> None:
    """Qwen2.5-VL's block in bfloat16 on the inputs a tower gives its first one:
    what it adds to the residual stream within 2**-6 of what HF's block adds (the
    tower's output is mostly that stream, which hides a wrong norm)."""
    ops = fused_ops()
    assert ops is not None
    spec = load_spec(tiny_checkpoint)
    tower = _tower(tiny_checkpoint, spec, torch.bfloat16)
    hf_block = tower.blocks[0]
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    hf_block.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True
    )
    grid = torch.tensor(GRIDS["ragged windows"])
    _outputs(tower, _pixels(spec, grid, torch.bfloat16), grid)
    args, kwargs = seen[0]
    x = args[0]
    with torch.inference_mode():
        want = hf_block(*args, **kwargs) - x
        got = FusedVisionBlock(hf_block, ops)(*args, **kwargs) - x
    error = _relative_error(got, want)
    assert error <= 2**-6, f"relative error {error:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_mlp_computes_what_hfs_does(tiny_checkpoint: Path, dtype: torch.dtype) -> None:
    """Qwen2.5-VL's gated MLP, gate and up one GEMM and SiLU(gate) * up one pass:
    float32 within float32 rounding of HF's (silu_mul's own e^x), bfloat16 within
    a bfloat16 step (the GEMM blocks its wider output in its own way)."""
    ops = fused_ops()
    assert ops is not None
    spec = load_spec(tiny_checkpoint)
    hf_mlp = _tower(tiny_checkpoint, spec, dtype).blocks[0].mlp
    torch.manual_seed(2)
    x = torch.randn(300, hf_mlp.gate_proj.in_features).to(dtype)
    with torch.inference_mode():
        want = hf_mlp(x)
        got = FusedVisionMLP(hf_mlp, ops)(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_patch_embedding_as_a_gemm_equals_the_convolution(
    checkpoint: Path, dtype: torch.dtype
) -> None:
    """Qwen3-VL's has a bias, Qwen2.5-VL's none; the same products, summed in
    another order: float32 within rounding, bfloat16 within a bfloat16 step."""
    spec = load_spec(checkpoint)
    embedding = load_vision_tower(checkpoint, spec, dtype=dtype).patch_embed
    vision = spec.vision
    torch.manual_seed(1)
    pixels = torch.randn(300, 3 * vision.temporal_patch_size * vision.patch_size**2).to(dtype)
    with torch.inference_mode():
        want = embedding(pixels)
        embedding.proj = LinearPatchEmbedding(embedding.proj)
        got = embedding(pixels)
    assert got.shape == want.shape == (300, embedding.embed_dim)
    # float32: sums of 1536 products in another order (1.1e-5 apart seen on a Zen 5 EPYC)
    tolerance = 3e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_windows_are_grouped_into_runs_of_one_length() -> None:
    cu = torch.tensor([0, 64, 128, 192, 240, 240, 304, 368, 400])
    assert list(_runs(cu)) == [(0, 64, 3), (192, 48, 1), (240, 64, 2), (368, 32, 1)]


@pytest.mark.parametrize("kind", BF16_KINDS)
@pytest.mark.parametrize(
    "lengths",
    [[64] * 4, [0, 37, 64, 5, 0, 16, 1], [1024]],
    ids=["equal", "ragged-and-empty", "one-image"],
)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (16, 80), (4, 128)])
def test_the_window_kernel_attends_as_sdpa_does(
    kind: str, lengths: list[int], heads: int, head_dim: int
) -> None:
    """Each window's tokens attend to one another, as SDPA on that window alone;
    q, k and v read from the fused QKV projection's rows, in bfloat16."""
    kernel = window_attention(kind)
    if kernel is None:
        pytest.skip(f"this CPU has no {kind} window kernel (its instructions)")
    if kind == "amx" and head_dim % 64:
        pytest.skip("the AMX kernel takes head_dim in multiples of 64")
    n = sum(lengths)
    generator = torch.Generator().manual_seed(heads * head_dim + n)
    qkv = torch.randn(n, 3 * heads, head_dim, generator=generator).bfloat16()
    starts = torch.tensor([0, *lengths]).cumsum(0)
    out = torch.full((n, heads, head_dim), float("nan")).bfloat16()
    scale = head_dim**-0.5
    failed = kernel(
        out.data_ptr(),
        qkv.data_ptr(),
        qkv[:, heads].data_ptr(),
        qkv[:, 2 * heads].data_ptr(),
        starts.data_ptr(),
        len(lengths),
        heads,
        head_dim,
        qkv.stride(0),
        scale,
        torch.get_num_threads(),
    )
    assert failed == 0
    q, k, v = qkv.view(n, 3, heads, head_dim).permute(1, 2, 0, 3).unbind(0)
    for start, end in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, start:end], k[:, start:end], v[:, start:end], scale=scale
        )
        torch.testing.assert_close(out[start:end], want.transpose(0, 1), atol=1e-2, rtol=1e-2)
