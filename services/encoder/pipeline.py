"""EncodePipeline: image and video bytes -> per-item embeddings.

Cached items (by content hash) skip everything; the rest are decoded and
preprocessed in the worker pool, then sent to Triton as one request (a
video's temporal patches go in the same forward as the images).
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set
from dataclasses import dataclass

import numpy as np
import torch

from services.encoder.cache import EmbeddingCache, ImageEmbedding
from services.encoder.images import check_count
from services.encoder.limits import ImageLimits
from services.encoder.metrics import EncoderMetrics
from services.encoder.preprocess import Preprocessor
from services.encoder.triton_client import VitClient
from services.wire.messages import MediaGrid


@dataclass(frozen=True, slots=True)
class Encoded:
    images: list[ImageEmbedding]
    num_cached: int

    @property
    def grids(self) -> list[MediaGrid]:
        return [i.grid for i in self.images]

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.images)

    @property
    def planes(self) -> list[torch.Tensor]:
        """Per plane, every image's tokens in order."""
        return [torch.cat(parts) for parts in zip(*(i.planes for i in self.images), strict=True)]


class EncodePipeline:
    def __init__(
        self,
        preprocessor: Preprocessor,
        vit: VitClient,
        cache: EmbeddingCache,
        limits: ImageLimits,
        metrics: EncoderMetrics,
    ) -> None:
        self.preprocessor = preprocessor
        self.vit = vit
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.merge_size = preprocessor.rule.merge_size

    async def encode(self, images: Sequence[bytes], videos: Set[int] = frozenset()) -> Encoded:
        """`images`: the request's images and videos in order; `videos`: which are videos."""
        if not images:
            raise ValueError("no images to encode")
        check_count(len(images), self.limits)
        if any(not 0 <= i < len(images) for i in videos):
            raise ValueError(
                f"video indices {sorted(videos)} are not all among the {len(images)} items"
            )
        keys = await self.preprocessor.keys(images)
        found: dict[int, ImageEmbedding] = {}
        missing: list[int] = []
        for index, key in enumerate(keys):
            entry = self.cache.get(key)
            if entry is None:
                missing.append(index)
            else:
                found[index] = entry
        self.metrics.cache_hits.inc(len(found))
        self.metrics.cache_misses.inc(len(missing))
        if missing:
            started = time.perf_counter()
            pre = await self.preprocessor.preprocess([(i, images[i]) for i in missing], videos)
            self.metrics.preprocess_seconds.observe(time.perf_counter() - started)
            started = time.perf_counter()
            out = await self.vit.infer(
                np.concatenate([p.pixel_values for p in pre]),
                np.array([[p.grid.t, p.grid.h, p.grid.w] for p in pre], dtype=np.int64),
            )
            self.metrics.triton_seconds.observe(time.perf_counter() - started)
            sizes = [p.grid.num_tokens(self.merge_size) for p in pre]
            per_image = zip(*(torch.split(plane, sizes) for plane in out.planes), strict=True)
            for index, p, planes in zip(missing, pre, per_image, strict=True):
                entry = ImageEmbedding(tuple(t.clone() for t in planes), p.grid)
                found[index] = entry
                self.cache.put(keys[index], entry)
            self.metrics.cache_bytes.set(self.cache.bytes_used)
        encoded = Encoded([found[i] for i in range(len(images))], len(images) - len(missing))
        self.metrics.images.inc(len(images))
        self.metrics.tokens.inc(encoded.num_tokens)
        return encoded
