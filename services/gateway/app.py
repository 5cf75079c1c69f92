"""The FastAPI app: its routes (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/models, /health, /metrics, /debug/spans) over a Gateway.

A request's response starts only once its first token (or its error) is
known: whatever can fail before that, routing, validation on the language
instance, the images, is an HTTP status, streaming or not. A request's path:
admission.py admits and accounts it, prepare.py reads it into a GenerateCall,
backend.py runs it, streaming.py or shapes.py shape the answer. A Responses
API request is a chat request (responses/convert.py) whose answer
responses/events.py shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp

from services.gateway.admission import CLIENT_LEFT, InFlight
from services.gateway.backend import GenerateCall, GenerationBackend, Responses
from services.gateway.errors import ApiError
from services.gateway.media import MediaLoader
from services.gateway.metrics import GatewayMetrics
from services.gateway.prepare import chat_call, completion_calls, parse
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, validation_error
from services.gateway.request_log import RequestRecord
from services.gateway.responses.convert import (
    assistant_message,
    chat_request,
    input_items,
    items_page,
)
from services.gateway.responses.events import ResponseOutput, response_events
from services.gateway.responses.protocol import ResponsesRequest
from services.gateway.responses.store import ResponseStore, Stored
from services.gateway.shapes import (
    Generated,
    chat_choice,
    collect,
    completion,
    logprob_content,
    text_completion,
    text_logprobs,
    usage,
    usage_of,
)
from services.gateway.streaming import events
from services.runtime import tracing
from services.wire import request as wire

T = TypeVar("T")


@dataclass
class Gateway:
    backend: GenerationBackend
    media: MediaLoader
    metrics: GatewayMetrics
    registry: CollectorRegistry
    store: ResponseStore  # the Responses API's stored responses
    api_key: str = ""
    max_concurrent_requests: int = 512
    max_body_bytes: int = 64 * 1024 * 1024


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
        events(gateway.metrics, call, stream, first, include_usage, started),
        media_type="text/event-stream",
    )


async def _complete(
    gateway: Gateway, request: Request, call: GenerateCall, started: float
) -> list[Generated]:
    stream, first = await _generate(gateway, request, call, started)
    try:
        outputs = collect(gateway.metrics, call, stream, first, started)
        return await _unless_disconnected(request, outputs)
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


def create_app(gateway: Gateway) -> ASGIApp:
    app = FastAPI(title="EPD gateway", docs_url=None, redoc_url=None, **_NO_NATIVE_TELEMETRY)
    _errors_as_json(app)
    _generation_routes(app, gateway)
    _responses_routes(app, gateway)
    _stored_routes(app, gateway)
    _other_routes(app, gateway)
    return InFlight(app, gateway.metrics, gateway.max_concurrent_requests)


def _errors_as_json(app: FastAPI) -> None:
    """Every error an OpenAI-style JSON body, noted in the request's log record."""

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


async def _admitted(gateway: Gateway, request: Request, prefix: str) -> RequestRecord:
    """What every generation request starts with: the API key checked, and its
    id (`prefix`-...) on its log record."""
    _check_key(gateway, request)
    record: RequestRecord = request.state.record
    record.request_id = f"{prefix}-{secrets.token_hex(12)}"
    return record


def _generation_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        started = time.monotonic()
        record = await _admitted(gateway, request, "chatcmpl")
        body = await parse(request, gateway.max_body_bytes, ChatCompletionRequest)
        call = await chat_call(gateway.backend, gateway.media, gateway.metrics, body, record)
        try:
            if body.stream:
                return await _streamed(gateway, request, call, body.include_usage, started)
            outs = await _complete(gateway, request, call, started)
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        return JSONResponse(_chat_completion(call, outs))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        started = time.monotonic()
        record = await _admitted(gateway, request, "cmpl")
        body = await parse(request, gateway.max_body_bytes, CompletionRequest)
        calls = await completion_calls(gateway.backend, body, record)
        try:
            if body.stream:
                return await _streamed(gateway, request, calls[0], body.include_usage, started)
            outs = await asyncio.gather(*(_complete(gateway, request, c, started) for c in calls))
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        return JSONResponse(_text_completion(body, calls, outs))


