"""What a request's images and videos may be: the gateway checks them before
any pixel is decoded, the encoder again. Kept apart from the decoding (and its
torch) so that every process can parse `epd`'s command line cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images and videos may be (videos: per video)."""

    max_images: int = 16  # images and videos together
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000  # frames in the container (decoding cost)
    max_video_pixels: int = 1920 * 1080  # per frame

    def __post_init__(self) -> None:
        values = (
            self.max_images,
            self.max_image_bytes,
            self.max_image_pixels,
            self.max_video_bytes,
            self.max_video_seconds,
            self.max_video_frames,
            self.max_video_pixels,
        )
        if min(values) <= 0:
            raise ValueError(f"image limits must be positive: {self}")
