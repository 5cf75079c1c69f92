"""Synthetic images: deterministic for a seed, with structure (a noisy gradient)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth random colours (a noisy gradient), so encoders see structure, not white noise."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    base = rng.random((1, 1, 3)) * x + rng.random((1, 1, 3)) * y
    noise = rng.random((height, width, 3)) * 0.25
    pixels = np.clip((base + noise) / 2.25 * 255, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def encode_image(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()
