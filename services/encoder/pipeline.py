"""EncodePipeline: image and video bytes -> per-item embeddings.

Cached items (by content hash) skip everything; an item another request is
encoding right now waits for that encode (one encode per item at a time; if
that one fails, this request encodes the item itself); the rest are decoded
and preprocessed in the worker pool, each item on its own, and sent to Triton:
as one request once all are preprocessed (a video's temporal patches in the
same forward as the images), or, `one_by_one`, each item on its own as soon
as it is preprocessed, in prompt order, and a video in parts of VIDEO_PART
temporal patches (the tower attends within a temporal patch: the parts equal
the whole, bit for bit), so that a `Sink` has the first embeddings while the
next are encoded (the language instance prefills them meanwhile). Items
the sink says its receiver already holds (`Sink.held`: the language
instance's prefix cache has their KV) are not encoded at all; only the items
it may hold wait for its word, the others go to Triton at once. An item the
route says another encoder holds is fetched from it first (`peers.py`), and
encoded only if that fails; `cached` is that other side: what this encoder
holds, or is encoding, for a peer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence, Set
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from services.encoder.cache import EmbeddingCache, ImageEmbedding
from services.encoder.metrics import EncoderMetrics
from services.encoder.peers import Peers
from services.encoder.preprocess import PreprocessedImage, Preprocessor
from services.encoder.triton_client import VitClient
from services.media.decode import check_count
from services.media.limits import ImageLimits
from services.runtime import tracing
from services.transfer.state import fail as fail_future
from services.wire.messages import MediaGrid

RECENT_S = 10.0  # the window of the recent encode time the broker hears
VIDEO_PART = 2  # temporal patches (four frames) a video's part has, one_by_one


@dataclass(frozen=True, slots=True)
class Encoded:
    images: list[ImageEmbedding | None]  # each item's; None: its receiver held it
    grids: list[MediaGrid]  # each item's
    num_tokens: int  # of every item
    num_cached: int
    num_held: int = 0  # not encoded: the receiver holds them

    @property
    def planes(self) -> list[torch.Tensor]:
        """Per plane, every image's tokens in order (of an encode with no receiver)."""
        images = [i for i in self.images if i is not None]
        assert len(images) == len(self.images), "the receiver held some items"
        return [torch.cat(parts) for parts in zip(*(i.planes for i in images), strict=True)]


class Sink(Protocol):
    """Where an encode's items go as they are ready (the servicer's transfer)."""

    async def grids(self, grids: Sequence[MediaGrid]) -> None:
        """Every item's grid, once all are known, before any item."""

    def item(self, index: int, embedding: ImageEmbedding, start: int = 0) -> None:
        """Tokens [start, start + embedding.num_tokens) of item `index` (all of an
        image; a video comes in parts), the moment they exist (in no set order)."""

    @property
    def may_hold(self) -> int:
        """How many of the leading items the receiver may hold (the route says):
        only those wait for `held` before they are encoded."""

    async def held(self) -> Set[int]:
        """Which of the first `may_hold` items the receiver holds already, asked
        once the grids are told and before those are encoded: those are not."""


def _joined(parts: list[ImageEmbedding], grid: MediaGrid) -> ImageEmbedding:
    """A video's parts as the one item they are."""
    planes = tuple(torch.cat(plane) for plane in zip(*(p.planes for p in parts), strict=True))
    return ImageEmbedding(planes, grid)


class _Report:
    """Tells a sink (if any) of the items as they land, once it has every grid:
    what lands before then waits for `announce`."""

    def __init__(self, sink: Sink | None) -> None:
        self.sink = sink
        self.early: list[tuple[int, ImageEmbedding, int]] = []
        self.announced = False

    def landed(self, index: int, part: ImageEmbedding, start: int = 0) -> None:
        if self.sink is None:
            return
        if self.announced:
            self.sink.item(index, part, start)
        else:
            self.early.append((index, part, start))

    @property
    def may_hold(self) -> int:
        return self.sink.may_hold if self.sink is not None else 0

    async def held(self) -> Set[int]:
        return await self.sink.held() if self.sink is not None else frozenset()

    async def announce(self, grids: Sequence[MediaGrid]) -> None:
        if self.sink is None:
            return
        await self.sink.grids(grids)
        self.announced = True
        for index, part, start in self.early:
            self.sink.item(index, part, start)
        self.early = []


