"""The Encoder gRPC servicer: protobuf at the edge, errors as gRPC statuses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from services.broker.client import BrokerUnavailableError
from services.encoder.cache import ImageEmbedding
from services.encoder.metrics import EncoderMetrics
from services.encoder.peers import FETCH_TIMEOUT_S, to_reply
from services.encoder.pipeline import Encoded, EncodePipeline
from services.encoder.send_buffer import SendBuffer, SendBufferFullError
from services.encoder.triton_client import TritonRequestError, TritonUnavailableError
from services.media.decode import BadImageError
from services.proto import encoder_pb2, encoder_pb2_grpc
from services.runtime import tracing
from services.transfer.embedding_pool import tensor_bytes
from services.transfer.sender import Failure
from services.transfer.sender_driver import SenderDriver, TransferError, UnknownPeerError
from services.wire.convert import dtype_to_proto, from_proto, to_proto
from services.wire.messages import EmbeddingMeta, MediaGrid, Register
from services.wire.request import EncodeRequest

logger = logging.getLogger(__name__)

# How long an encode waits for the language instance's preallocation before it
# encodes an item the instance may hold; past it, the item is encoded anyway (it
# is still not sent if the preallocation says the instance holds it).
HELD_WAIT_S = 1.0


class _Sending:
    """An encode's embeddings on their way to a language instance (the pipeline's
    Sink): the send buffer held once every grid is known, each item (a video's
    each part) written into it as it is encoded, the transfer started with the
    first and told how far, from the first token, they are all there (the rest
    may still be in Triton). With `held_items` (the language instance may hold
    the leading items in its prefix cache), the transfer starts as soon as the
    grids are known, and its preallocation says which items not to encode."""

    def __init__(
        self, servicer: EncoderServicer, request_id: str, peer: Register, held_items: int = 0
    ) -> None:
        self.buffer = servicer.buffer
        self.sender = servicer.sender
        self.wait_s = servicer.buffer_wait_s
        self.merge_size = servicer.pipeline.merge_size
        self.request_id = request_id
        self.peer = peer
        self.held_items = held_items
        self.starts: list[int] = []  # each item's first token in the request's
        self.ends: list[int] = []
        self.meta: EmbeddingMeta | None = None
        self.written: dict[int, int] = {}  # runs written past `ready`: first token -> end
        self.ready = 0  # tokens written (or not wanted), from the first
        self.done: asyncio.Future[None] | None = None  # the transfer, once started
        self.preallocated: asyncio.Future[int] | None = None  # the tokens not wanted
        self.announced = asyncio.Event()

    async def grids(self, grids: Sequence[MediaGrid]) -> None:
        sizes = [g.num_tokens(self.merge_size) for g in grids]
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.ends = [start + size for start, size in zip(self.starts, sizes, strict=True)]
        held = await self.buffer.hold(self.request_id, sum(sizes), self.wait_s)
        self.meta = self.buffer.meta(held, self.peer.instance_id, grids)
        if self.held_items:  # announced now: the preallocation says what not to encode
            self._start()
        self.announced.set()

    @property
    def may_hold(self) -> int:
        return self.held_items

    async def held(self) -> frozenset[int]:
        """The items the language instance holds (all their tokens' KV is in its
        prefix cache): what its preallocation says, waited for at most
        HELD_WAIT_S, where the route said it may hold some; they count as
        written, and are neither encoded nor sent."""
        if not self.held_items:
            return frozenset()
        try:
            async with asyncio.timeout(HELD_WAIT_S):
                await self.announced.wait()
                assert self.preallocated is not None
                skip = await asyncio.shield(self.preallocated)
        except (TimeoutError, TransferError):
            return frozenset()  # encoded, then (its transfer may yet skip them)
        held = frozenset(i for i, end in enumerate(self.ends) if end <= skip)
        for index in held:
            self.written[self.starts[index]] = self.ends[index]
        self._advance()
        return held

    def item(self, index: int, embedding: ImageEmbedding, start: int = 0) -> None:
        assert self.meta is not None
        if self.done is not None and self.done.done():  # all it wanted was held
            return
        first = self.starts[index] + start
        self.buffer.write(self.request_id, first, embedding)
        self.written[first] = first + embedding.num_tokens
        self._advance()

    def _advance(self) -> None:
        """`ready` past the runs written from it on; the transfer told."""
        before = self.ready
        while self.ready in self.written:
            self.ready = self.written.pop(self.ready)
        if self.ready == before:
            return
        if self.done is None:
            self._start()
        else:
            self.sender.ready(self.request_id, self.ready)

    def _start(self) -> None:
        assert self.meta is not None
        self.done = self.sender.start(self.peer, self.meta, self.ready)
        self.preallocated = self.sender.preallocated(self.request_id)

    def give_up(self, reason: str) -> None:
        """The encode failed: a transfer that landed nothing lets go quietly (the
        request may move to another encoder), else it is aborted."""
        if self.done is not None:
            self.sender.withdraw(self.request_id, reason)
        else:
            self.buffer.release(self.request_id)


class EncoderBusyError(RuntimeError):
    """More encodes are pending than the encoder admits."""


_STATUS = (
    (BadImageError, grpc.StatusCode.INVALID_ARGUMENT),
    (TritonUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (BrokerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (UnknownPeerError, grpc.StatusCode.NOT_FOUND),
    (SendBufferFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EncoderBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TritonRequestError, grpc.StatusCode.INTERNAL),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


# A failed transfer: only UNAVAILABLE is worth retrying on another encoder: this
# encoder cannot finish it, or its write to the language instance failed (the
# peer or the path to it: a cut link times the connection out), which another
# encoder's path may not share. The others say where the request ended.
_TRANSFER_STATUS = {
    Failure.ABORTED: grpc.StatusCode.ABORTED,
    Failure.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.WRITE_FAILED: grpc.StatusCode.UNAVAILABLE,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def _status_for(exc: Exception) -> grpc.StatusCode | None:
    if isinstance(exc, TransferError):
        return _TRANSFER_STATUS[exc.failure]
    return next((code for kind, code in _STATUS if isinstance(exc, kind)), None)


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self,
        pipeline: EncodePipeline,
        buffer: SendBuffer,
        sender: SenderDriver,
        metrics: EncoderMetrics,
        buffer_wait_s: float = 5.0,
        max_pending: int = 64,
    ) -> None:
        self.pipeline = pipeline
        self.buffer = buffer
        self.sender = sender
        self.metrics = metrics
        self.buffer_wait_s = buffer_wait_s
        self.max_pending = max_pending
        self.pending = 0

    async def Encode(
        self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.EncodeReply:
        self.metrics.in_flight.inc()
        self.pending += 1
        try:
            if self.pending > self.max_pending:
                raise EncoderBusyError(
                    f"this encoder has {self.max_pending} encodes pending, its limit; retry later"
                )
            metadata = context.invocation_metadata()
            with tracing.serving(
                "encoder.encode", metadata, request.request_id, items=len(request.images)
            ) as span:
                reply = await self._encode(request)
                span.set_attributes(
                    {"epd.tokens": reply.total_tokens, "epd.cached": reply.cached_images}
                )
        except Exception as exc:
            code = _status_for(exc)
            if code is None:
                raise
            self.metrics.requests.labels(code.name.lower()).inc()
            logger.warning("%s: encode failed (%s): %s", request.request_id, code.name, exc)
            await context.abort(code, str(exc))
        finally:
            self.pending -= 1
            self.metrics.in_flight.dec()
        self.metrics.requests.labels("ok").inc()
        return reply

    async def _encode(self, pb: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeReply:
        request = from_proto(EncodeRequest, pb)
        target = request.language_instance_id
        if target and not request.request_id:
            raise ValueError("request_id is required to send embeddings to a language instance")
        images, videos = list(request.images), set(request.video_indices)
        if not target:
            encoded = await self.pipeline.encode(
                images, videos, salt=request.cache_salt, peers=request.peer_addresses
            )
            reply = self._reply(request.request_id, encoded)
            dtype = self.buffer.pool.layout.dtype
            reply.data.extend(tensor_bytes(plane.to(dtype)) for plane in encoded.planes)
            return reply
        peer = await self.sender.peer(target)
        sending = _Sending(self, request.request_id, peer, request.held_items)
        try:
            encoded = await self.pipeline.encode(
                images, videos, sending, request.cache_salt, request.peer_addresses
            )
        except BaseException as exc:
            sending.give_up(f"the encode failed: {exc}")
            raise
        assert sending.done is not None  # every item is ready: the transfer started
        try:
            await asyncio.shield(sending.done)  # the embeddings have landed
        except asyncio.CancelledError:
            self.sender.abort(request.request_id, "the encode caller went away")
            raise
        return self._reply(request.request_id, encoded)

    async def Fetch(
        self, request: encoder_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> encoder_pb2.FetchReply:
        """An item for a peer encoder (peers.py): cached, or encoded here now."""
        entry = await self.pipeline.cached(request.key, FETCH_TIMEOUT_S)
        if entry is None:
            self.metrics.peer_served.labels("missing").inc()
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"item {request.key!r} is neither in this encoder's cache nor being encoded here",
            )
        self.metrics.peer_served.labels("sent").inc()
        return to_reply(entry)

    def _reply(self, request_id: str, encoded: Encoded) -> encoder_pb2.EncodeReply:
        layout = self.buffer.pool.layout
        return encoder_pb2.EncodeReply(
            request_id=request_id,
            total_tokens=encoded.num_tokens,
            grids=[to_proto(g) for g in encoded.grids],
            dtype=dtype_to_proto(layout.dtype),
            cached_images=encoded.num_cached,
            planes=[to_proto(p) for p in layout.planes],
        )
