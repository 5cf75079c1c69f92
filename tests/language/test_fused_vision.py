"""The vision towers as EPD runs them (services/language/engine/fused_vision.py)
against HF's own: each architecture, float32 and bfloat16, images whose windows
are all one length and images whose windows are not (a run of equal windows
attends in one call; the runs must split where lengths change). Bit for bit in
float32; in bfloat16 bit for bit given the same patch embeddings (the GEMM that
replaces the convolution there sums in another order), and those within a
bfloat16 step of the convolution's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.language.engine.fused_vision import (
    FusedVisionAttention,
    LinearPatchEmbedding,
    _runs,
    fuse_vision_tower,
)
from services.model.checkpoint import load_vision_tower
from services.model.demo import build_demo_checkpoint
from services.model.spec import load_spec

GRIDS = {
    "equal windows": [[1, 32, 32], [1, 32, 32]],
    "ragged windows": [[1, 22, 30], [1, 8, 8], [2, 14, 36]],
}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    return build_demo_checkpoint(tmp_path_factory.mktemp(arch), size="tiny", seed=0, arch=arch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_the_fused_tower_computes_what_hf_does(
    checkpoint: Path, dtype: torch.dtype, grids: list[list[int]]
) -> None:
    spec = load_spec(checkpoint)
    hf = load_vision_tower(checkpoint, spec, dtype=dtype)
    fused = load_vision_tower(checkpoint, spec, dtype=dtype)
    gemm = dtype == torch.bfloat16  # the patch embedding as a GEMM
    assert fuse_vision_tower(fused) == len(fused.blocks) + gemm
    assert all(isinstance(block.attn, FusedVisionAttention) for block in fused.blocks)
    assert isinstance(fused.patch_embed.proj, LinearPatchEmbedding) == gemm
    if gemm:  # HF's tower from the same patch embeddings
        hf.patch_embed.proj = LinearPatchEmbedding(hf.patch_embed.proj)
    vision = spec.vision
    grid = torch.tensor(grids)
    torch.manual_seed(0)
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * vision.temporal_patch_size * vision.patch_size**2
    ).to(dtype)
    with torch.inference_mode():
        want, got = hf(pixels, grid_thw=grid), fused(pixels, grid_thw=grid)
    assert torch.equal(got.pooler_output, want.pooler_output)
    for a, b in zip(
        getattr(got, "deepstack_features", None) or [],
        getattr(want, "deepstack_features", None) or [],
        strict=True,
    ):
        assert torch.equal(a, b)


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
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_windows_are_grouped_into_runs_of_one_length() -> None:
    cu = torch.tensor([0, 64, 128, 192, 240, 240, 304, 368, 400])
    assert list(_runs(cu)) == [(0, 64, 3), (192, 48, 1), (240, 64, 2), (368, 32, 1)]
