"""EncodePipeline: image and video bytes -> per-item embeddings.

Cached items (by content hash) skip everything; an item another request is
encoding right now waits for that encode (one encode per item at a time; if
that one fails, this request encodes the item itself); the rest are decoded
and preprocessed in the worker pool, then sent to Triton as one request (a
video's temporal patches go in the same forward as the images).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence, Set
from dataclasses import dataclass

import numpy as np
import torch

from services.encoder.cache import EmbeddingCache, ImageEmbedding
from services.encoder.metrics import EncoderMetrics
from services.encoder.preprocess import Preprocessor
from services.encoder.triton_client import VitClient
from services.media.decode import check_count
from services.media.limits import ImageLimits
from services.runtime import tracing
from services.wire.messages import MediaGrid

RECENT_S = 10.0  # the window of the recent encode time the broker hears


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
        # Items being encoded, by content hash: the encode's result, for others to share.
        self._pending: dict[str, asyncio.Future[ImageEmbedding]] = {}
        # for the broker (Heartbeat): items looked up and found, encodes in progress,
        # and when each of the last RECENT_S's encodes ended and how long it took
        self.num_lookups = self.num_hits = self.num_encoding = 0
        self._recent: deque[tuple[float, float]] = deque()

    async def encode(self, images: Sequence[bytes], videos: Set[int] = frozenset()) -> Encoded:
        """`images`: the request's images and videos in order; `videos`: which are videos."""
        self.num_encoding += 1
        started = time.monotonic()
        try:
            return await self._encode(images, videos)
        finally:
            self.num_encoding -= 1
            ended = time.monotonic()
            self._recent.append((ended, ended - started))

    def recent_encode_seconds(self) -> float:
        """The mean time of the encodes that ended in the last RECENT_S (0: none)."""
        horizon = time.monotonic() - RECENT_S
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        return sum(s for _, s in self._recent) / len(self._recent) if self._recent else 0.0

    async def _encode(self, images: Sequence[bytes], videos: Set[int]) -> Encoded:
        if not images:
            raise ValueError("no images to encode")
        check_count(len(images), self.limits)
        if any(not 0 <= i < len(images) for i in videos):
            raise ValueError(
                f"video indices {sorted(videos)} are not all among the {len(images)} items"
            )
        keys = await self.preprocessor.keys(images)
        found: dict[int, ImageEmbedding] = {}
        mine: list[int] = []  # encoded by this request
        theirs: dict[int, asyncio.Future[ImageEmbedding]] = {}  # being encoded by another
        loop = asyncio.get_running_loop()
        for index, key in enumerate(keys):
            entry = self.cache.get(key)
            if entry is not None:
                found[index] = entry
            elif key in self._pending:
                theirs[index] = self._pending[key]
            else:
                self._pending[key] = loop.create_future()
                mine.append(index)
        self.num_lookups += len(keys)
        self.num_hits += len(found)
        self.metrics.cache_hits.inc(len(found))
        self.metrics.cache_misses.inc(len(mine))
        self.metrics.shared_encodes.inc(len(theirs))
        if mine:
            found.update(await self._encode_mine(images, videos, keys, mine))
        retry = []
        for index, future in theirs.items():
            try:
                found[index] = await asyncio.shield(future)
            except Exception:  # that encode failed (or its request left): this one tries
                retry.append(index)
        if retry:
            again = await self._encode(
                [images[i] for i in retry], {retry.index(i) for i in videos if i in retry}
            )
            found.update(zip(retry, again.images, strict=True))
        encoded = Encoded([found[i] for i in range(len(images))], len(images) - len(mine))
        self.metrics.images.inc(len(images))
        self.metrics.tokens.inc(encoded.num_tokens)
        return encoded

    async def _encode_mine(
        self, images: Sequence[bytes], videos: Set[int], keys: list[str], mine: list[int]
    ) -> dict[int, ImageEmbedding]:
        """Preprocesses and encodes the items this request took on, caches them and
        gives each result to the requests waiting for it (or this one's failure:
        they then encode the item themselves)."""
        futures = [self._pending[keys[i]] for i in mine]
        try:
            started = time.perf_counter()
            with tracing.span("encoder.preprocess", items=len(mine)):
                pre = await self.preprocessor.preprocess([(i, images[i]) for i in mine], videos)
            self.metrics.preprocess_seconds.observe(time.perf_counter() - started)
            started = time.perf_counter()
            pixels = np.concatenate([p.pixel_values for p in pre])
            with tracing.span("encoder.triton_infer", items=len(pre), patches=len(pixels)):
                out = await self.vit.infer(
                    pixels, np.array([[p.grid.t, p.grid.h, p.grid.w] for p in pre], dtype=np.int64)
                )
            self.metrics.triton_seconds.observe(time.perf_counter() - started)
        except BaseException as exc:
            for future in futures:
                future.set_exception(RuntimeError(f"the encode this waited for failed: {exc!r}"))
                future.exception()  # retrieved: a waiter may not exist
            raise
        finally:
            for i in mine:
                self._pending.pop(keys[i], None)
        sizes = [p.grid.num_tokens(self.merge_size) for p in pre]
        per_image = zip(*(torch.split(plane, sizes) for plane in out.planes), strict=True)
        done: dict[int, ImageEmbedding] = {}
        for index, p, planes, future in zip(mine, pre, per_image, futures, strict=True):
            entry = done[index] = ImageEmbedding(tuple(t.clone() for t in planes), p.grid)
            self.cache.put(keys[index], entry)
            future.set_result(entry)
        self.metrics.cache_bytes.set(self.cache.bytes_used)
        return done
