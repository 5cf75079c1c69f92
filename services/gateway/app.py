"""The FastAPI app: /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from services.gateway.backend import GenerateCall, GenerationBackend
from services.gateway.errors import ApiError
from services.gateway.images import ImageLoader
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (
    ChatCompletionRequest,
    ImagePart,
    chunk,
    completion,
    logprob_content,
    usage,
    validation_message,
)
from services.proto import common_pb2, language_pb2

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    language_pb2.FINISH_REASON_STOP: "stop",
    language_pb2.FINISH_REASON_LENGTH: "length",
    language_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Gateway:
    backend: GenerationBackend
    images: ImageLoader
    metrics: GatewayMetrics
    registry: CollectorRegistry
    api_key: str = ""


async def _prepare(gateway: Gateway, body: ChatCompletionRequest) -> GenerateCall:
    models = await gateway.backend.models()
    if body.model not in models:
        raise ApiError(
            404,
            f"The model `{body.model}` does not exist; served: {', '.join(models) or 'none'}",
            param="model",
            code="model_not_found",
        )
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    urls = [p.image_url.url for m in body.messages for p in m.parts if isinstance(p, ImagePart)]
    loaded = await gateway.images.load_all(urls)
    gateway.metrics.images.inc(len(loaded))
    hints = iter(image.token_hint for image in loaded)
    messages = []
    for message in body.messages:
        parts = []
        for part in message.parts:
            if isinstance(part, ImagePart):
                parts.append(
                    language_pb2.ContentPart(image=language_pb2.ImagePart(token_hint=next(hints)))
                )
            else:
                parts.append(language_pb2.ContentPart(text=part.text))
        role = "system" if message.role == "developer" else message.role
        messages.append(language_pb2.ChatMessage(role=role, content=parts))
    sampling = common_pb2.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0,
        max_tokens=body.max_output_tokens or 0,
        stop=body.stops,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        ignore_eos=body.ignore_eos,
    )
    if body.seed is not None:
        sampling.seed = body.seed
    return GenerateCall(
        request_id=f"chatcmpl-{secrets.token_hex(12)}",
        model=body.model,
        messages=messages,
        images=[image.data for image in loaded],
        sampling=sampling,
    )


async def _parse(request: Request) -> ChatCompletionRequest:
    raw = await request.body()
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as exc:
        raise ApiError(400, validation_message(exc.errors())) from None


def _check_key(gateway: Gateway, request: Request) -> None:
    if not gateway.api_key:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {gateway.api_key}".encode()):
        raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer ...)")


async def _sse(
    gateway: Gateway, call: GenerateCall, include_usage: bool, started: float
) -> AsyncIterator[str]:
    created = int(time.time())
    first = True
    status = 200
    try:
        yield _event(
            chunk(call.request_id, call.model, created, {"role": "assistant", "content": ""})
        )
        async for response in gateway.backend.generate(call):
            if response.HasField("chunk"):
                c = response.chunk
                if first and c.text:
                    gateway.metrics.ttft.observe(time.monotonic() - started)
                    first = False
                logprobs = logprob_content(list(c.logprobs)) if call.sampling.logprobs else None
                if c.text or logprobs:
                    yield _event(
                        chunk(
                            call.request_id,
                            call.model,
                            created,
                            {"content": c.text},
                            logprobs=logprobs,
                        )
                    )
            elif response.HasField("complete"):
                done = response.complete
                _count(gateway, done)
                yield _event(
                    chunk(
                        call.request_id,
                        call.model,
                        created,
                        {},
                        FINISH_REASONS.get(done.finish_reason, "stop"),
                    )
                )
                if include_usage:
                    body = chunk(call.request_id, call.model, created, {})
                    body["choices"] = []
                    body["usage"] = usage(done.prompt_tokens, done.completion_tokens)
                    yield _event(body)
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # headers are sent: the error travels in the stream
        status = exc.status
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        status = 499
        raise
    finally:
        gateway.metrics.requests.labels(str(status)).inc()
        gateway.metrics.latency.observe(time.monotonic() - started)
        gateway.metrics.in_flight.dec()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _count(gateway: Gateway, done: language_pb2.GenerateComplete) -> None:
    gateway.metrics.prompt_tokens.inc(done.prompt_tokens)
    gateway.metrics.completion_tokens.inc(done.completion_tokens)


async def _collect(gateway: Gateway, call: GenerateCall, started: float) -> dict[str, Any]:
    text: list[str] = []
    logprobs: list[dict[str, Any]] = []
    async for response in gateway.backend.generate(call):
        if response.HasField("chunk"):
            if not text:
                gateway.metrics.ttft.observe(time.monotonic() - started)
            text.append(response.chunk.text)
            logprobs += logprob_content(list(response.chunk.logprobs))
        elif response.HasField("complete"):
            done = response.complete
            _count(gateway, done)
            return completion(
                call.request_id,
                call.model,
                "".join(text),
                FINISH_REASONS.get(done.finish_reason, "stop"),
                done.prompt_tokens,
                done.completion_tokens,
                logprobs if call.sampling.logprobs else None,
            )
    raise ApiError(500, "the language instance ended the stream without completing")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: only disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="EPD gateway", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, validation_message(list(exc.errors()))).response()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        started = time.monotonic()
        _check_key(gateway, request)
        body = await _parse(request)
        gateway.metrics.in_flight.inc()
        try:
            call = await _prepare(gateway, body)
        except ApiError as exc:
            gateway.metrics.in_flight.dec()
            gateway.metrics.requests.labels(str(exc.status)).inc()
            raise
        if body.stream:
            return StreamingResponse(
                _sse(gateway, call, body.include_usage, started), media_type="text/event-stream"
            )
        # A plain response: the request is aborted if the client goes away.
        work = asyncio.ensure_future(_collect(gateway, call, started))
        watch = asyncio.ensure_future(_until_disconnected(request))
        status = 200
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                status = 499
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, ApiError):
                    await work
                return Response(status_code=499)
            try:
                return JSONResponse(work.result())
            except ApiError as exc:
                status = exc.status
                raise
        finally:
            watch.cancel()
            gateway.metrics.requests.labels(str(status)).inc()
            gateway.metrics.latency.observe(time.monotonic() - started)
            gateway.metrics.in_flight.dec()

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
        try:
            names = await gateway.backend.models()
        except ApiError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message}, status_code=503)
        if not names:
            return JSONResponse(
                {"status": "unavailable", "reason": "no language instance"}, status_code=503
            )
        return JSONResponse({"status": "ok", "models": names})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    return app
