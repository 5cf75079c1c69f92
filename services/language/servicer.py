"""The Language gRPC servicer: protobuf at the edge, errors as gRPC statuses.

Generate converts its request to the wire dataclasses and runs it through the
frontend (services/language/frontend.py); PushEmbeddings is the gRPC data
plane; Abort ends a request wherever it is.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from services.language.engine.engine import RequestFailedError
from services.language.frontend import Frontend, MediaMismatchError
from services.language.metrics import LanguageMetrics
from services.proto import language_pb2, language_pb2_grpc
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.state import PoolExhaustedError, TransferFailedError
from services.wire.convert import from_proto, to_proto
from services.wire.request import GenerateComplete, GenerateRequest

logger = logging.getLogger(__name__)

# What ends a Generate early, and its status and message prefix: first match.
_STATUS = (
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED, "image embeddings: "),
    (TransferFailedError, grpc.StatusCode.UNAVAILABLE, "image embeddings: "),
    (MediaMismatchError, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (RequestFailedError, grpc.StatusCode.INTERNAL, "generation failed: "),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, ""),
)


class LanguageServicer(language_pb2_grpc.LanguageServicer):
    def __init__(
        self,
        frontend: Frontend,
        receiver: ReceiverDriver,
        metrics: LanguageMetrics,
        max_active_requests: int = 256,
    ) -> None:
        self.frontend = frontend
        self.engine = frontend.engine
        self.receiver = receiver
        self.metrics = metrics
        self.max_active_requests = max_active_requests
        # Every request between Generate's start and its end, receiving or generating:
        # a second Generate under a live id is refused without touching the first.
        self._active: set[str] = set()

    async def Generate(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[language_pb2.GenerateResponse]:
        request_id = request.request_id
        if not request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request_id in self._active:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {request_id!r} is already in flight on this instance",
            )
        if len(self._active) >= self.max_active_requests:
            self.metrics.requests.labels("rejected").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this language instance has {len(self._active)} requests in flight, "
                "its limit; retry later",
            )
        self._active.add(request_id)
        try:
            typed = from_proto(GenerateRequest, request)
            async for response in self.frontend.generate(typed):
                if isinstance(response.kind, GenerateComplete):
                    self.metrics.requests.labels(response.kind.finish_reason).inc()
                yield to_proto(response)
        except Exception as exc:
            for kind, code, prefix in _STATUS:
                if isinstance(exc, kind):
                    if kind is RequestFailedError:
                        self.metrics.requests.labels("error").inc()
                    logger.warning(
                        "%s: generate failed (%s): %s%s", request_id, code.name, prefix, exc
                    )
                    await context.abort(code, f"{prefix}{exc}")
            raise
        finally:
            self._active.discard(request_id)

    async def PushEmbeddings(
        self,
        request_iterator: AsyncIterator[language_pb2.EmbeddingChunk],
        context: grpc.aio.ServicerContext,
    ) -> language_pb2.PushEmbeddingsReply:
        received = 0
        async for chunk in request_iterator:
            try:
                self.receiver.write_chunk(
                    chunk.request_id,
                    chunk.start_token,
                    chunk.num_tokens,
                    chunk.planes,
                    chunk.encoder_instance_id,
                )
            except TransferFailedError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            received += chunk.num_tokens
        return language_pb2.PushEmbeddingsReply(received_tokens=received)

    async def Abort(
        self, request: language_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> language_pb2.AbortReply:
        reason = request.reason or "aborted by the caller"
        receiving = request.request_id in self.receiver.transfers
        self.receiver.release(request.request_id, reason)
        generating = self.engine.has_request(request.request_id)
        self.engine.abort(request.request_id)
        return language_pb2.AbortReply(found=receiving or generating)
