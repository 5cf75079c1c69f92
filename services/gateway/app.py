"""The FastAPI app: /v1/chat/completions, /v1/models, /health, /metrics.

A request's response starts only once its first token (or its error) is
known: whatever can fail before that, routing, validation on the language
instance, the images, is an HTTP status, streaming or not. Admission, the
in-flight gauge and the status counts live in one ASGI wrapper (InFlight),
so no path through the app can leave them unbalanced.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.backend import GenerateCall, GenerationBackend, MediaData, Responses
from services.gateway.errors import ApiError
from services.gateway.images import ImageLoader
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    JsonObjectFormat,
    JsonSchemaFormat,
    TextPart,
    VideoPart,
    called,
    chat_choice,
    chunk,
    completion,
    logprob_content,
    text_completion,
    text_logprobs,
    usage,
    validation_error,
)
from services.gateway.request_log import RequestRecord
from services.gateway.request_log import log as log_request
from services.gateway.tool_calls import Call, ToolCallStream, call_deltas, structural_tag
from services.runtime import tracing
from services.wire import request as wire

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", ChatCompletionRequest, CompletionRequest)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
CLIENT_LEFT = 499


@dataclass
class Gateway:
    backend: GenerationBackend
    images: ImageLoader
    metrics: GatewayMetrics
    registry: CollectorRegistry
    api_key: str = ""
    max_concurrent_requests: int = 512
    max_body_bytes: int = 64 * 1024 * 1024


class InFlight:
    """ASGI wrapper of the generation endpoints: admits at most `limit` requests
    at once (429 beyond), and counts each one in flight from its first byte to
    the end of its response, whatever ends it, a client that leaves included."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        metrics = self.gateway.metrics
        if self.active >= self.gateway.max_concurrent_requests:
            metrics.requests.labels("429").inc()
            limit = self.gateway.max_concurrent_requests
            busy = ApiError(429, f"the gateway has {limit} requests in flight, its limit")
            await busy.response()(scope, receive, send)
            return
        status = CLIENT_LEFT  # unless a response starts

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.monotonic()
        record = RequestRecord(scope["path"])
        scope.setdefault("state", {})["record"] = record  # the handlers' request.state.record
        self.active += 1
        metrics.in_flight.inc()
        headers = (  # for the client's traceparent; not read when tracing is off
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            if tracing.enabled()
            else None
        )
        with tracing.serving(f"POST {scope['path']}", headers) as span:
            record.trace_id = tracing.trace_id_hex()
            try:
                await self.app(scope, receive, watched)
            finally:
                self.active -= 1
                metrics.in_flight.dec()
                metrics.requests.labels(str(status)).inc()
                metrics.latency.observe(time.monotonic() - started)
                record.status = status
                record.total_ms = (time.monotonic() - started) * 1000
                log_request(record)
                _close_span(span, record)


