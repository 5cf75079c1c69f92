"""A Response's output written as the model writes it, and its stream of events.

ResponseOutput takes the output text as it comes and keeps the Response's
items: text goes into a message item, each tool call (tool_calls.py) into a
function_call item, in the order written. Each step is also an event of the
documented sequence (response.created, response.in_progress, then per item
response.output_item.added, response.content_part.added,
response.output_text.delta | response.function_call_arguments.delta, ...done,
response.output_item.done; last response.completed, .incomplete or .failed).
A whole response is the same builder fed the whole text, its events unsent:
streamed or not, the output is the same.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.gateway.backend import GenerateCall, Responses
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.responses.convert import response_object, response_usage
from services.gateway.responses.protocol import ResponsesRequest
from services.gateway.shapes import count, first_token, responses
from services.gateway.tool_calls import Arguments, Forced, Opened, Piece, ToolCallStream
from services.wire import request as wire


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseOutput:
    """One response's items, built from its text; when `streamed`, `events` holds
    the SSE lines of each step not yet sent (a whole response makes none)."""

    def __init__(
        self,
        response_id: str,
        body: ResponsesRequest,
        tool_calls: bool,
        streamed: bool = True,
        forced: Forced | None = None,
    ) -> None:
        self.response = response_object(response_id, body, time.time())
        self.streamed = streamed
        self.events: list[str] = []
        self._calls = ToolCallStream(forced) if tool_calls else None
        self._open: dict[str, Any] | None = None  # the item being written
        self._sequence = 0
        self._emit("response.created", response=self.response)
        self._emit("response.in_progress", response=self.response)

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def text(self, text: str) -> None:
        pieces: list[Piece] = (
            self._calls.feed(text) if self._calls is not None else [text] if text else []
        )
        for piece in pieces:
            self._piece(piece)

    def finish(self, done: wire.GenerateComplete) -> None:
        """The output's end: what was held, the last item closed, the Response
        completed (or incomplete: max_output_tokens) with its usage."""
        for piece in self._calls.finish() if self._calls is not None else []:
            self._piece(piece)
        if not self.output:
            self._message()  # nothing written: an empty message, as OpenAI's
        cut = done.finish_reason == wire.FinishReason.LENGTH
        self._close("incomplete" if cut else "completed")
        self.response["status"] = "incomplete" if cut else "completed"
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = response_usage(
            done.prompt_tokens, done.completion_tokens, done.cached_tokens
        )
        self._emit(f"response.{self.response['status']}", response=self.response)

    def failed(self, error: ApiError) -> None:
        self._close("incomplete")
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": error.message}
        self._emit("response.failed", response=self.response)

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def _piece(self, piece: Piece) -> None:
        if isinstance(piece, Opened):
            self._close("completed")
            self._add(
                {
                    "id": _item_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": piece.id,
                    "name": piece.name,
                    "arguments": "",
                }
            )
        elif isinstance(piece, Arguments):
            item = self._open
            assert item is not None and item["type"] == "function_call"
            item["arguments"] += piece.text
            self._emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                delta=piece.text,
            )
        else:
            item = self._message()
            item["content"][0]["text"] += piece
            self._emit(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=piece,
                logprobs=[],
            )

    def _message(self) -> dict[str, Any]:
        """The message item being written, opened if another is."""
        if self._open is not None and self._open["type"] == "message":
            return self._open
        self._close("completed")
        item: dict[str, Any] = {
            "id": _item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        self._emit("response.content_part.added", **where, part=part)
        return item

    def _add(self, item: dict[str, Any]) -> None:
        self.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=item)

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part, where = item["content"][0], {**where, "content_index": 0}
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, part=part)
        else:
            self._emit(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=item)

    def _emit(self, kind: str, **fields: Any) -> None:
        """An event, serialized now (the items it shows change later)."""
        if not self.streamed:
            return
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        self.events.append(f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n")


async def response_events(
    metrics: GatewayMetrics,
    call: GenerateCall,
    stream: Responses,
    first: wire.GenerateResponse,
    output: ResponseOutput,
    started: float,
    keep: Callable[[ResponseOutput], None],
) -> AsyncIterator[str]:
    """The SSE lines of a response whose first GenerateResponse is in; `keep`
    stores it once complete. The stream is closed (the request aborted
    downstream) whatever ends them."""
    seen_text = False
    try:
        for event in output.take():
            yield event
        async for response in responses(first, stream):
            match response.kind:
                case wire.GenerateChunk() as chunk:
                    if not seen_text and chunk.text:
                        first_token(metrics, call, started)
                        seen_text = True
                    output.text(chunk.text)
                case wire.GenerateComplete() as done:
                    count(metrics, call, response, done)
                    output.finish(done)
                    keep(output)
            for event in output.take():
                yield event
            if output.response["status"] != "in_progress":
                return
        raise ApiError(500, "the language instance ended the stream without completing")
    except ApiError as exc:  # after the response started: it travels in the stream
        call.record.error, call.record.component = exc.message, exc.component
        output.failed(exc)
        for event in output.take():
            yield event
    finally:
        await stream.aclose()
