"""A conversation moves with its KV: a language instance fetches the KV pages of
a chat's prefix from the instance that holds them instead of computing them.

The broker routes a chat's turns to the instance it sent the chat's prefix to
before, within a load bound. When that one is past the bound the turn goes to
another, and the route names the holder (RouteReply.prefix_holder_address,
passed on as GenerateRequest.prefix_holder). The new instance asks the holder
for the pages of its prompt by their digests (`Language.FetchPrefix`): a
digest is a content address, the same on every instance of the checkpoint
with the same page size and dtype. It adopts them into its prefix cache, and
the request starts its prefill after them as if they had been computed here.

It moves them only where that is the cheaper (`MoveCost`): computing the pages
at the engine's measured prefill rate, against a fetch (a round trip, and the
bytes at the measured fetch rate). A fetch that fails (the holder evicted the
pages, died, or does not answer within FETCH_TIMEOUT_S) costs that wait, never
the request: the pages are computed here.

The holder's side is the servicer's FetchPrefix: the pages are copied out of
its engine's cache while the engine steps (Engine.export_prefix), and
`to_reply` sends them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from services.language.engine.kv_cache import PrefixPages
from services.language.engine.outputs import StepStats
from services.language.metrics import LanguageMetrics
from services.proto import language_pb2, language_pb2_grpc
from services.runtime import tracing
from services.runtime.grpc_server import MAX_MESSAGE_BYTES, channel
from services.transfer.embedding_pool import tensor_bytes, tensor_from_bytes
from services.wire.convert import dtype_from_proto, dtype_to_proto

logger = logging.getLogger(__name__)

# How long a fetch may take: the holder is a busy instance (that is why the
# turn moved), its cores shared with its engine's steps.
FETCH_TIMEOUT_S = 2.0
# A fetch's cost before any is measured, and a prefill token's before a step is
# (bench/transfer.py's prefix fetch lines: the small demo in bfloat16 on an idle
# 2-core AVX512-BF16 host, loopback gRPC: 4.7 ms for one page, 47 ms for 64;
# their prefill 2.5 ms a page): a crossover of 3 pages, as measured there.
FETCH_LATENCY_S = 0.004
FETCH_SECONDS_PER_BYTE = 1 / 0.2e9
PREFILL_SECONDS_PER_TOKEN = 1.5e-4
SMOOTHING = 0.2  # the weight of each new measurement


def to_reply(pages: PrefixPages) -> language_pb2.FetchPrefixReply:
    if not pages.num_pages:
        return language_pb2.FetchPrefixReply(page_size=pages.page_size)
    return language_pb2.FetchPrefixReply(
        num_pages=pages.num_pages,
        page_size=pages.page_size,
        dtype=dtype_to_proto(pages.planes[0].dtype),
        widths=[int(p.shape[1]) for p in pages.planes],
        data=[tensor_bytes(p) for p in pages.planes],
    )


@dataclass(frozen=True, slots=True)
class PageShape:
    """This instance's KV pages: what pages it adopts must match."""

    page_size: int
    dtype: torch.dtype
    widths: tuple[int, ...]  # per plane: k0, v0, k1, ...


def from_reply(
    reply: language_pb2.FetchPrefixReply, digests: Sequence[bytes], shape: PageShape
) -> PrefixPages:
    """The reply's pages, checked against what this instance's cache can adopt:
    ValueError where the holder's pages differ in size, dtype or planes."""
    page_size = shape.page_size
    if reply.page_size != page_size:
        raise ValueError(f"the holder's pages hold {reply.page_size} tokens, ours {page_size}")
    if reply.num_pages > len(digests):
        raise ValueError(f"{reply.num_pages} pages for {len(digests)} digests")
    if not reply.num_pages:
        return PrefixPages((), page_size)
    dtype = dtype_from_proto(reply.dtype)
    if dtype != shape.dtype or tuple(reply.widths) != shape.widths:
        raise ValueError(
            f"the holder's pages are {dtype} in planes {list(reply.widths)}, "
            f"ours {shape.dtype} in {list(shape.widths)}"
        )
    planes = tuple(  # views of the reply's bytes: read once, as the engine adopts them
        tensor_from_bytes(data, dtype, width)
        for data, width in zip(reply.data, reply.widths, strict=True)
    )
    rows = reply.num_pages * page_size
    if any(len(p) != rows for p in planes):
        raise ValueError(f"a plane of the holder's pages is not {rows} rows")
    return PrefixPages(tuple(digests[: reply.num_pages]), page_size, planes)


