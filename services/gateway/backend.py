"""Backend: the gateway's gRPC side. Routes a request, then runs
Encoder.Encode and Language.Generate concurrently. In E/P/D the broker names
a prefill and a decode instance: the encoder sends to the prefill instance,
Language.Prefill there hands the KV pages to the decode instance, and the
decode instance's Generate streams the tokens (the first included), all three
at once.

Encode answers once the embeddings have landed in the language instance.
If the encoder is unavailable (it died, its Triton is down, it is shutting
down and refuses or cancels the call) before any of them landed, the request
fails over: the broker keeps it on its language instance, with its
preallocation, and names another encoder. Any other encode failure ends the
generation; whatever ends a request early aborts it downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import grpc
from opentelemetry.trace import SpanKind

from services.gateway.errors import ApiError, from_grpc
from services.gateway.request_log import RequestRecord
from services.gateway.streams import GenerateStreams, StreamedCall
from services.gateway.tool_calls import Forced
from services.proto import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from services.runtime import tracing
from services.runtime.grpc_server import channel
from services.wire.convert import from_proto, to_proto
from services.wire.messages import RouteReply, RouteRequest
from services.wire.request import (
    EncodeRequest,
    GenerateComplete,
    GenerateError,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
)

logger = logging.getLogger(__name__)

CLIENT = SpanKind.CLIENT
BROKER_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0  # for a channel that is not connected (its peer just restarted)
# How long a Route that cannot reach the broker is tried again: a broker that
# restarts (its supervisor's, or Kubernetes') is back within a few seconds.
BROKER_BACK_S = 10.0
HELPERS_FINISH_S = 1.0  # an encode (or prefill) still returning after its request finished

# A request's stream from the language instance, as the gateway consumes it.
Responses = AsyncGenerator[GenerateResponse, None]


class GenerationBackend(Protocol):
    """What the gateway needs from what serves it: the disaggregated stack over
    gRPC (Backend), or everything in-process (LocalBackend, the baseline)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def models(self) -> list[str]: ...

    async def check_model(self, model: str) -> None:
        """ApiError 404 unless the model is served (or known while restarting)."""

    async def health(self) -> dict[str, Any]: ...

    def generate(self, call: GenerateCall) -> Responses: ...


@dataclass(frozen=True, slots=True)
class MediaData:
    """An image's or a video's bytes, as the client sent them."""

    data: bytes
    is_video: bool = False
    key: str = ""  # its content hash (media_key), computed once by the gateway


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """What the gateway asks of its backend: the language request, the model it
    is for, and the bytes of its images and videos in prompt order."""

    request: GenerateRequest
    model: str
    media: tuple[MediaData, ...] = ()
    tool_calls: bool = False  # the output is split into content and calls (tool_calls.py)
    forced: Forced | None = None  # a forced tool_choice: the output is calls only
    # filled in by the backend with the instances it used, logged at the end
    record: RequestRecord = field(default_factory=lambda: RequestRecord(""))
    routing_key: str = ""  # OpenAI's prompt_cache_key: routed with the chat's prefixes

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def is_completion(self) -> bool:
        return self.request.is_completion