def _close_span(span: Span, record: RequestRecord) -> None:
    """What the request log says, on the request's root span."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            tracing.REQUEST_ID: record.request_id,
            "http.response.status_code": record.status,
            "epd.media": record.media,
            "epd.prompt_tokens": record.prompt_tokens,
            "epd.completion_tokens": record.completion_tokens,
            "epd.language": record.language,
            "epd.encoder": record.encoder,
        }
    )
    if record.ttft_ms is not None:
        span.set_attribute("epd.ttft_ms", record.ttft_ms)
    if record.status >= 500:
        span.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))


async def _prepare(
    gateway: Gateway, body: ChatCompletionRequest, record: RequestRecord
) -> GenerateCall:
    record.model = body.model
    await gateway.backend.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    vision = [p for m in body.messages for p in m.parts if not isinstance(p, TextPart)]
    with tracing.span("gateway.load_media", items=len(vision)):
        loaded = await gateway.images.load_all(
            [p.image_url.url if isinstance(p, ImagePart) else p.video_url.url for p in vision],
            ["image" if isinstance(p, ImagePart) else "video" for p in vision],
        )
    gateway.metrics.images.inc(len(loaded))
    record.media = len(loaded)
    messages = _messages(body.messages, [image.token_hint for image in loaded])
    form = body.response_format
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    sampling = _sampling(
        body,
        body.logprobs,
        body.top_logprobs or 0,
        # the language service compiles the grammar (a bad schema is its 400)
        json_object=isinstance(form, JsonObjectFormat),
        json_schema=json.dumps(form.json_schema.schema_)
        if isinstance(form, JsonSchemaFormat)
        else "",
        structural_tag=_forced_calls(body, tools),
    )
    request = wire.GenerateRequest(
        record.request_id, messages, sampling, tools=json.dumps(tools) if tools else ""
    )
    media = tuple(
        MediaData(image.data, isinstance(part, VideoPart))
        for image, part in zip(loaded, vision, strict=True)
    )
    return GenerateCall(request, body.model, media, body.calls_tools, record)


def _forced_calls(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> str:
    """The grammar of a forced tool_choice ("required", a named function), or ""."""
    if not body.forces_tools:
        return ""
    choice = body.tool_choice
    dumped = choice.model_dump() if isinstance(choice, BaseModel) else choice
    return structural_tag(tools, dumped, body.parallel_tool_calls)


def _messages(messages: list[ChatMessage], hints: list[int]) -> tuple[wire.ChatMessage, ...]:
    """The chat as the language service takes it: each image and video with its
    token hint (in prompt order), an assistant's calls, a tool result's call id."""
    hint = iter(hints)
    out = []
    for message in messages:
        parts: list[wire.ContentPart] = []
        for part in message.parts:
            if isinstance(part, ImagePart):
                parts.append(wire.ImagePart(token_hint=next(hint)))
            elif isinstance(part, VideoPart):
                parts.append(wire.VideoPart(token_hint=next(hint)))
            else:
                parts.append(part.text)
        calls = tuple(
            wire.ToolCall(c.id, c.function.name, c.function.arguments)
            for c in message.tool_calls or []
        )
        role = "system" if message.role == "developer" else message.role
        out.append(wire.ChatMessage(role, tuple(parts), calls, message.tool_call_id or ""))
    return tuple(out)


async def _prepare_completion(
    gateway: Gateway, body: CompletionRequest, record: RequestRecord
) -> list[GenerateCall]:
    """One call per prompt (its choice index); text-only, no chat template."""
    record.model = body.model
    await gateway.backend.check_model(body.model)
    prompts = body.prompts
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "a streamed completion takes one prompt", param="prompt")
    sampling = _sampling(body, body.logprobs is not None, body.logprobs or 0)
    request_id = record.request_id
    return [
        GenerateCall(
            wire.GenerateRequest(
                request_id if len(prompts) == 1 else f"{request_id}-{index}",
                sampling=sampling,
                prompt=prompt if isinstance(prompt, str) else "",
                prompt_token_ids=() if isinstance(prompt, str) else tuple(prompt),
            ),
            body.model,
            record=record,
        )
        for index, prompt in enumerate(prompts)
    ]


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    logprobs: bool,
    top_logprobs: int,
    json_object: bool = False,
    json_schema: str = "",
    structural_tag: str = "",
) -> wire.SamplingParams:
    """The request's sampling parameters: the one place they are read from OpenAI's."""
    try:
        return wire.SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=max(0, body.top_k or 0),
            max_tokens=body.max_output_tokens or 0,
            seed=body.seed,
            stop=tuple(body.stops),
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            logit_bias=tuple(sorted((body.logit_bias or {}).items())),
            json_schema=json_schema,
            json_object=json_object,
            structural_tag=structural_tag,
            n=body.n,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes, over the limit of {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    return bytes(body)


async def _parse(request: Request, limit: int, model: type[R]) -> R:
    raw = await _body(request, limit)
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise ApiError(400, *validation_error(exc.errors())) from None
    except RecursionError:
        raise ApiError(400, "the request is nested too deeply") from None


def _check_key(gateway: Gateway, request: Request) -> None:
    if not gateway.api_key:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {gateway.api_key}".encode()):
        raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer ...)")


class _ClientLeft(Exception):
    """The client went away before its response started."""


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: only disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The work's result; if the client leaves first, the work is cancelled
    (aborting the request downstream) and _ClientLeft raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await task
    raise _ClientLeft


async def _first(stream: Responses) -> Any:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise ApiError(500, "the language instance ended the stream without completing") from None


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _count(
    gateway: Gateway,
    call: GenerateCall,
    response: wire.GenerateResponse,
    done: wire.GenerateComplete,
) -> None:
    """Token counters, from each choice's completion (the prompt counts once)."""
    if response.index == 0:
        gateway.metrics.prompt_tokens.inc(done.prompt_tokens)
        call.record.prompt_tokens += done.prompt_tokens
    gateway.metrics.completion_tokens.inc(done.completion_tokens)
    call.record.completion_tokens += done.completion_tokens