@dataclass(slots=True)
class MoveCost:
    """Whether moving a prefix's pages beats computing them, from what this
    instance measures: its prefill steps' seconds per prompt token, and its
    fetches' seconds per byte (a round trip of FETCH_LATENCY_S apart)."""

    page_size: int
    page_bytes: int  # every layer's keys and values of one page
    prefill_s_per_token: float = PREFILL_SECONDS_PER_TOKEN
    fetch_s_per_byte: float = FETCH_SECONDS_PER_BYTE
    fetch_latency_s: float = FETCH_LATENCY_S

    def min_pages(self) -> int:
        """The fewest pages worth a fetch (the crossover); a huge number where
        computing a page is never dearer than fetching it."""
        saved = self.page_size * self.prefill_s_per_token - self.page_bytes * self.fetch_s_per_byte
        if saved <= 0:
            return 2**31
        return max(1, math.floor(self.fetch_latency_s / saved) + 1)

    def max_pages(self) -> int:
        """The most pages one fetch brings: half what a gRPC message may hold."""
        return max(1, MAX_MESSAGE_BYTES // 2 // self.page_bytes)

    def on_step(self, stats: StepStats, seconds: float) -> None:
        """A prefill step of at least a page of prompt tokens updates the rate."""
        prompt = stats.num_tokens - stats.num_generated
        if prompt >= self.page_size:
            rate = seconds / prompt
            self.prefill_s_per_token += SMOOTHING * (rate - self.prefill_s_per_token)

    def on_fetch(self, num_bytes: int, seconds: float) -> None:
        if num_bytes and seconds > self.fetch_latency_s:
            rate = (seconds - self.fetch_latency_s) / num_bytes
            self.fetch_s_per_byte += SMOOTHING * (rate - self.fetch_s_per_byte)


class PrefixPeers:
    """Fetches prefix pages from other language instances, a channel per address."""

    def __init__(
        self,
        shape: PageShape,
        cost: MoveCost,
        metrics: LanguageMetrics,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.shape = shape
        self.cost = cost
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.in_flight = 0  # fetches waiting for their holder

    async def fetch(self, address: str, digests: Sequence[bytes]) -> PrefixPages | None:
        """The cached pages the digests begin with, from the instance at `address`;
        None (they are then computed here) where too few for a fetch to pay, or
        where that instance does not hold them, cannot be reached or does not
        answer in time. At most what one gRPC message holds (the leading pages:
        the rest are computed here)."""
        digests = digests[: self.cost.max_pages()]
        min_pages = self.cost.min_pages()
        self.metrics.prefix_move_min_pages.set(min_pages)
        self.metrics.prefill_token_seconds.set(self.cost.prefill_s_per_token)
        if len(digests) < min_pages:
            self.metrics.prefix_fetches.labels("skipped").inc()
            return None
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        started = time.perf_counter()
        self.in_flight += 1
        with tracing.span("language.prefix_fetch", peer=address, pages=len(digests)) as span:
            try:
                reply = await language_pb2_grpc.LanguageStub(ch).FetchPrefix(
                    language_pb2.FetchPrefixRequest(digests=list(digests), min_pages=min_pages),
                    timeout=self.timeout_s,
                )
                pages = from_reply(reply, digests, self.shape)
            except (grpc.aio.AioRpcError, ValueError) as exc:
                self.metrics.prefix_fetches.labels("failed").inc()
                logger.info("fetching prefix pages from %s: %s; computing them here", address, exc)
                return None
            finally:
                self.in_flight -= 1
            span.set_attribute("epd.fetched_pages", pages.num_pages)
        seconds = time.perf_counter() - started
        if not pages.num_pages:
            self.metrics.prefix_fetches.labels("missing").inc()
            return None
        self.cost.on_fetch(pages.nbytes, seconds)
        self.metrics.prefix_fetched(pages.num_pages, pages.nbytes, seconds)
        return pages

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
