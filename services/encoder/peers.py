"""Peers: the cluster's encoders as one embedding cache.

The broker names, for each item of a request, another encoder that holds it
in its cache or is encoding it (RouteReply.holder_addresses, passed on as
EncodeRequest.peer_addresses). The routed encoder fetches those items from
there (`Encoder.Fetch`) instead of running Triton for them: an embedding is a
memory copy, an encode a few hundred milliseconds of a core. A fetch that
fails (the holder evicted the item, died or stalls past FETCH_TIMEOUT_S) costs
that wait, never the request: the item is encoded after all.

The holder's side is the servicer's `Fetch`: an item from its cache, or from
its encode in progress (`EncodePipeline.cached`), as a FetchReply (`to_reply`);
bit-exact either way.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.encoder.cache import ImageEmbedding
from services.encoder.metrics import EncoderMetrics
from services.proto import encoder_pb2, encoder_pb2_grpc
from services.runtime import tracing
from services.runtime.grpc_server import channel
from services.transfer.embedding_pool import tensor_bytes, tensor_from_bytes
from services.wire.convert import dtype_from_proto, dtype_to_proto, from_proto, to_proto
from services.wire.messages import MediaGrid

logger = logging.getLogger(__name__)

# How long a fetch may take, a wait for the holder's encode in progress
# included: about what encoding the item here would take under load.
FETCH_TIMEOUT_S = 3.0
NOT_FOUND = grpc.StatusCode.NOT_FOUND  # the holder has neither the item nor its encode


def to_reply(entry: ImageEmbedding) -> encoder_pb2.FetchReply:
    dtype = entry.planes[0].dtype
    return encoder_pb2.FetchReply(
        grid=to_proto(entry.grid),
        dtype=dtype_to_proto(dtype),
        widths=[int(p.shape[1]) for p in entry.planes],
        data=[tensor_bytes(p.to(dtype)) for p in entry.planes],
    )


def from_reply(reply: encoder_pb2.FetchReply) -> ImageEmbedding:
    dtype = dtype_from_proto(reply.dtype)
    planes = tuple(
        tensor_from_bytes(data, dtype, width).clone()
        for data, width in zip(reply.data, reply.widths, strict=True)
    )
    if not planes or any(len(p) != len(planes[0]) for p in planes):
        raise ValueError("a fetched embedding's planes differ in length")
    return ImageEmbedding(planes, from_proto(MediaGrid, reply.grid))


class Peers:
    """Fetches items from other encoders, a channel per address."""

    def __init__(self, metrics: EncoderMetrics, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def fetch(self, address: str, key: str) -> ImageEmbedding | None:
        """The item from the encoder at `address`; None (it is then encoded here)
        if that one does not hold it, cannot be reached or does not answer in time."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        started = time.perf_counter()
        with tracing.span("encoder.peer_fetch", peer=address):
            try:
                reply = await encoder_pb2_grpc.EncoderStub(ch).Fetch(
                    encoder_pb2.FetchRequest(key=key), timeout=self.timeout_s
                )
                entry = from_reply(reply)
            except (grpc.aio.AioRpcError, ValueError) as exc:
                missing = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == NOT_FOUND
                self.metrics.peer_fetches.labels("missing" if missing else "failed").inc()
                logger.info("fetching %s from %s: %s; encoding it here", key[:12], address, exc)
                return None
        self.metrics.peer_fetches.labels("fetched").inc()
        self.metrics.peer_fetch_bytes.inc(entry.nbytes)
        self.metrics.peer_fetch_seconds.observe(time.perf_counter() - started)
        return entry

    async def fetch_all(self, wanted: dict[int, tuple[str, str]]) -> dict[int, ImageEmbedding]:
        """Items by index, each (address, key), fetched at once: those that came."""
        entries = await asyncio.gather(*(self.fetch(a, k) for a, k in wanted.values()))
        return {i: e for i, e in zip(wanted, entries, strict=True) if e is not None}

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