def _first_token(gateway: Gateway, call: GenerateCall, started: float) -> None:
    seconds = time.monotonic() - started
    gateway.metrics.ttft.observe(seconds)
    if call.record.ttft_ms is None:
        call.record.ttft_ms = seconds * 1000


def _choice_index(response: wire.GenerateResponse, n: int) -> int:
    if response.index >= n:
        raise ApiError(500, f"the language instance sent choice {response.index} of {n}")
    return response.index


async def _responses(first: wire.GenerateResponse, stream: Responses) -> Responses:
    yield first
    async for response in stream:
        yield response


class _Deltas:
    """One chat choice's deltas: its text as content, or, where the output is
    parsed for tool calls, content and calls as they complete (tool_calls.py)."""

    def __init__(self, tool_calls: bool) -> None:
        self.stream = ToolCallStream() if tool_calls else None
        self.calls = 0

    def text(self, text: str) -> list[dict[str, Any]]:
        if self.stream is None:
            return [{"content": text}] if text else []
        return self._deltas(self.stream.feed(text))

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The deltas held to the end, and the finish reason: "tool_calls" where
        the choice called tools and stopped by itself."""
        deltas = self._deltas(self.stream.finish()) if self.stream is not None else []
        return deltas, called(reason, self.calls > 0)

    def _deltas(self, pieces: list[str | Call]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, Call):
                out += call_deltas(piece, self.calls)
                self.calls += 1
            else:
                out.append({"content": piece})
        return out


def _pieces(
    call: GenerateCall,
    created: int,
    index: int,
    text: str,
    entries: list[Any],
    deltas: _Deltas,
) -> list[dict[str, Any]]:
    """A chunk's stream events for one choice: a text completion's piece, or
    chat deltas (the logprobs with the first; an empty delta carries them alone)."""
    want_logprobs = call.sampling.logprobs and bool(entries)
    if call.is_completion:
        choice = {
            "index": index,
            "text": text,
            "logprobs": text_logprobs(entries) if want_logprobs else None,
            "finish_reason": None,
        }
        return [text_completion(call.request_id, call.model, [choice], None)]
    out = deltas.text(text) or ([{"content": ""}] if want_logprobs else [])
    logprobs = logprob_content(entries) if want_logprobs else None
    return [
        chunk(call.request_id, call.model, created, d, None, logprobs if i == 0 else None, index)
        for i, d in enumerate(out)
    ]


def _closing(
    call: GenerateCall, created: int, index: int, reason: str, deltas: _Deltas
) -> list[dict[str, Any]]:
    """A choice's last events: what its deltas held, then its finish reason."""
    if call.is_completion:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return [text_completion(call.request_id, call.model, [choice], None)]
    held, reason = deltas.finish(reason)
    return [
        *(chunk(call.request_id, call.model, created, d, index=index) for d in held),
        chunk(call.request_id, call.model, created, {}, reason, None, index),
    ]


