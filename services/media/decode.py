"""Decoding untrusted image and video bytes within limits.

The header is read before any pixel: an image whose declared size is over the
pixel limit (a decompression bomb), or a video too long, too large or with too
many frames, is refused without being decoded.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from services.media.limits import ImageLimits
from services.model.video import VideoError, VideoInfo, probe

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")


class BadImageError(ValueError):
    """One image or video of a request cannot be used; the message names it
    (its index among the request's images and videos) and why."""

    def __init__(self, index: int, reason: str, kind: str = "image") -> None:
        super().__init__(f"{kind} {index}: {reason}")
        self.index = index


def check_count(num_images: int, limits: ImageLimits) -> None:
    if num_images > limits.max_images:
        raise BadImageError(
            limits.max_images, f"too many images: {num_images} > limit of {limits.max_images}"
        )


def _open(data: bytes, index: int, limits: ImageLimits) -> Image.Image:
    """Reads the header only; refuses what is too big or not an allowed format."""
    if not data:
        raise BadImageError(index, "empty image data")
    if len(data) > limits.max_image_bytes:
        raise BadImageError(
            index, f"{len(data)} bytes exceeds the limit of {limits.max_image_bytes} bytes"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        # PIL refuses absurd sizes itself, before our own (lower) limit is checked.
        raise BadImageError(
            index, f"declared size exceeds the limit of {limits.max_image_pixels} pixels"
        ) from None
    except UnidentifiedImageError:
        raise BadImageError(
            index, f"not a valid image (supported: {', '.join(ALLOWED_FORMATS)})"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadImageError(index, f"unreadable image header: {exc}") from None
    if image.format not in ALLOWED_FORMATS:
        supported = ", ".join(ALLOWED_FORMATS)
        raise BadImageError(
            index, f"format {image.format} is not supported (supported: {supported})"
        )
    width, height = image.size
    if width <= 0 or height <= 0:
        raise BadImageError(index, f"zero-size image ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise BadImageError(
            index,
            f"{width}x{height} = {width * height} pixels exceeds the limit of "
            f"{limits.max_image_pixels} pixels",
        )
    return image


def inspect_image(data: bytes, index: int, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the header alone, after the same checks as decode_image."""
    size: tuple[int, int] = _open(data, index, limits).size
    return size


def decode_image(data: bytes, index: int, limits: ImageLimits) -> Image.Image:
    """The image as loaded RGB pixels, or BadImageError."""
    image = _open(data, index, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as exc:
        raise BadImageError(index, f"corrupt or truncated image: {exc}") from None


def inspect_video(data: bytes, index: int, limits: ImageLimits) -> VideoInfo:
    """The video's header, after checking bytes, duration, frames and frame size."""

    def bad(reason: str) -> BadImageError:
        return BadImageError(index, reason, "video")

    if not data:
        raise bad("empty video data")
    if len(data) > limits.max_video_bytes:
        raise bad(f"{len(data)} bytes exceeds the limit of {limits.max_video_bytes} bytes")
    try:
        info = probe(data)
    except VideoError as exc:
        raise bad(str(exc)) from None
    if info.duration_s > limits.max_video_seconds:
        raise bad(
            f"{info.duration_s:.1f} s exceeds the limit of {limits.max_video_seconds:g} seconds"
        )
    if info.num_frames > limits.max_video_frames:
        raise bad(f"{info.num_frames} frames exceeds the limit of {limits.max_video_frames} frames")
    if info.width * info.height > limits.max_video_pixels:
        raise bad(
            f"{info.width}x{info.height} = {info.width * info.height} pixels a frame exceeds "
            f"the limit of {limits.max_video_pixels} pixels"
        )
    return info
