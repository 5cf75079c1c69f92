"""Token hints from width/height alone must equal what the HF processor produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.loadgen.synthetic import random_image
from services.model.processor import ImageTokenRule, load_image_processor

SIZES = [
    (1, 1),
    (10, 10),
    (27, 29),
    (28, 28),
    (56, 56),
    (100, 30),
    (30, 100),
    (223, 225),
    (224, 224),
    (300, 500),
    (448, 448),
    (640, 480),
    (480, 640),
    (799, 601),
    (1000, 10),
    (10, 1000),
    (1024, 768),
    (1280, 720),
    (1290, 1000),
    (1500, 1200),
    (1920, 1080),
    (2000, 200),
]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_token_count_equals_processor(tiny_checkpoint: Path, width: int, height: int) -> None:
    rule = ImageTokenRule.from_checkpoint(tiny_checkpoint)
    processor = load_image_processor(tiny_checkpoint)
    out = processor(images=[random_image(width, height)], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    grid = rule.grid(height, width)
    assert (grid.t, grid.h, grid.w) == (t, h, w)
    assert rule.num_tokens(height, width) == out["pixel_values"].shape[0] // 4


def test_rule_reads_the_checkpoint_limits(tiny_checkpoint: Path) -> None:
    rule = ImageTokenRule.from_checkpoint(tiny_checkpoint)
    assert rule.min_pixels == 56 * 56
    assert rule.max_pixels == 28 * 28 * 1280
    assert rule.factor == 28


def test_bad_sizes_are_errors() -> None:
    rule = ImageTokenRule()
    with pytest.raises(ValueError, match="empty"):
        rule.num_tokens(0, 10)
    with pytest.raises(ValueError, match="aspect ratio"):
        rule.num_tokens(1, 500)