async def _sse(
    gateway: Gateway,
    call: GenerateCall,
    stream: Responses,
    first: wire.GenerateResponse,
    include_usage: bool,
    started: float,
) -> AsyncIterator[str]:
    created = int(time.time())
    n = max(1, call.sampling.n)
    seen_text = False
    going, completion_tokens = n, 0
    deltas = [_Deltas(call.tool_calls) for _ in range(n)]
    try:
        if not call.is_completion:
            opening = {"role": "assistant", "content": ""}
            for index in range(n):
                yield _event(chunk(call.request_id, call.model, created, opening, index=index))
        async for response in _responses(first, stream):
            index = _choice_index(response, n)
            match response.kind:
                case wire.GenerateChunk() as c:
                    if not seen_text and c.text:
                        _first_token(gateway, call, started)
                        seen_text = True
                    if c.text or (call.sampling.logprobs and c.logprobs):
                        entries = list(c.logprobs)
                        for piece in _pieces(call, created, index, c.text, entries, deltas[index]):
                            yield _event(piece)
                case wire.GenerateComplete() as done:
                    _count(gateway, call, response, done)
                    for piece in _closing(call, created, index, done.finish_reason, deltas[index]):
                        yield _event(piece)
                    going -= 1
                    completion_tokens += done.completion_tokens
                    if include_usage and not going:
                        body = chunk(call.request_id, call.model, created, {})
                        kind = "text_completion" if call.is_completion else body["object"]
                        body["object"] = kind
                        body["choices"] = []
                        body["usage"] = usage(done.prompt_tokens, completion_tokens)
                        yield _event(body)
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # a failure after the response started: it travels in the stream
        call.record.error, call.record.component = exc.message, exc.component
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # a client that left mid-stream aborts the request downstream


@dataclass(frozen=True, slots=True)
class _Generated:
    """One choice's whole output."""

    text: str
    logprobs: list[Any]  # TokenLogprob messages
    finish_reason: wire.FinishReason
    prompt_tokens: int
    completion_tokens: int


def _usage(choices: list[_Generated]) -> dict[str, int]:
    """The prompt once, every choice's completion."""
    return usage(choices[0].prompt_tokens, sum(c.completion_tokens for c in choices))


async def _collect(
    gateway: Gateway,
    call: GenerateCall,
    stream: Responses,
    first: wire.GenerateResponse,
    started: float,
) -> list[_Generated]:
    """Every choice's output, in choice order."""
    n = max(1, call.sampling.n)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    done: dict[int, _Generated] = {}
    seen = False
    async for response in _responses(first, stream):
        index = _choice_index(response, n)
        match response.kind:
            case wire.GenerateChunk() as c:
                if not seen:
                    _first_token(gateway, call, started)
                    seen = True
                texts[index].append(c.text)
                logprobs[index] += list(c.logprobs)
            case wire.GenerateComplete() as end:
                _count(gateway, call, response, end)
                done[index] = _Generated(
                    "".join(texts[index]),
                    logprobs[index],
                    end.finish_reason,
                    end.prompt_tokens,
                    end.completion_tokens,
                )
                if len(done) == n:
                    return [done[i] for i in range(n)]
    raise ApiError(500, "the language instance ended the stream without completing")


async def _generate(
    gateway: Gateway, request: Request, call: GenerateCall, started: float
) -> tuple[Responses, wire.GenerateResponse]:
    """The call's stream and its first response: a failure before it is an HTTP
    status, streaming or not."""
    stream = gateway.backend.generate(call)
    try:
        return stream, await _unless_disconnected(request, _first(stream))
    except BaseException:
        await stream.aclose()
        raise


async def _streamed(
    gateway: Gateway, request: Request, call: GenerateCall, include_usage: bool, started: float
) -> StreamingResponse:
    """An SSE response, started once the first response is in."""
    stream, first = await _generate(gateway, request, call, started)
    return StreamingResponse(
        _sse(gateway, call, stream, first, include_usage, started),
        media_type="text/event-stream",
    )


