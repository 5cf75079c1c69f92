"""Image preprocessing facts: the HF image processor, and the token count of an
image from its width and height alone (the processor's resize rule).

The gateway uses ImageTokenRule to compute token hints before any pixel is
decoded; the encoder runs the real processor. Tests hold the two equal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.spec import CheckpointError
from services.wire.messages import MediaGrid

MAX_ASPECT_RATIO = 200  # the processor refuses anything more extreme
# CLIP's normalisation, which Qwen2-VL's image and video processors use
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# transformers' IMAGENET_STANDARD_*, which Qwen3-VL's processors use
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)


def check_aspect_ratio(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")


@dataclass(frozen=True, slots=True)
class ImageTokenRule:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """Qwen2-VL's smart_resize: both sides multiples of `factor`, pixels within
        [min_pixels, max_pixels], aspect ratio kept as closely as possible."""
        if height <= 0 or width <= 0:
            raise ValueError(f"image size {width}x{height} is empty")
        check_aspect_ratio(height, width)
        factor = self.factor
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    @property
    def max_tokens(self) -> int:
        """Tokens of the largest image the resize rule lets through."""
        return self.max_pixels // (self.factor * self.factor)

    def grid(self, height: int, width: int) -> MediaGrid:
        h, w = self.resized(height, width)
        return MediaGrid(1, h // self.patch_size, w // self.patch_size)

    def num_tokens(self, height: int, width: int) -> int:
        return self.grid(height, width).num_tokens(self.merge_size)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> ImageTokenRule:
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            raise CheckpointError(f"{folder}: missing preprocessor_config.json")
        return cls.from_config(json.loads(path.read_text()))

    @classmethod
    def from_config(
        cls, config: dict[str, Any], defaults: ImageTokenRule | None = None
    ) -> ImageTokenRule:
        """From an image or video processor config; missing keys take `defaults`'."""
        size = config.get("size") or {}
        defaults = defaults or cls()
        return cls(
            patch_size=config.get("patch_size", defaults.patch_size),
            merge_size=config.get("merge_size", defaults.merge_size),
            temporal_patch_size=config.get("temporal_patch_size", defaults.temporal_patch_size),
            min_pixels=config.get("min_pixels") or size.get("shortest_edge", defaults.min_pixels),
            max_pixels=config.get("max_pixels") or size.get("longest_edge", defaults.max_pixels),
        )


def load_image_processor(folder: str | Path) -> Any:
    """The checkpoint's HF image processor (the PIL one: no torchvision needed)."""
    from transformers import AutoImageProcessor

    if not (Path(folder) / "preprocessor_config.json").is_file():
        raise CheckpointError(f"{folder}: missing preprocessor_config.json")
    try:
        return AutoImageProcessor.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load the image processor: {exc}") from exc
