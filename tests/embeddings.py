"""The embeddings Triton's vision model should return for some images: the
in-process tower on them, in one call, as Triton's model runs it
(vision_tower.py; tests/layers/test_vision_tower.py holds that tower to HF's own:
in float32 bit for bit on HF's projections, within its rounding on oneDNN's)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image

from services.layers.vision_tower import fuse_vision_tower
from services.model.checkpoint import load_vision_tower
from services.model.processor import load_image_processor
from services.model.spec import load_spec


def tower_embeddings(
    checkpoint: Path, images: list[bytes], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    spec = load_spec(checkpoint)
    pixels = load_image_processor(checkpoint)(
        images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt"
    )
    with torch.no_grad():
        tower = load_vision_tower(checkpoint, spec, dtype=dtype)
        fuse_vision_tower(tower)
        values = pixels["pixel_values"].to(dtype)
        return tower(values, grid_thw=pixels["image_grid_thw"]).pooler_output