class _Items:
    """One encode's items, by index: those whose embedding it has (found: cached,
    shared by another request's encode, or encoded here), those it encodes
    (mine; until each is encoded or held, the future other requests wait on:
    waiters) and those another request is encoding (theirs)."""

    def __init__(self, keys: list[str], report: _Report) -> None:
        self.keys = keys
        self.report = report
        self.found: dict[int, ImageEmbedding] = {}
        self.mine: list[int] = []
        self.waiters: dict[int, asyncio.Future[ImageEmbedding]] = {}
        self.theirs: dict[int, asyncio.Future[ImageEmbedding]] = {}

    def landed(self, index: int, entry: ImageEmbedding) -> None:
        """A whole item from the cache or another request's encode."""
        self.found[index] = entry
        self.report.landed(index, entry)

    def encoded(self, index: int, entry: ImageEmbedding, cache: EmbeddingCache) -> None:
        """An item this request encoded: cached, and given to its waiters."""
        cache.put(self.keys[index], entry)
        self.waiters.pop(index).set_result(entry)
        self.found[index] = entry

    def held(self, index: int) -> None:
        """An item its receiver holds: not encoded; its waiters encode it themselves."""
        fail_future(self.waiters.pop(index), RuntimeError("not encoded: its receiver held it"))

    def fail(self, exc: BaseException) -> None:
        """This encode failed: the waiters for what it had not encoded hear it."""
        for future in self.waiters.values():
            fail_future(future, RuntimeError(f"the encode this waited for failed: {exc!r}"))


