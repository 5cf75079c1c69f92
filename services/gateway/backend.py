"""Backend: the gateway's gRPC side. Routes a request, then runs
Encoder.Encode and Language.Generate concurrently; a failed encode cancels the
generation, and whatever ends a request early aborts it downstream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.gateway.errors import ApiError, from_grpc
from services.grpc_server import channel
from services.proto import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)

logger = logging.getLogger(__name__)


class GenerationBackend(Protocol):
    """What the gateway needs from what serves it: the disaggregated stack over
    gRPC (Backend), or everything in-process (LocalBackend, the baseline)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def models(self) -> list[str]: ...

    def generate(self, call: GenerateCall) -> AsyncIterator[language_pb2.GenerateResponse]: ...


@dataclass(frozen=True, slots=True)
class GenerateCall:
    request_id: str
    model: str
    messages: list[language_pb2.ChatMessage]
    images: list[bytes]
    sampling: common_pb2.SamplingParams


def _cancel_on_failure(
    encode: asyncio.Task[encoder_pb2.EncodeReply], stream: grpc.aio.Call
) -> None:
    """An encoder error ends the stream at once instead of leaving the language
    instance waiting for embeddings that will never come."""
    if not encode.cancelled() and encode.exception() is not None:
        stream.cancel()


class Backend:
    def __init__(
        self, broker: str, encode_timeout_s: float = 120.0, generate_timeout_s: float = 900.0
    ) -> None:
        self.broker_address = broker
        self.encode_timeout_s = encode_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        """Nothing to start: channels open on first use."""

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def models(self) -> list[str]:
        stub = broker_pb2_grpc.BrokerStub(self._channel(self.broker_address))
        try:
            reply = await stub.ListInstances(
                broker_pb2.ListInstancesRequest(role=common_pb2.ROLE_LANGUAGE), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, "broker") from None
        return sorted({i.registration.model for i in reply.instances})

    async def generate(self, call: GenerateCall) -> AsyncIterator[language_pb2.GenerateResponse]:
        """The language instance's stream; ApiError for anything that fails."""
        stub = broker_pb2_grpc.BrokerStub(self._channel(self.broker_address))
        try:
            route = await stub.Route(
                broker_pb2.RouteRequest(
                    request_id=call.request_id, model=call.model, needs_encoder=bool(call.images)
                ),
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, "routing") from None
        language = language_pb2_grpc.LanguageStub(self._channel(route.language_address))
        stream = language.Generate(
            language_pb2.GenerateRequest(
                request_id=call.request_id, messages=call.messages, sampling=call.sampling
            ),
            timeout=self.generate_timeout_s,
        )
        encode: asyncio.Task[encoder_pb2.EncodeReply] | None = None
        if call.images:
            encoder = encoder_pb2_grpc.EncoderStub(self._channel(route.encoder_address))
            encode = asyncio.ensure_future(
                encoder.Encode(
                    encoder_pb2.EncodeRequest(
                        request_id=call.request_id,
                        images=call.images,
                        language_instance_id=route.language_id,
                    ),
                    timeout=self.encode_timeout_s,
                )
            )
            encode.add_done_callback(lambda task: _cancel_on_failure(task, stream))
        finished = False
        try:
            async for response in stream:
                if response.HasField("error"):
                    raise ApiError(500, f"language instance: {response.error.message}")
                yield response
            finished = True
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, "language instance") from None
        except asyncio.CancelledError:
            if (
                encode is not None
                and encode.done()
                and not encode.cancelled()
                and encode.exception()
            ):
                error = encode.exception()
                assert isinstance(error, grpc.aio.AioRpcError)
                raise from_grpc(error, "encoder") from None
            raise
        finally:
            if not finished:
                stream.cancel()
                await self._abort(language, call.request_id)
            if encode is not None and not encode.done():
                encode.cancel()
            if encode is not None:
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await encode

    async def _abort(self, language: language_pb2_grpc.LanguageStub, request_id: str) -> None:
        """Belt and braces: a cancelled stream already aborts the request on the
        language side; this covers a cancellation that never reached it."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await language.Abort(
                language_pb2.AbortRequest(request_id=request_id, reason="the client went away"),
                timeout=2,
            )
