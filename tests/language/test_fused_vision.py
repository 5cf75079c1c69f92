"""The vision towers with the fused rotary embedding (services/language/engine/fused_vision.py)
against HF's own, bit for bit: each architecture, float32 and bfloat16, images
whose windows are all one length and images whose windows are not (a run of
equal windows attends in one call; the runs must split where lengths change)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.language.engine.fused_vision import FusedVisionAttention, _runs, fuse_vision_attention
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
def test_the_fused_tower_equals_hf_bit_for_bit(
    checkpoint: Path, dtype: torch.dtype, grids: list[list[int]]
) -> None:
    spec = load_spec(checkpoint)
    hf = load_vision_tower(checkpoint, spec, dtype=dtype)
    fused = load_vision_tower(checkpoint, spec, dtype=dtype)
    assert fuse_vision_attention(fused) == len(fused.blocks) > 0
    assert all(isinstance(block.attn, FusedVisionAttention) for block in fused.blocks)
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


def test_windows_are_grouped_into_runs_of_one_length() -> None:
    cu = torch.tensor([0, 64, 128, 192, 240, 240, 304, 368, 400])
    assert list(_runs(cu)) == [(0, 64, 3), (192, 48, 1), (240, 64, 2), (368, 32, 1)]