class EncodePipeline:
    def __init__(
        self,
        preprocessor: Preprocessor,
        vit: VitClient,
        cache: EmbeddingCache,
        limits: ImageLimits,
        metrics: EncoderMetrics,
        one_by_one: bool = False,
        peers: Peers | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.vit = vit
        self.cache = cache
        self.limits = limits
        self.metrics = metrics
        self.one_by_one = one_by_one  # a Triton request per item, not per request
        self.merge_size = preprocessor.rule.merge_size
        self.peers = peers or Peers(metrics)
        # Items being encoded, by content hash: the encode's result, for others to share.
        self._pending: dict[str, asyncio.Future[ImageEmbedding]] = {}
        self._fetching: set[str] = set()  # of those, the ones fetched from a peer
        # for the broker (Heartbeat): items looked up and found, encodes in progress,
        # and when each of the last RECENT_S's encodes ended and how long it took
        self.num_lookups = self.num_hits = self.num_encoding = 0
        self._recent: deque[tuple[float, float]] = deque()

    async def encode(
        self,
        images: Sequence[bytes],
        videos: Set[int] = frozenset(),
        sink: Sink | None = None,
        salt: str = "",
        peers: Sequence[str] = (),
    ) -> Encoded:
        """`images`: the request's images and videos in order; `videos`: which are
        videos; `sink`: told the grids, then each item as it is ready; `salt`: the
        client's cache scope (media_key): the cache serves only what it encoded
        under the same; `peers`: per item, another encoder's address to fetch
        it from ("": none)."""
        self.num_encoding += 1
        started = time.monotonic()
        try:
            return await self._encode(images, videos, sink, salt, peers)
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

    async def cached(self, key: str, wait_s: float) -> ImageEmbedding | None:
        """An item for a peer encoder: from the cache, or from its encode in
        progress here (waited for at most `wait_s`); None if neither, or if it
        is being fetched from a peer itself (two encoders never wait on each other)."""
        entry = self.cache.get(key)
        pending = self._pending.get(key)
        if entry is not None or pending is None or key in self._fetching:
            return entry
        try:
            async with asyncio.timeout(wait_s):
                return await asyncio.shield(pending)
        except (TimeoutError, RuntimeError):  # slow, failed, or its receiver held it
            return None

    async def _encode(
        self,
        images: Sequence[bytes],
        videos: Set[int],
        sink: Sink | None,
        salt: str,
        peers: Sequence[str] = (),
    ) -> Encoded:
        """Every item from the cache, from another request's encode of it, or
        through Triton here; the sink told the grids, then each item as it lands."""
        if not images:
            raise ValueError("no images to encode")
        check_count(len(images), self.limits)
        if any(not 0 <= i < len(images) for i in videos):
            raise ValueError(
                f"video indices {sorted(videos)} are not all among the {len(images)} items"
            )
        items = self._look_up(await self.preprocessor.keys(images, salt), _Report(sink))
        try:
            grids = await self._gather(images, videos, items, salt, peers)
        except BaseException as exc:
            items.fail(exc)
            raise
        finally:
            for i in items.mine:
                self._pending.pop(items.keys[i], None)
            self.metrics.cache_bytes.set(self.cache.bytes_used)
        held = sum(i not in items.found for i in range(len(images)))
        encoded = Encoded(
            [items.found.get(i) for i in range(len(images))],
            grids,
            sum(g.num_tokens(self.merge_size) for g in grids),
            len(images) - len(items.mine),
            held,
        )
        self.metrics.images.inc(len(images) - held)
        self.metrics.held_items.inc(held)
        self.metrics.tokens.inc(encoded.num_tokens)
        return encoded

    async def _gather(
        self,
        images: Sequence[bytes],
        videos: Set[int],
        items: _Items,
        salt: str,
        peers: Sequence[str],
    ) -> list[MediaGrid]:
        """This request's items fetched from peers, the rest preprocessed and
        encoded (`_encode_mine`) while it waits for those another request
        encodes; the grids told once all are known. Returns each item's grid."""
        fetched = await self._fetch(items, peers)
        todo = [i for i in items.mine if i not in fetched]
        pre = self._preprocess(images, videos, todo)
        encoding = asyncio.ensure_future(self._encode_mine(todo, pre, items))
        try:
            grids = {i: p.grid for i, p in zip(todo, await asyncio.gather(*pre), strict=True)}
            for index, entry in (await self._shared(images, videos, items.theirs, salt)).items():
                items.landed(index, entry)
            grids |= {i: e.grid for i, e in items.found.items() if i not in todo}
            ordered = [grids[i] for i in range(len(images))]
            await items.report.announce(ordered)
            await encoding
        finally:
            if not encoding.done():
                encoding.cancel()
                await asyncio.wait([encoding])
            for future in pre:  # what a failure left: cancelled, or its error read
                if future.done() and not future.cancelled():
                    future.exception()
                else:
                    future.cancel()
        return ordered

    async def _fetch(self, items: _Items, peers: Sequence[str]) -> set[int]:
        """The items of this request's own (`mine`) that a peer holds, fetched
        from it, cached here and told as they land: their indices. Not those
        the receiver may hold (they wait for its word, `_encode_mine`)."""
        may_hold = items.report.may_hold
        wanted = {
            i: (peers[i], items.keys[i])
            for i in items.mine
            if i < len(peers) and peers[i] and i >= may_hold
        }
        if not wanted:
            return set()
        keys = {key for _, key in wanted.values()}
        self._fetching |= keys
        try:
            got = await self.peers.fetch_all(wanted)
        finally:
            self._fetching -= keys
        for index, entry in got.items():
            items.report.landed(index, entry)
            items.encoded(index, entry, self.cache)
        return set(got)

    def _look_up(self, keys: list[str], report: _Report) -> _Items:
        """Each item's place: cached (found), encoded by this request (mine: its
        encode is pending from now on) or by another one right now (theirs)."""
        items = _Items(keys, report)
        loop = asyncio.get_running_loop()
        for index, key in enumerate(keys):
            entry = self.cache.get(key)
            if entry is not None:
                items.landed(index, entry)
            elif key in self._pending:
                items.theirs[index] = self._pending[key]
            else:
                self._pending[key] = items.waiters[index] = loop.create_future()
                items.mine.append(index)
        self.num_lookups += len(keys)
        self.num_hits += len(items.found)
        self.metrics.cache_hits.inc(len(items.found))
        self.metrics.cache_misses.inc(len(items.mine))
        self.metrics.shared_encodes.inc(len(items.theirs))
        return items

    async def _shared(
        self,
        images: Sequence[bytes],
        videos: Set[int],
        theirs: dict[int, asyncio.Future[ImageEmbedding]],
        salt: str,
    ) -> dict[int, ImageEmbedding]:
        """The items other requests were encoding, once they are; one whose encode
        failed (or whose request left) this request encodes itself."""
        done: dict[int, ImageEmbedding] = {}
        retry = []
        for index, future in theirs.items():
            try:
                done[index] = await asyncio.shield(future)
            except Exception:
                retry.append(index)
        if retry:
            again = await self._encode(
                [images[i] for i in retry],
                {retry.index(i) for i in videos if i in retry},
                None,
                salt,
            )
            done.update((i, e) for i, e in zip(retry, again.images, strict=True) if e is not None)
        return done

    async def _encode_mine(
        self, indices: list[int], pre: list[asyncio.Future[PreprocessedImage]], items: _Items
    ) -> None:
        """Triton for the preprocessed items (`indices`) but those the receiver holds:
        the items it cannot hold at once, meanwhile those it may hold (the route's
        leading ones, `Sink.may_hold`) once it says which it does (`Sink.held`)."""
        may_hold = items.report.may_hold
        asked = [(index, p) for index, p in zip(indices, pre, strict=True) if index < may_hold]
        rest = [(index, p) for index, p in zip(indices, pre, strict=True) if index >= may_hold]
        now = asyncio.ensure_future(self._infer_items(rest, items))
        try:
            if asked:
                held = await items.report.held()
                for index in held & {index for index, _ in asked}:
                    items.held(index)
                todo = [(index, p) for index, p in asked if index not in held]
                await self._infer_items(todo, items)
            await now
        finally:
            if not now.done():
                now.cancel()
                await asyncio.wait([now])

    async def _infer_items(
        self, todo: list[tuple[int, asyncio.Future[PreprocessedImage]]], items: _Items
    ) -> None:
        """These items through Triton once preprocessed: all in one request, or one
        by one in prompt order (a video in parts, each told the sink as it comes);
        each item cached and given to its waiters. The waiters for an item not
        encoded here encode it themselves."""
        if not todo:
            return
        self.metrics.encoded_items.inc(len(todo))
        if not self.one_by_one:
            entries = await self._infer(await asyncio.gather(*(p for _, p in todo)))
            for (index, _), entry in zip(todo, entries, strict=True):
                items.report.landed(index, entry, 0)
                items.encoded(index, entry, self.cache)
            return
        for index, preprocessing in todo:
            item = await preprocessing
            parts: list[ImageEmbedding] = []
            for part in self._parts(item):
                (encoded,) = await self._infer([part])
                items.report.landed(index, encoded, sum(p.num_tokens for p in parts))
                parts.append(encoded)
            whole = parts[0] if len(parts) == 1 else _joined(parts, item.grid)
            items.encoded(index, whole, self.cache)

    @staticmethod
    def _parts(item: PreprocessedImage) -> list[PreprocessedImage]:
        """An image whole; a video in parts of VIDEO_PART temporal patches."""
        grid = item.grid
        if grid.t <= VIDEO_PART:
            return [item]
        rows = VIDEO_PART * grid.h * grid.w
        return [
            PreprocessedImage(
                item.pixel_values[first * grid.h * grid.w : first * grid.h * grid.w + rows],
                replace(
                    grid,
                    t=min(VIDEO_PART, grid.t - first),
                    frame_seconds=grid.frame_seconds[first : first + VIDEO_PART],
                ),
            )
            for first in range(0, grid.t, VIDEO_PART)
        ]

    def _preprocess(
        self, images: Sequence[bytes], videos: Set[int], indices: list[int]
    ) -> list[asyncio.Future[PreprocessedImage]]:
        """Each item's preprocessing, started now in the worker pool: Triton may
        take the first while the next are preprocessed. The span and the metric
        cover them all."""
        if not indices:
            return []
        started = time.perf_counter()
        span = tracing.start("encoder.preprocess", items=len(indices))
        pre = self.preprocessor.start([(i, images[i]) for i in indices], videos)

        def done(all_of_them: asyncio.Future[list[PreprocessedImage | BaseException]]) -> None:
            failed = next((r for r in all_of_them.result() if isinstance(r, BaseException)), None)
            tracing.end(span, failed)
            self.metrics.preprocess_seconds.observe(time.perf_counter() - started)

        asyncio.gather(*pre, return_exceptions=True).add_done_callback(done)
        return pre

    async def _infer(self, pre: Sequence[PreprocessedImage]) -> list[ImageEmbedding]:
        """One Triton request for these preprocessed items: their embeddings, in order."""
        started = time.perf_counter()
        pixels = np.concatenate([p.pixel_values for p in pre])
        with tracing.span("encoder.triton_infer", items=len(pre), patches=len(pixels)):
            out = await self.vit.infer(
                pixels, np.array([[p.grid.t, p.grid.h, p.grid.w] for p in pre], dtype=np.int64)
            )
        self.metrics.triton_seconds.observe(time.perf_counter() - started)
        sizes = [p.grid.num_tokens(self.merge_size) for p in pre]
        per_item = zip(*(torch.split(plane, sizes) for plane in out.planes), strict=True)
        return [
            ImageEmbedding(tuple(t.clone() for t in planes), p.grid)
            for p, planes in zip(pre, per_item, strict=True)
        ]
