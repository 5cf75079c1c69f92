"""The Encoder gRPC servicer: protobuf at the edge, errors as gRPC statuses."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.broker.client import BrokerUnavailableError
from services.encoder.metrics import EncoderMetrics
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
from services.wire.request import EncodeRequest

logger = logging.getLogger(__name__)


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
        peer = await self.sender.peer(target) if target else None
        encoded = await self.pipeline.encode(list(request.images), set(request.video_indices))
        reply = self._reply(request.request_id, encoded)
        if peer is None:
            dtype = self.buffer.pool.layout.dtype
            reply.data.extend(tensor_bytes(plane.to(dtype)) for plane in encoded.planes)
            return reply
        held = await self.buffer.hold(request.request_id, encoded.images, self.buffer_wait_s)
        try:
            done = self.sender.start(peer, self.buffer.meta(held, peer.instance_id, encoded.grids))
        except BaseException:
            self.buffer.release(request.request_id)
            raise
        try:
            await asyncio.shield(done)  # the embeddings have landed
        except asyncio.CancelledError:
            self.sender.abort(request.request_id, "the encode caller went away")
            raise
        return reply

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