async def _complete(
    gateway: Gateway, request: Request, call: GenerateCall, started: float
) -> list[_Generated]:
    stream, first = await _generate(gateway, request, call, started)
    try:
        return await _unless_disconnected(request, _collect(gateway, call, stream, first, started))
    finally:
        await stream.aclose()


# FastAPI 0.16x traces requests itself, with the global tracer provider: a second
# server span of the same name under the gateway's own (InFlight's), which carries
# what the request log says. Off where FastAPI has it.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


# Long: the routes are closures over `gateway`, each a few lines; one table of them.
def create_app(gateway: Gateway) -> ASGIApp:
    app = FastAPI(title="EPD gateway", docs_url=None, redoc_url=None, **_NO_NATIVE_TELEMETRY)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        record = getattr(request.state, "record", None)
        if record is not None:
            record.error, record.component = exc.message, exc.component
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, *validation_error(list(exc.errors()))).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        """A failure nothing foresaw: still a JSON 500 that names it (Starlette
        re-raises it after this response, and the server logs its traceback)."""
        error = ApiError(500, f"the gateway failed: {type(exc).__name__}: {exc}")
        record = getattr(request.state, "record", None)
        if record is not None:
            record.error, record.component = error.message, "gateway"
        return error.response()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        started = time.monotonic()
        _check_key(gateway, request)
        body = await _parse(request, gateway.max_body_bytes, ChatCompletionRequest)
        record = request.state.record
        record.request_id = f"chatcmpl-{secrets.token_hex(12)}"
        call = await _prepare(gateway, body, record)
        try:
            if body.stream:
                return await _streamed(gateway, request, call, body.include_usage, started)
            outs = await _complete(gateway, request, call, started)
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        want_logprobs = call.sampling.logprobs
        choices = [
            chat_choice(
                index,
                out.text,
                out.finish_reason,
                logprob_content(out.logprobs) if want_logprobs else None,
                call.tool_calls,
            )
            for index, out in enumerate(outs)
        ]
        return JSONResponse(completion(call.request_id, call.model, choices, _usage(outs)))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        started = time.monotonic()
        _check_key(gateway, request)
        body = await _parse(request, gateway.max_body_bytes, CompletionRequest)
        record = request.state.record
        record.request_id = f"cmpl-{secrets.token_hex(12)}"
        calls = await _prepare_completion(gateway, body, record)
        try:
            if body.stream:
                return await _streamed(gateway, request, calls[0], body.include_usage, started)
            outs = await asyncio.gather(*(_complete(gateway, request, c, started) for c in calls))
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        choices = [  # prompt p's choice i is choice p * n + i (as OpenAI)
            {
                "index": p * body.n + i,
                "text": out.text,
                "logprobs": text_logprobs(out.logprobs) if body.logprobs is not None else None,
                "finish_reason": out.finish_reason,
            }
            for p, prompt_outs in enumerate(outs)
            for i, out in enumerate(prompt_outs)
        ]
        each = [_usage(prompt_outs) for prompt_outs in outs]
        total = usage(
            sum(u["prompt_tokens"] for u in each), sum(u["completion_tokens"] for u in each)
        )
        request_id = calls[0].request_id.removesuffix("-0")  # several prompts: ID-0, ID-1, ...
        return JSONResponse(text_completion(request_id, body.model, choices, total))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_key(gateway, request)
        names = await gateway.backend.models()
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "epd"} for n in names],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while something can be served (status ok, or degraded: text only),
        503 when nothing can; each component's state either way."""
        report = await gateway.backend.health()
        return JSONResponse(report, status_code=503 if report["status"] == "unavailable" else 200)

    @app.get("/debug/spans/{request_id}")
    async def spans(request: Request, request_id: str) -> Response:
        """The gateway's spans of a recent request (OTLP protobuf; `epd trace`)."""
        _check_key(gateway, request)
        return Response(tracing.recent_spans(request_id), media_type="application/x-protobuf")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    return InFlight(app, gateway)
