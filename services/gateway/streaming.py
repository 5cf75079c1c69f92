"""Server-sent events: a call's responses as OpenAI's stream of chunks (chat
deltas, tool calls as they are written, text completion pieces, usage), and an error
after the stream started as an event in it."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from services.gateway.backend import GenerateCall, Responses
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.shapes import (
    called,
    choice_index,
    chunk,
    count,
    first_token,
    logprob_content,
    responses,
    text_completion,
    text_logprobs,
    usage,
)
from services.gateway.tool_calls import Arguments, Forced, Opened, Piece, ToolCallStream
from services.wire import request as wire


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Deltas:
    """One chat choice's deltas: its text as content, or, where the output is
    parsed for tool calls, content and calls as they are written (tool_calls.py):
    a call's id and name, then its arguments in fragments."""

    def __init__(self, tool_calls: bool, forced: Forced | None) -> None:
        self.stream = ToolCallStream(forced) if tool_calls else None
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

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, Opened):
                function = {"name": piece.name, "arguments": ""}
                opened = {"index": self.calls, "id": piece.id, "type": "function"}
                out.append({"tool_calls": [{**opened, "function": function}]})
                self.calls += 1
            elif isinstance(piece, Arguments):
                fragment = {"index": self.calls - 1, "function": {"arguments": piece.text}}
                out.append({"tool_calls": [fragment]})
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


async def events(
    metrics: GatewayMetrics,
    call: GenerateCall,
    stream: Responses,
    first: wire.GenerateResponse,
    include_usage: bool,
    started: float,
) -> AsyncIterator[str]:
    """The SSE lines of a call whose first response is in; the stream is closed
    (the request aborted downstream) whatever ends them."""
    created = int(time.time())
    n = max(1, call.sampling.n)
    seen_text = False
    going, completion_tokens = n, 0
    deltas = [_Deltas(call.tool_calls, call.forced) for _ in range(n)]
    try:
        if not call.is_completion:
            opening = {"role": "assistant", "content": ""}
            for index in range(n):
                yield _event(chunk(call.request_id, call.model, created, opening, index=index))
        async for response in responses(first, stream):
            index = choice_index(response, n)
            match response.kind:
                case wire.GenerateChunk() as c:
                    if not seen_text and c.text:
                        first_token(metrics, call, started)
                        seen_text = True
                    if c.text or (call.sampling.logprobs and c.logprobs):
                        entries = list(c.logprobs)
                        for piece in _pieces(call, created, index, c.text, entries, deltas[index]):
                            yield _event(piece)
                case wire.GenerateComplete() as done:
                    count(metrics, call, response, done)
                    for piece in _closing(call, created, index, done.finish_reason, deltas[index]):
                        yield _event(piece)
                    going -= 1
                    completion_tokens += done.completion_tokens
                    if include_usage and not going:
                        body = chunk(call.request_id, call.model, created, {})
                        kind = "text_completion" if call.is_completion else body["object"]
                        body["object"] = kind
                        body["choices"] = []
                        body["usage"] = usage(
                            done.prompt_tokens, completion_tokens, done.cached_tokens
                        )
                        yield _event(body)
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # a failure after the response started: it travels in the stream
        call.record.error, call.record.component = exc.message, exc.component
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # a client that left mid-stream aborts the request downstream