def _chat_completion(call: GenerateCall, outs: list[Generated]) -> dict[str, Any]:
    want_logprobs = call.sampling.logprobs
    choices = [
        chat_choice(
            index,
            out.text,
            out.finish_reason,
            logprob_content(out.logprobs) if want_logprobs else None,
            call.tool_calls,
            call.forced,
        )
        for index, out in enumerate(outs)
    ]
    return completion(call.request_id, call.model, choices, usage_of(outs))


def _text_completion(
    body: CompletionRequest, calls: list[GenerateCall], outs: list[list[Generated]]
) -> dict[str, Any]:
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
    each = [usage_of(prompt_outs) for prompt_outs in outs]
    total = usage(
        sum(u["prompt_tokens"] for u in each),
        sum(u["completion_tokens"] for u in each),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in each),
    )
    request_id = calls[0].request_id.removesuffix("-0")  # several prompts: ID-0, ID-1, ...
    return text_completion(request_id, body.model, choices, total)


def _stored(gateway: Gateway, response_id: str, param: str = "response_id") -> Stored:
    """A stored response: 404 where it is not (400 where a request's `param` names it)."""
    found = gateway.store.get(response_id)
    if found is None:
        text = f"no stored response '{response_id}' (never stored, expired or deleted)"
        if param == "response_id":
            raise ApiError(404, text, param=param)
        raise ApiError(400, f"{param}: {text}", param=param)
    return found


def _responses_routes(app: FastAPI, gateway: Gateway) -> None:
    """The Responses API: a translation onto the chat path, and the stored
    responses a later request continues (previous_response_id)."""

    @app.post("/v1/responses", response_model=None)
    async def create_response(request: Request) -> Response:
        started = time.monotonic()
        record = await _admitted(gateway, request, "resp")
        body = await parse(request, gateway.max_body_bytes, ResponsesRequest)
        previous = body.previous_response_id
        before = _stored(gateway, previous, "previous_response_id") if previous else None
        history = before.conversation if before is not None else []
        chat, conversation = chat_request(body, history)
        call = await chat_call(gateway.backend, gateway.media, gateway.metrics, chat, record)
        output = ResponseOutput(record.request_id, body, call.tool_calls, body.stream, call.forced)

        def keep(done: ResponseOutput) -> None:
            if body.store:
                turn = [*conversation[len(history) :], assistant_message(done.output)]
                gateway.store.put(done.response, turn, input_items(body.input), before)

        try:
            if body.stream:
                stream, first = await _generate(gateway, request, call, started)
                events = response_events(
                    gateway.metrics, call, stream, first, output, started, keep
                )
                return StreamingResponse(events, media_type="text/event-stream")
            (out,) = await _complete(gateway, request, call, started)
        except _ClientLeft:
            return Response(status_code=CLIENT_LEFT)
        output.text(out.text)
        output.finish(
            wire.GenerateComplete(
                out.finish_reason, out.prompt_tokens, out.completion_tokens, 0, out.cached_tokens
            )
        )
        keep(output)
        return JSONResponse(output.response)


def _stored_routes(app: FastAPI, gateway: Gateway) -> None:
    """The stored responses, read, listed and deleted."""

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Any:
        _check_key(gateway, request)
        return _stored(gateway, response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(
        request: Request,
        response_id: str,
        order: str = "desc",
        limit: int = 20,
        after: str | None = None,
    ) -> dict[str, Any]:
        """The response's input items, newest first unless order=asc, a page of
        `limit` after the item `after`, as OpenAI lists them."""
        _check_key(gateway, request)
        items = list(_stored(gateway, response_id).input_items)
        return items_page(items[::-1] if order == "desc" else items, order, limit, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        _check_key(gateway, request)
        _stored(gateway, response_id)
        gateway.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _other_routes(app: FastAPI, gateway: Gateway) -> None:
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
