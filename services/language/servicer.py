"""The Language gRPC servicer: protobuf at the edge, errors as gRPC statuses.

Generate converts its request to the wire dataclasses and runs it through the
frontend (services/language/frontend.py); in E/P/D a prefill instance serves
Prefill and a decode instance Generate with the prefill instance named.
GenerateStream runs many Generate calls on one stream (the gateway's), each
as its own call would run, their responses batched as they come ready.
PushEmbeddings is the gRPC data plane (embeddings, or a decode instance's KV
pages); FetchPrefix sends a chat's KV pages to another instance; Abort ends a
request wherever it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc

from services.language.engine.outputs import EngineLostError, RequestFailedError
from services.language.frontend import Frontend, MediaMismatchError
from services.language.metrics import LanguageMetrics
from services.language.prefix_moves import FETCH_TIMEOUT_S, to_reply
from services.proto import language_pb2, language_pb2_grpc
from services.runtime import tracing
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.sender import Failure
from services.transfer.sender_driver import TransferError, UnknownPeerError
from services.transfer.state import PoolExhaustedError, TransferFailedError
from services.transfer.transports.grpc_stream import Chunk, decoded_chunk
from services.wire.convert import from_proto, to_proto
from services.wire.messages import LanguageRole, kv_transfer_id
from services.wire.request import GenerateComplete, GenerateRequest

logger = logging.getLogger(__name__)

# What ends a Generate or Prefill early, and its status and message prefix
# ("{what}": what the instance receives, image embeddings or KV pages): first match.
_STATUS = (
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED, "{what}: "),
    (TransferFailedError, grpc.StatusCode.UNAVAILABLE, "{what}: "),
    (UnknownPeerError, grpc.StatusCode.UNAVAILABLE, "KV pages: "),
    (TransferError, grpc.StatusCode.UNAVAILABLE, "KV pages: "),
    (MediaMismatchError, grpc.StatusCode.FAILED_PRECONDITION, ""),
    (EngineLostError, grpc.StatusCode.UNAVAILABLE, "generation failed: "),
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
        role: LanguageRole = LanguageRole.BOTH,
    ) -> None:
        self.frontend = frontend
        self.role = role
        self.engine = frontend.engine
        self.receiver = receiver
        self.metrics = metrics
        self.max_active_requests = max_active_requests
        # Every request between Generate's start and its end, receiving or generating:
        # a second Generate under a live id is refused without touching the first.
        self._active: set[str] = set()
        self._streams: set[_GenerateStream] = set()
        self.draining = False  # stopping: streams take no new request, end once idle

    def drain(self) -> None:
        """The instance stops: a stream refuses new requests (UNAVAILABLE, as a
        stopping server refuses calls) and ends once its requests have."""
        self.draining = True
        for stream in self._streams:
            stream.outbox.wake()

    async def Generate(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[language_pb2.GenerateResponse]:
        await self._admit(request, context)
        if self.role is LanguageRole.PREFILL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this is a prefill instance: call Prefill, naming the decode instance",
            )
        decoding = bool(request.prefill_instance_id)
        if decoding != (self.role is LanguageRole.DECODE):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a decode instance takes a request from the prefill instance it names "
                "(prefill_instance_id); another instance takes none",
            )
        async with self._serving("decode" if decoding else "generate", request, context):
            typed = from_proto(GenerateRequest, request)
            stream = self.frontend.decode(typed) if decoding else self.frontend.generate(typed)
            async for response in stream:
                if isinstance(response.kind, GenerateComplete):
                    self.metrics.requests.labels(response.kind.finish_reason).inc()
                yield to_proto(response)

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[language_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[language_pb2.GenerateStreamResponse]:
        stream = _GenerateStream(self, request_iterator)
        self._streams.add(stream)
        try:
            while batch := await stream.outbox.take(stream.done):
                yield batch
        finally:
            self._streams.discard(stream)
            await stream.close()

    async def Prefill(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> language_pb2.PrefillReply:
        await self._admit(request, context)
        if self.role is not LanguageRole.PREFILL or not request.decode_instance_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "Prefill is a prefill instance's, for a request naming its decode instance "
                f"(decode_instance_id); this is a {self.role.name.lower()} instance",
            )
        async with self._serving("prefill", request, context):
            reply = await self.frontend.prefill(from_proto(GenerateRequest, request))
        return to_proto(reply)

    @contextlib.asynccontextmanager
    async def _serving(
        self, call: str, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        """An admitted request while `call` serves it: active (its id taken), traced
        (span language.CALL), and what fails it aborted with its status."""
        request_id = request.request_id
        self._active.add(request_id)
        metadata = context.invocation_metadata()
        role = self.role.name.lower()
        with tracing.serving(f"language.{call}", metadata, request_id, role=role):
            try:
                yield
            except Exception as exc:
                await self._fail(exc, request_id, call, context)
                raise
            finally:
                self._active.discard(request_id)

    async def _admit(
        self, request: language_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Aborts the call unless the request has an id of its own and there is room."""
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

    async def _fail(
        self, exc: Exception, request_id: str, call: str, context: grpc.aio.ServicerContext
    ) -> None:
        """Aborts the call with the status of what ended it, if it is one of ours."""
        what = "KV pages" if self.role is LanguageRole.DECODE else "image embeddings"
        for kind, code, prefix in _STATUS:
            if isinstance(exc, kind):
                if isinstance(exc, TransferError) and exc.failure is Failure.ABORTED:
                    code = grpc.StatusCode.ABORTED  # the decode instance gave up: it says why
                if isinstance(exc, PoolExhaustedError) and self.role is LanguageRole.DECODE:
                    code = grpc.StatusCode.UNAVAILABLE  # another decode instance may have room
                if kind is RequestFailedError:
                    self.metrics.requests.labels("error").inc()
                message = f"{prefix.format(what=what)}{exc}"
                logger.warning("%s: %s failed (%s): %s", request_id, call, code.name, message)
                await context.abort(code, message)

    async def PushEmbeddings(
        self,
        request_iterator: AsyncIterator[Chunk],
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

    async def FetchPrefix(
        self, request: language_pb2.FetchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> language_pb2.FetchPrefixReply:
        """A chat's KV pages for another instance (prefix_moves.py): those cached
        here that the digests begin with, none if fewer than min_pages."""
        digests = list(request.digests)
        try:
            pages = await self.engine.export_prefix(digests, request.min_pages, FETCH_TIMEOUT_S)
        except (TimeoutError, EngineLostError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer: {exc}")
        self.metrics.prefix_served.labels("sent" if pages.num_pages else "missing").inc()
        self.metrics.prefix_served_pages.inc(pages.num_pages)
        return to_reply(pages)

    async def Abort(
        self, request: language_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> language_pb2.AbortReply:
        reason = request.reason or "aborted by the caller"
        request_id = request.request_id
        transfers = (request_id, kv_transfer_id(request_id))  # a decode instance's: the KV
        receiving = any(t in self.receiver.transfers for t in transfers)
        for transfer in transfers:
            self.receiver.release(transfer, reason)
        generating = self.engine.has_request(request_id)
        self.engine.abort(request_id)
        return language_pb2.AbortReply(found=receiving or generating)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _CallContext:
    """What Generate uses of its call's context, for a call on a stream: its
    metadata, and an abort that ends the call with a status."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class _Outbox:
    """The responses and ends of a stream's calls, taken all at once: the
    outputs of an engine step reach every call's task before the writer's."""

    def __init__(self) -> None:
        self.responses: list[language_pb2.GenerateResponse] = []
        self.ends: list[language_pb2.GenerateEnd] = []
        self._ready = asyncio.Event()

    def put(self, response: language_pb2.GenerateResponse) -> None:
        self.responses.append(response)
        self._ready.set()

    def end(self, request_id: str, code: grpc.StatusCode, message: str = "") -> None:
        self.ends.append(
            language_pb2.GenerateEnd(request_id=request_id, code=code.value[0], message=message)
        )
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    async def take(self, done: Callable[[], bool]) -> language_pb2.GenerateStreamResponse | None:
        """What is ready (waiting for something), or None once `done()`."""
        while not (self.responses or self.ends):
            if done():
                return None
            await self._ready.wait()
            self._ready.clear()
        batch = language_pb2.GenerateStreamResponse(responses=self.responses, ends=self.ends)
        self.responses, self.ends = [], []
        return batch


class _GenerateStream:
    """One GenerateStream: a task per request, running Generate as its own call would."""

    def __init__(
        self,
        servicer: LanguageServicer,
        requests: AsyncIterator[language_pb2.GenerateStreamRequest],
    ) -> None:
        self.servicer = servicer
        self.outbox = _Outbox()
        self.calls: dict[str, asyncio.Task[None]] = {}
        self.reading = asyncio.ensure_future(self._read(requests))

    def done(self) -> bool:
        """Nothing runs, and nothing more will come (the caller closed its side,
        or the instance drains)."""
        return not self.calls and (self.reading.done() or self.servicer.draining)

    async def _read(self, requests: AsyncIterator[language_pb2.GenerateStreamRequest]) -> None:
        try:
            async for message in requests:
                if message.HasField("start"):
                    self._start(message.start)
                elif (call := self.calls.get(message.cancel)) is not None:
                    call.cancel()
        finally:
            self.outbox.wake()

    def _start(self, start: language_pb2.GenerateStart) -> None:
        request_id = start.request.request_id
        if self.servicer.draining:
            message = "this language instance is shutting down"
            self.outbox.end(request_id, grpc.StatusCode.UNAVAILABLE, message)
        elif request_id in self.calls:
            message = f"request id {request_id!r} is already in flight on this stream"
            self.outbox.end(request_id, grpc.StatusCode.ALREADY_EXISTS, message)
        else:
            call = asyncio.ensure_future(self._run(start))
            self.calls[request_id] = call
            call.add_done_callback(lambda _: self._ended(request_id, call))

    def _ended(self, request_id: str, call: asyncio.Task[None]) -> None:
        if self.calls.get(request_id) is call:
            del self.calls[request_id]
        self.outbox.wake()

    async def _run(self, start: language_pb2.GenerateStart) -> None:
        request_id = start.request.request_id
        context = _CallContext(sorted(start.metadata.items()))
        try:
            async for response in self.servicer.Generate(start.request, context):  # type: ignore[arg-type]
                self.outbox.put(response)
        except _Aborted as exc:
            self.outbox.end(request_id, exc.code, exc.details)
        except Exception as exc:  # what a call's handler would end with: UNKNOWN
            logger.exception("%s: Generate failed", request_id)
            self.outbox.end(request_id, grpc.StatusCode.UNKNOWN, f"Unexpected {exc!r}")
        else:
            self.outbox.end(request_id, grpc.StatusCode.OK)

    async def close(self) -> None:
        """The stream ended (or the caller left): its calls end as cancelled calls do."""
        self.reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reading  # a caller that left fails its request iterator
        calls = list(self.calls.values())
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


class _Generated:
    """Takes the method handlers the generated registration hands a server."""

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_to_server(servicer: LanguageServicer, server: grpc.aio.Server) -> None:
    """Language's methods as generated, except that PushEmbeddings parses its
    chunks with `decoded_chunk` (the planes stay views of the bytes received)."""
    generated = _Generated()
    language_pb2_grpc.add_LanguageServicer_to_server(servicer, generated)
    handlers = generated.handlers
    push = handlers["PushEmbeddings"]
    handlers["PushEmbeddings"] = push._replace(request_deserializer=decoded_chunk)
    service = generated.service
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
