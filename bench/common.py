"""Shared by the bench scripts: demo checkpoints in a cache folder, timing helpers."""

from __future__ import annotations

import statistics
from pathlib import Path

from services import env
from services.model.demo import build_demo_checkpoint


def demo_checkpoint(size: str) -> Path:
    """The demo checkpoint of a size, built once into EPD_CACHE_DIR."""
    folder = Path(env.CACHE_DIR.get()) / f"demo-{size}"
    if not (folder / "model.safetensors").is_file():
        build_demo_checkpoint(folder, size=size, seed=0)
    return folder


def percentile(values: list[float], q: float) -> float:
    """q in [0, 100], linear interpolation."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]
