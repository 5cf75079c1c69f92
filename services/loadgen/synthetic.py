"""Synthetic images and videos: deterministic for a seed, with structure (a noisy
gradient; in a video, moving)."""

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


def random_video(
    num_frames: int = 30,
    width: int = 64,
    height: int = 48,
    fps: int = 10,
    seed: int = 0,
    container: str = "mp4",
    codec: str = "mpeg4",
) -> bytes:
    """An encoded clip (PyAV) of moving gradients with noise: every frame differs."""
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=container) as c:
        stream = c.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = np.empty((height, width, 3), np.uint8)
            frame[..., 0] = (np.arange(width)[None, :] * 4 + i * 8 + seed * 40) % 256
            frame[..., 1] = (np.arange(height)[:, None] * 5 + i * 3) % 256
            frame[..., 2] = rng.integers(0, 256, (height, width))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    return out.getvalue()
