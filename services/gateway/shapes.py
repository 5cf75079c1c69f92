"""What the gateway answers: OpenAI's response shapes (a chat completion, a text
completion, a stream chunk, usage and logprobs), and a call's whole output collected
from the language instance's responses (streaming.py sends them as they come)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from services.gateway.backend import GenerateCall, Responses
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.tool_calls import Forced, message_calls, split
from services.wire import request as wire
from services.wire.request import FinishReason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: of the prompt's, those the prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprob_content(entries: list[Any]) -> list[dict[str, Any]]:
    """GenerateChunk TokenLogprobs -> OpenAI's `logprobs.content`."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                for t in e.top
            ],
        }
        for e in entries
    ]


def completion(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any]
) -> dict[str, Any]:
    """A chat completion; each choice from chat_choice()."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str,
    logprobs: list[dict[str, Any]] | None,
    tool_calls: bool = False,
    forced: Forced | None = None,
) -> dict[str, Any]:
    """One choice; with `tool_calls`, its calls parsed out of the text (tool_calls.py)."""
    content, calls = split(text, forced) if tool_calls else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = message_calls(calls)
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": called(finish_reason, bool(calls)),
    }


def called(reason: str, calls: bool) -> str:
    """A choice's finish reason: "tool_calls" where it called tools and stopped."""
    return "tool_calls" if calls and reason == FinishReason.STOP else reason


def text_logprobs(entries: list[Any]) -> dict[str, Any]:
    """GenerateChunk TokenLogprobs -> the legacy completions `logprobs`."""
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def text_completion(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None
) -> dict[str, Any]:
    """A /v1/completions response or stream chunk; each choice {index, text,
    logprobs, finish_reason}."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason,
            }
        ],
    }


def count(
    metrics: GatewayMetrics,
    call: GenerateCall,
    response: wire.GenerateResponse,
    done: wire.GenerateComplete,
) -> None:
    """Token counters, from each choice's completion (the prompt counts once)."""
    if response.index == 0:
        metrics.prompt_tokens.inc(done.prompt_tokens)
        call.record.prompt_tokens += done.prompt_tokens
        call.record.cached_tokens += done.cached_tokens
    metrics.completion_tokens.inc(done.completion_tokens)
    call.record.completion_tokens += done.completion_tokens


def first_token(metrics: GatewayMetrics, call: GenerateCall, started: float) -> None:
    seconds = time.monotonic() - started
    metrics.ttft.observe(seconds)
    if call.record.ttft_ms is None:
        call.record.ttft_ms = seconds * 1000


def choice_index(response: wire.GenerateResponse, n: int) -> int:
    if response.index >= n:
        raise ApiError(500, f"the language instance sent choice {response.index} of {n}")
    return response.index


async def responses(first: wire.GenerateResponse, stream: Responses) -> Responses:
    """The first response, then the rest of the stream."""
    yield first
    async for response in stream:
        yield response


@dataclass(frozen=True, slots=True)
class Generated:
    """One choice's whole output."""

    text: str
    logprobs: list[Any]  # TokenLogprob messages
    finish_reason: wire.FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


def usage_of(choices: list[Generated]) -> dict[str, Any]:
    """The prompt once, every choice's completion."""
    first = choices[0]
    return usage(
        first.prompt_tokens, sum(c.completion_tokens for c in choices), first.cached_tokens
    )


async def collect(
    metrics: GatewayMetrics,
    call: GenerateCall,
    stream: Responses,
    first: wire.GenerateResponse,
    started: float,
) -> list[Generated]:
    """Every choice's output, in choice order."""
    n = max(1, call.sampling.n)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[Any]] = [[] for _ in range(n)]
    done: dict[int, Generated] = {}
    seen = False
    async for response in responses(first, stream):
        index = choice_index(response, n)
        match response.kind:
            case wire.GenerateChunk() as c:
                if not seen:
                    first_token(metrics, call, started)
                    seen = True
                texts[index].append(c.text)
                logprobs[index] += list(c.logprobs)
            case wire.GenerateComplete() as end:
                count(metrics, call, response, end)
                done[index] = Generated(
                    "".join(texts[index]),
                    logprobs[index],
                    end.finish_reason,
                    end.prompt_tokens,
                    end.completion_tokens,
                    end.cached_tokens,
                )
                if len(done) == n:
                    return [done[i] for i in range(n)]
    raise ApiError(500, "the language instance ended the stream without completing")
