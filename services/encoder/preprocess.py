"""Image bytes -> (pixel patches, grid) with the checkpoint's HF image processor;
video bytes -> the same with the model's video rules (services/model/video.py).

Decoding and preprocessing run in a thread pool (PIL, PyAV, numpy and torch
release the GIL), so one slow image or video never stalls the event loop or
other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.media.decode import BadImageError, decode_image, inspect_video
from services.media.limits import ImageLimits
from services.model.processor import ImageTokenRule, load_image_processor
from services.model.video import VideoRule, load_video
from services.wire.messages import MediaGrid, media_key


@dataclass(frozen=True, slots=True)
class PreprocessedImage:
    pixel_values: np.ndarray  # [num_patches, 3 * temporal_patch * patch * patch] float32
    grid: MediaGrid


class Preprocessor:
    def __init__(self, checkpoint: str | Path, limits: ImageLimits, workers: int = 2) -> None:
        self.limits = limits
        self.rule = ImageTokenRule.from_checkpoint(checkpoint)
        self.video_rule = VideoRule.from_checkpoint(checkpoint)
        self._processor = load_image_processor(checkpoint)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="preprocess")

    def _run(self, data: bytes, index: int) -> PreprocessedImage:
        image = decode_image(data, index, self.limits)
        try:
            self.rule.grid(image.height, image.width)  # aspect-ratio and size checks
        except ValueError as exc:
            raise BadImageError(index, str(exc)) from None
        out = self._processor(images=[image], return_tensors="np")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return PreprocessedImage(pixels, MediaGrid(t, h, w))

    def _run_video(self, data: bytes, index: int) -> PreprocessedImage:
        info = inspect_video(data, index, self.limits)
        try:
            pixels, grid = load_video(data, self.video_rule, info)
        except ValueError as exc:  # VideoError, or the resize rule's aspect-ratio check
            raise BadImageError(index, str(exc), "video") from None
        return PreprocessedImage(pixels.numpy(), grid)

    async def keys(self, images: Sequence[bytes], salt: str = "") -> list[str]:
        loop = asyncio.get_running_loop()
        keys = (loop.run_in_executor(self._pool, media_key, d, salt) for d in images)
        return list(await asyncio.gather(*keys))

    def start(
        self, images: Sequence[tuple[int, bytes]], videos: Set[int] = frozenset()
    ) -> list[asyncio.Future[PreprocessedImage]]:
        """(request index, bytes) pairs -> each one's preprocessing, started in the
        pool (the indices in `videos` are videos); BadImageError names the index."""
        loop = asyncio.get_running_loop()
        return [
            loop.run_in_executor(self._pool, self._run_video if i in videos else self._run, d, i)
            for i, d in images
        ]

    async def preprocess(
        self, images: Sequence[tuple[int, bytes]], videos: Set[int] = frozenset()
    ) -> list[PreprocessedImage]:
        """`start`'s, all of them once done; the first item's error in order."""
        results = await asyncio.gather(*self.start(images, videos), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, PreprocessedImage)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