# A language instance's stream ended by these before it produced anything, or an
# encode: the instance is gone or going (a gRPC server cancels the calls that reach
# it while it shuts down; this gateway's own cancels surface as asyncio.CancelledError).
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _NothingProduced(Exception):
    """A language instance (`instance_id`) was unavailable before anything was
    produced: the request can start again on others."""

    def __init__(self, error: ApiError, instance_id: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.instance_id = instance_id


class _Helpers:
    """The tasks beside a language stream (an encode; in E/P/D the prefill). One
    that fails for good ends the stream at once instead of leaving the language
    instance waiting for data that will never come. (An aborted encode does not:
    the language side aborted it, and its stream says why.)"""

    def __init__(self, stream: StreamedCall) -> None:
        self.stream = stream
        self.tasks: list[asyncio.Task[None]] = []
        self.watched: list[asyncio.Task[None]] = []  # those whose failure ends the stream

    def add(self, helper: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(helper)
        self.tasks.append(task)
        self.watched.append(task)
        task.add_done_callback(self._done)
        return task

    def release(self, task: asyncio.Task[None]) -> None:
        """The stream no longer needs the task: its failure ends nothing."""
        if task in self.watched:
            self.watched.remove(task)

    def _done(self, task: asyncio.Task[None]) -> None:
        failure = self._failure(task)
        if failure is not None and not (
            isinstance(failure, ApiError) and failure.aborted_downstream
        ):
            self.stream.cancel()

    def _failure(self, task: asyncio.Task[None]) -> BaseException | None:
        if task not in self.watched or not task.done() or task.cancelled():
            return None
        return task.exception()

    def failure(self) -> BaseException | None:
        """What made a watched task fail (and so cancelled the stream), if one did."""
        return next(filter(None, map(self._failure, self.watched)), None)

    async def close(self, finished: bool) -> None:
        """Ends the tasks: cancelled if the stream ended early; after a stream that
        finished, given HELPERS_FINISH_S to finish (an encode whose embeddings the
        answer used is about to return: cancelled, its encoder would count a
        failure, and its span would end after the request's)."""
        for task in self.tasks:
            if finished and not task.done():
                await asyncio.wait({task}, timeout=HELPERS_FINISH_S)
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError, _NothingProduced):
                await task


def _component(instance: broker_pb2.InstanceInfo) -> dict[str, Any]:
    """An instance as /health shows it; an encoder with its cache and queue."""
    load = instance.load
    shown: dict[str, Any] = {
        "role": _role_name(instance.registration),
        "model": instance.registration.model,
        "state": "unavailable" if load.unavailable else "serving",
        "requests": load.num_requests,
    }
    if instance.registration.role == common_pb2.ROLE_ENCODER:
        shown["cached_items"] = load.cached_items
        shown["hit_ratio"] = (
            round(load.cache_hits / load.cache_lookups, 4) if load.cache_lookups else 0.0
        )
        shown["queue_depth"] = load.queue_depth
    return shown


def _role_name(registration: broker_pb2.Register) -> str:
    """encoder, language (prefill and decode), prefill or decode."""
    if registration.language_role in (
        common_pb2.LANGUAGE_ROLE_PREFILL,
        common_pb2.LANGUAGE_ROLE_DECODE,
    ):
        return common_pb2.LanguageRole.Name(registration.language_role).split("_")[-1].lower()
    return common_pb2.Role.Name(registration.role).removeprefix("ROLE_").lower()


def _answered(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the broker itself refused the route (services/broker/servicer.py)."""
    return any(key == "epd-route" for key, _ in exc.trailing_metadata() or ())


class Backend:
    def __init__(
        self,
        broker: str,
        encode_timeout_s: float = 60.0,
        generate_timeout_s: float = 900.0,
        served_models: Iterable[str] = (),
        max_failovers: int = 2,
    ) -> None:
        self.broker_address = broker
        self.encode_timeout_s = encode_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.max_failovers = max_failovers
        # Models answered 503 (not 404) while no instance serves them: configured,
        # or seen served since start.
        self.known_models = set(served_models)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams = GenerateStreams()  # the Generate calls, one stream per instance

    async def start(self) -> None:
        """Nothing to start: channels open on first use."""

    async def _channel(self, address: str) -> grpc.aio.Channel:
        """A channel to the address, given a moment to connect if it is not: an
        instance that restarted is served again instead of failed fast."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        if ch.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await ch.channel_ready()
        return ch

    async def _broker(self) -> broker_pb2_grpc.BrokerStub:
        return broker_pb2_grpc.BrokerStub(await self._channel(self.broker_address))

    async def close(self) -> None:
        await self._streams.close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def _instances(self) -> list[broker_pb2.InstanceInfo]:
        try:
            reply = await (await self._broker()).ListInstances(
                broker_pb2.ListInstancesRequest(), timeout=BROKER_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, "broker") from None
        return list(reply.instances)

    async def models(self) -> list[str]:
        """Served now, or known to this gateway (an instance may be restarting)."""
        served = {
            i.registration.model
            for i in await self._instances()
            if i.registration.role == common_pb2.ROLE_LANGUAGE
        }
        self.known_models |= served
        return sorted(self.known_models)

    async def health(self) -> dict[str, Any]:
        """Each instance's state and role (encoder; language, or in E/P/D prefill
        and decode); ok with a language instance (or a prefill and a decode
        instance) and an available encoder, degraded (text only) without an
        encoder, unavailable otherwise."""
        try:
            instances = await self._instances()
        except ApiError as exc:
            return {"status": "unavailable", "reason": exc.message, "components": {}}
        components = {i.registration.instance_id: _component(i) for i in instances}
        serving = {c["role"] for c in components.values() if c["state"] == "serving"}
        if "language" not in serving and not {"prefill", "decode"} <= serving:
            status = "unavailable"
        elif "encoder" not in serving:
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "components": components}

    async def check_model(self, model: str) -> None:
        """Asks the broker only about a model this gateway does not know yet."""
        if model in self.known_models or model in await self.models():
            return
        raise ApiError(
            404,
            f"The model `{model}` does not exist; served: {', '.join(sorted(self.known_models))}"
            if self.known_models
            else f"The model `{model}` does not exist; no model is served yet",
            param="model",
            code="model_not_found",
        )

    async def _route(self, request: RouteRequest) -> RouteReply:
        """The broker's route; a broker that cannot be reached (restarting) is
        asked again for up to BROKER_BACK_S, one that answered is not."""
        given_up = time.monotonic() + BROKER_BACK_S
        with tracing.span("gateway.route", kind=CLIENT, media=len(request.media_hashes)):
            while True:
                try:
                    broker = await self._broker()
                    reply = await broker.Route(to_proto(request), timeout=BROKER_TIMEOUT_S)
                    return from_proto(RouteReply, reply)
                except grpc.aio.AioRpcError as exc:
                    unreached = exc.code() == grpc.StatusCode.UNAVAILABLE and not _answered(exc)
                    if not unreached or time.monotonic() >= given_up:
                        raise from_grpc(exc, "routing") from None
                await asyncio.sleep(0.1)

    async def generate(self, call: GenerateCall) -> Responses:
        """The language instance's stream; ApiError for anything that fails.

        A language instance that fails before it produced anything (it died, or
        cannot be reached) is replaced by another: the request starts again
        there under a new id downstream, its images encoded for it. After the
        first response a failure ends the request."""
        failed = ""
        keys = [m.key for m in call.media]
        prefixes = call.request.prefix_hashes(call.routing_key)
        for attempt in range(self.max_failovers + 1):
            request = call.request
            if attempt:
                request = replace(request, request_id=f"{call.request_id}-retry{attempt}")
            route = await self._route(
                RouteRequest(
                    request.request_id,
                    call.model,
                    needs_encoder=bool(call.media),
                    failed_language_id=failed,
                    media_hashes=tuple(keys),
                    prefix_hashes=prefixes,
                )
            )
            attempted = self._attempt(call, request, route, keys)
            async with contextlib.aclosing(attempted) as responses:
                try:
                    first = await anext(responses)
                except _NothingProduced as exc:
                    if attempt == self.max_failovers:
                        raise exc.error from None
                    logger.warning(
                        "%s: language instance %s failed before its first token (%s); "
                        "retrying on another",
                        call.request_id,
                        exc.instance_id,
                        exc.error.message,
                    )
                    failed = exc.instance_id
                    continue
                except StopAsyncIteration:
                    return
                yield first
                async for response in responses:
                    yield response
                return

    async def _attempt(
        self,
        call: GenerateCall,
        request: GenerateRequest,
        route: RouteReply,
        keys: list[str],
    ) -> Responses:
        """The request on the routed language instance (and encoder; in E/P/D the
        decode instance streams, the prefill instance hands it the KV pages);
        _NothingProduced if an instance is unavailable before the first response."""
        request = _as_routed(call, request, route)
        streaming_id, address = route.language_id, route.language_address
        to_prefill = request
        if route.decode_id:
            call.record.language = f"{route.language_id}>{route.decode_id}"
            streaming_id, address = route.decode_id, route.decode_address
            request = replace(request, prefill_instance_id=route.language_id)
        language_channel = await self._channel(address)
        language = language_pb2_grpc.LanguageStub(language_channel)
        span = tracing.start("gateway.generate", kind=CLIENT, language=streaming_id)
        with tracing.current(span):  # the calls and helpers below carry it
            stream = self._streams.call(address, language_channel, request, self.generate_timeout_s)
            helpers = _Helpers(stream)
            prefilling = helpers.add(self._prefill(to_prefill, route)) if route.decode_id else None
            if call.media:
                helpers.add(self._encode(call, request, route, keys))
        finished = produced = False
        ends = 0  # choices complete: with every one in, a consumer that stops aborts nothing
        try:
            async for response in stream:
                if isinstance(response.kind, GenerateError):
                    raise ApiError(500, f"language instance: {response.kind.message}")
                if prefilling is not None:
                    # The decode instance streams once it holds the KV pages: what the
                    # prefill instance answers now (or its death) cannot change the request.
                    helpers.release(prefilling)
                produced = True
                ends += isinstance(response.kind, GenerateComplete)
                finished = ends == max(1, request.sampling.n)
                yield response
            finished = True
        except grpc.aio.AioRpcError as exc:
            error = from_grpc(exc, f"language instance {streaming_id}")
            if not produced and exc.code() in _GONE:
                raise _NothingProduced(error, streaming_id) from None
            raise error from None
        except asyncio.CancelledError:
            failure = helpers.failure()  # one that failed for good stopped the stream: its error
            if failure is not None:
                raise failure from None
            raise
        finally:
            tracing.end(span, None if finished else "the stream ended early")
            if not finished:
                stream.cancel()
                await self._abort(language, request.request_id)
            await helpers.close(finished)

    async def _prefill(self, request: GenerateRequest, route: RouteReply) -> None:
        """E/P/D: Prefill on the prefill instance, which returns once the KV pages
        are in the decode instance; _NothingProduced if it is unavailable."""
        prefill = language_pb2_grpc.LanguageStub(await self._channel(route.language_address))
        to_prefill = replace(request, decode_instance_id=route.decode_id)
        with tracing.span("gateway.prefill", kind=CLIENT, prefill=route.language_id):
            try:
                await prefill.Prefill(to_proto(to_prefill), timeout=self.generate_timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = from_grpc(exc, f"prefill instance {route.language_id}")
                if exc.code() in _GONE:
                    raise _NothingProduced(error, route.language_id) from None
                raise error from None

    async def _encode(
        self, call: GenerateCall, request: GenerateRequest, route: RouteReply, keys: list[str]
    ) -> None:
        """Encode on the routed encoder, failing over to another while it is gone
        (_GONE). The next one hears the language instance's preallocation before it
        encodes any item: it starts at the first item that has not wholly landed."""
        request_id = request.request_id
        encoder_id, address = route.encoder_id, route.encoder_address
        held_items = request.held_items
        peers = route.holder_addresses
        for attempt in range(self.max_failovers + 1):
            call.record.encoder = encoder_id
            call.record.peer_items = sum(bool(p) for p in peers)
            encoder = encoder_pb2_grpc.EncoderStub(await self._channel(address))
            try:
                with tracing.span("gateway.encode", kind=CLIENT, encoder=encoder_id):
                    encode = EncodeRequest(
                        request_id,
                        tuple(m.data for m in call.media),
                        route.language_id,
                        tuple(i for i, m in enumerate(call.media) if m.is_video),
                        held_items,
                        request.cache_salt,
                        peers,
                    )
                    await encoder.Encode(to_proto(encode), timeout=self.encode_timeout_s)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _GONE or attempt == self.max_failovers:
                    raise from_grpc(exc, f"encoder {encoder_id}") from None
                logger.warning(
                    "%s: encoder %s unavailable (%s); failing over",
                    call.request_id,
                    encoder_id,
                    exc.details(),
                )
            failover = await self._route(
                RouteRequest(
                    request_id,
                    call.model,
                    needs_encoder=True,
                    language_id=route.language_id,
                    failed_encoder_id=encoder_id,
                    media_hashes=tuple(keys),
                )
            )
            encoder_id, address = failover.encoder_id, failover.encoder_address
            peers = failover.holder_addresses
            held_items = len(call.media)  # landed ones are held: the preallocation says

    async def _abort(self, language: language_pb2_grpc.LanguageStub, request_id: str) -> None:
        """Belt and braces: a cancelled stream already aborts the request on the
        language side; this covers a cancellation that never reached it."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await language.Abort(
                language_pb2.AbortRequest(request_id=request_id, reason="the client went away"),
                timeout=2,
            )


def _as_routed(call: GenerateCall, request: GenerateRequest, route: RouteReply) -> GenerateRequest:
    """The request for the language instance the route names, noted in its log
    record: the items in the prefix the broker sent it before (or the instance it
    fetches the chat's KV pages from) are ones its prefix cache may hold."""
    call.record.language = route.language_id
    call.record.prefix_depth = route.prefix_depth
    call.record.prefix_from = route.prefix_holder_id
    depth = max(route.prefix_depth, route.prefix_holder_depth)
    return replace(
        request, held_items=request.media_in(depth), prefix_holder=route.prefix_holder_address
    )
