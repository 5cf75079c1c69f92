"""OpenAI requests read into GenerateCalls: the body parsed within its size limit,
the model checked, the images and videos loaded with their token hints, the chat
as the wire types the language service takes, and the sampling parameters read
from OpenAI's in one place."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.gateway.backend import GenerateCall, GenerationBackend, MediaData
from services.gateway.errors import ApiError
from services.gateway.media import MediaLoader
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
    validation_error,
)
from services.gateway.request_log import RequestRecord
from services.gateway.tool_calls import structural_tag
from services.runtime import tracing
from services.wire import request as wire
from services.wire.messages import MediaGrid, media_key

R = TypeVar("R", bound=BaseModel)


async def chat_call(
    backend: GenerationBackend,
    media: MediaLoader,
    metrics: GatewayMetrics,
    body: ChatCompletionRequest,
    record: RequestRecord,
) -> GenerateCall:
    """A chat completion's call."""
    record.model = body.model
    await backend.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    vision = [p for m in body.messages for p in m.parts if not isinstance(p, TextPart)]
    with tracing.span("gateway.load_media", items=len(vision)):
        loaded = await media.load_all(
            [p.image_url.url if isinstance(p, ImagePart) else p.video_url.url for p in vision],
            ["image" if isinstance(p, ImagePart) else "video" for p in vision],
        )
    metrics.images.inc(len(loaded))
    record.media = len(loaded)
    # each item's content hash, within the client's cache scope: the broker places
    # its encode by it, the language instance's prefix cache knows its KV by it
    # (hashed off the loop; text: none)
    salt = body.cache_salt or ""
    keys = (
        await asyncio.to_thread(lambda: [media_key(i.data, salt) for i in loaded]) if loaded else []
    )
    hints = [(item.token_hint, item.grid) for item in loaded]
    messages = _messages(body.messages, hints, keys)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    request = wire.GenerateRequest(
        record.request_id,
        messages,
        _chat_sampling(body, tools),
        tools=json.dumps(tools) if tools else "",
        cache_salt=salt,
    )
    items = tuple(
        MediaData(image.data, isinstance(part, VideoPart), key)
        for image, part, key in zip(loaded, vision, keys, strict=True)
    )
    key = body.prompt_cache_key or ""
    return GenerateCall(
        request, body.model, items, body.calls_tools, body.forced_calls, record, key
    )


def _chat_sampling(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> wire.SamplingParams:
    """A chat completion's sampling, its grammar's source among it: the language
    service compiles the grammar (a bad schema is its 400)."""
    form = body.response_format
    return _sampling(
        body,
        body.logprobs,
        body.top_logprobs or 0,
        json_object=isinstance(form, JsonObjectFormat),
        json_schema=json.dumps(form.json_schema.schema_)
        if isinstance(form, JsonSchemaFormat)
        else "",
        structural_tag=_forced_calls(body, tools),
    )


def _forced_calls(body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> str:
    """The grammar of a forced tool_choice ("required", a named function), or ""."""
    if not body.forces_tools:
        return ""
    choice = body.tool_choice
    dumped = choice.model_dump() if isinstance(choice, BaseModel) else choice
    return structural_tag(tools, dumped, body.parallel_tool_calls)


def _messages(
    messages: list[ChatMessage], hints: list[tuple[int, MediaGrid | None]], keys: list[str]
) -> tuple[wire.ChatMessage, ...]:
    """The chat as the language service takes it: each image and video with its
    token and grid hints and content hash (in prompt order), an assistant's
    calls, a tool result's call id."""
    item = iter(zip(hints, keys, strict=True))
    out = []
    for message in messages:
        parts: list[wire.ContentPart] = []
        for part in message.parts:
            if isinstance(part, ImagePart | VideoPart):
                (tokens, grid), key = next(item)
                kind = wire.ImagePart if isinstance(part, ImagePart) else wire.VideoPart
                parts.append(kind(tokens, key, grid))
            else:
                parts.append(part.text)
        calls = tuple(
            wire.ToolCall(c.id, c.function.name, c.function.arguments)
            for c in message.tool_calls or []
        )
        role = "system" if message.role == "developer" else message.role
        out.append(wire.ChatMessage(role, tuple(parts), calls, message.tool_call_id or ""))
    return tuple(out)


async def completion_calls(
    backend: GenerationBackend, body: CompletionRequest, record: RequestRecord
) -> list[GenerateCall]:
    """One call per prompt (its choice index); text-only, no chat template."""
    record.model = body.model
    await backend.check_model(body.model)
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
                cache_salt=body.cache_salt or "",
            ),
            body.model,
            record=record,
            routing_key=body.prompt_cache_key or "",
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


async def parse(request: Request, limit: int, model: type[R]) -> R:
    """The body as `model`, or the 400 (413) that says what is wrong with it."""
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
