"""The gateway's Generate calls to a language instance, many on one stream
(Language.GenerateStream): a decode step's tokens of every request arrive in one
message instead of one gRPC message per token and request.

A StreamedCall behaves as the grpc.aio call of Language.Generate would for its
consumer (Backend._attempt), in the wire types: it iterates the request's
GenerateResponses, ends with the status its call would end with (grpc.aio.AioRpcError:
the instance's, or UNAVAILABLE for every call on a stream that broke, or
DEADLINE_EXCEEDED at its timeout), and `cancel()` ends it on both sides (the
iterating task gets asyncio.CancelledError, as from a cancelled call).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from services.proto import language_pb2, language_pb2_grpc
from services.runtime import tracing
from services.wire.convert import from_proto, to_proto
from services.wire.request import GenerateRequest, GenerateResponse

logger = logging.getLogger(__name__)

# What a call's queue holds: its responses, then its end (an error, or None: cancelled)
_Item = GenerateResponse | language_pb2.GenerateEnd | grpc.aio.AioRpcError | None


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamedCall:
    """One request's Generate call on a GenerateStream."""

    def __init__(self, stream: _Stream, request_id: str, timeout_s: float) -> None:
        self.stream = stream
        self.request_id = request_id
        self.items: asyncio.Queue[_Item] = asyncio.Queue()
        self.ended = False
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def __aiter__(self) -> AsyncIterator[GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[GenerateResponse]:
        over = False  # the call's end came (or it was stopped): nothing to tell the instance
        try:
            while True:
                item = await self.items.get()
                if isinstance(item, GenerateResponse):
                    yield item
                    continue
                over = True
                if isinstance(item, language_pb2.GenerateEnd):
                    if item.code:
                        code = _STATUS_BY_VALUE.get(item.code, grpc.StatusCode.UNKNOWN)
                        raise _error(code, item.message)
                    return
                if item is None:
                    raise asyncio.CancelledError
                raise item
        finally:
            if over:
                self._end()
            else:  # its consumer left (it was cancelled): the instance cancels the request
                self._stop(None)

    def take(self, response: Message) -> None:
        try:
            self.items.put_nowait(from_proto(GenerateResponse, response))
        except ValueError as exc:  # this request's, not the stream's: it alone ends
            self._stop(_error(grpc.StatusCode.INTERNAL, f"a response that is not valid: {exc}"))

    def cancel(self) -> None:
        """Ends the call: the instance cancels the request, the iteration ends."""
        self._stop(None)

    def _expire(self) -> None:
        self._stop(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _stop(self, item: _Item) -> None:
        if not self.ended:
            self.stream.send(language_pb2.GenerateStreamRequest(cancel=self.request_id))
            self.items.put_nowait(item)
            self._end()

    def _end(self) -> None:
        self.ended = True
        self._timer.cancel()
        self.stream.forget(self)


_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


class _Stream:
    """One GenerateStream to a language instance, and the calls on it."""

    def __init__(self, stub: language_pb2_grpc.LanguageStub) -> None:
        self.calls: dict[str, StreamedCall] = {}
        self._outgoing: asyncio.Queue[language_pb2.GenerateStreamRequest] = asyncio.Queue()
        self._rpc = stub.GenerateStream()
        self.closed = False
        self._writing = asyncio.ensure_future(self._write())
        self._reading = asyncio.ensure_future(self._read())

    async def _write(self) -> None:
        """Until the stream ends (its reader says how)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while True:
                await self._rpc.write(await self._outgoing.get())

    def send(self, message: language_pb2.GenerateStreamRequest) -> None:
        if not self.closed:
            self._outgoing.put_nowait(message)

    def start(self, request: GenerateRequest, timeout_s: float) -> StreamedCall:
        """The request's call; it carries the current span's context (traceparent)."""
        call = StreamedCall(self, request.request_id, timeout_s)
        if request.request_id in self.calls:  # the one in flight keeps its responses
            message = f"request id {request.request_id!r} is already in flight on this stream"
            call.items.put_nowait(_error(grpc.StatusCode.ALREADY_EXISTS, message))
            call._end()
            return call
        self.calls[request.request_id] = call
        start = language_pb2.GenerateStart(request=to_proto(request), metadata=tracing.outgoing())
        self.send(language_pb2.GenerateStreamRequest(start=start))
        return call

    def forget(self, call: StreamedCall) -> None:
        if self.calls.get(call.request_id) is call:
            del self.calls[call.request_id]

    async def _read(self) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "the language instance ended the stream")
        try:
            async for batch in self._rpc:
                for response in batch.responses:
                    if (call := self.calls.get(response.request_id)) is not None:
                        call.take(response)
                for end in batch.ends:
                    if (call := self.calls.pop(end.request_id, None)) is not None:
                        call.items.put_nowait(end)
        except grpc.aio.AioRpcError as exc:
            # The instance ends a request with its GenerateEnd, never with the stream's
            # status: a stream that breaks is the instance or the connection gone,
            # whatever its code (gRPC's client can report INTERNAL "Internal error from
            # Core" for a stream the instance ended, racing a write of ours).
            details = f"the stream to the language instance broke: {exc.details()}"
            error = _error(grpc.StatusCode.UNAVAILABLE, details)
            logger.warning(
                "Generate stream to a language instance broke (%s): %s",
                exc.code().name,
                exc.details(),
            )
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway is closing")
        finally:
            self.closed = True
            self._writing.cancel()
            for call in self.calls.values():
                call.items.put_nowait(error)
            self.calls.clear()

    async def close(self) -> None:
        self._rpc.cancel()
        for task in (self._reading, self._writing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class GenerateStreams:
    """A GenerateStream per language instance (by address), opened on first use
    and again after it ends (the instance restarted or stopped)."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def call(
        self, address: str, channel: grpc.aio.Channel, request: GenerateRequest, timeout_s: float
    ) -> StreamedCall:
        stream = self._streams.get(address)
        if stream is None or stream.closed:
            stream = self._streams[address] = _Stream(language_pb2_grpc.LanguageStub(channel))
        return stream.start(request, timeout_s)

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            await stream.close()
        self._streams.clear()
