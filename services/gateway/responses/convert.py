"""The Responses API as a translation: a request (and the stored conversation it
continues) read into the ChatCompletionRequest the chat path takes, and back:
a Response object's fields, and its output items as the chat messages a later
turn sends to the template."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ValidationError

from services.gateway.errors import ApiError
from services.gateway.protocol import ChatCompletionRequest, validation_error
from services.gateway.responses.protocol import (
    FunctionCall,
    FunctionCallOutput,
    InputImage,
    InputText,
    Item,
    Message,
    OutputText,
    Refusal,
    ResponsesRequest,
    SchemaFormat,
)

Messages = list[dict[str, Any]]  # chat messages, as the chat API takes them


def chat_request(
    body: ResponsesRequest, history: Messages
) -> tuple[ChatCompletionRequest, Messages]:
    """The chat request this one is, and its conversation: the stored `history`
    it continues, then its input, as chat messages (the instructions are this
    request's alone, as OpenAI's are: they are not carried to the next turn)."""
    conversation = history + _messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    payload: dict[str, Any] = {
        "model": body.model,
        "messages": system + conversation,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "cache_salt": body.cache_salt,
        "prompt_cache_key": body.prompt_cache_key,
        "response_format": _response_format(body),
        "tool_choice": _dumped(body.tool_choice),
        "tools": [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools or []
        ]
        or None,
    }
    if isinstance(body.tool_choice, BaseModel):
        payload["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in payload.items() if v is not None}
        )
    except ValidationError as exc:
        raise ApiError(400, *validation_error(exc.errors())) from None
    return chat, conversation


def _dumped(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, exclude_none=True)
    return value


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """text.format as the chat API's response_format."""
    form = body.text.format if body.text is not None else None
    if isinstance(form, SchemaFormat):
        schema = form.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": schema}
    return _dumped(form)


def _messages(given: str | list[Item]) -> Messages:
    """The input as chat messages: a function_call joins the assistant message
    before it (the chat API's calls are an assistant message's), its output is
    a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: Messages = []
    for item in given:
        if isinstance(item, FunctionCall):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        elif item.role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(item)})
        else:
            out.append({"role": item.role, "content": [_chat_part(p) for p in item.parts]})
    return out


def _assistant_text(message: Message) -> str:
    texts = []
    for part in message.parts:
        if isinstance(part, InputImage):
            raise ApiError(400, "an assistant message holds text, not images", param="input")
        texts.append(part.refusal if isinstance(part, Refusal) else part.text)
    return "".join(texts)


def _chat_part(part: Any) -> dict[str, Any]:
    if isinstance(part, InputImage):
        url = {"url": part.image_url, **({"detail": part.detail} if part.detail else {})}
        return {"type": "image_url", "image_url": url}
    text = part.refusal if isinstance(part, Refusal) else part.text
    return {"type": "text", "text": text}


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the chat message a later turn sends."""
    texts = [
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def response_object(response_id: str, body: ResponsesRequest, created_at: float) -> dict[str, Any]:
    """A Response, in progress: what the request asked for, no output yet."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "cache_salt": body.cache_salt,
        "prompt_cache_key": body.prompt_cache_key,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p or 1.0,
        "text": {"format": {"type": "text"}, **text},
        "tool_choice": _dumped(body.tool_choice) or ("auto" if body.tools else "none"),
        "tools": [_dumped(tool) for tool in body.tools or []],
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": None,
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def input_items(given: str | list[Item]) -> list[dict[str, Any]]:
    """The input as GET /v1/responses/{id}/input_items lists it: each item with
    an id of its own and a message's text as content parts."""
    items: list[Item] = [Message(role="user", content=given)] if isinstance(given, str) else given
    listed = []
    for item in items:
        if isinstance(item, Message):
            parts = [_listed_part(part) for part in item.parts]
            fields = {"type": "message", "role": item.role, "content": parts}
            prefix = "msg"
        elif isinstance(item, FunctionCall):
            fields = {"type": "function_call", "call_id": item.call_id, "name": item.name}
            fields["arguments"], prefix = item.arguments, "fc"
        else:
            fields = {"type": "function_call_output", "call_id": item.call_id}
            fields["output"], prefix = item.text, "fco"
        listed.append({"id": f"{prefix}_{secrets.token_hex(12)}", **fields, "status": "completed"})
    return listed


def _listed_part(part: InputText | InputImage | OutputText | Refusal) -> dict[str, Any]:
    dumped = part.model_dump(exclude_none=True)
    return {**dumped, "annotations": []} if isinstance(part, OutputText) else dumped


def items_page(
    items: list[dict[str, Any]], order: str, limit: int, after: str | None
) -> dict[str, Any]:
    """A page of listed items, as OpenAI's list endpoints give one."""
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, not {order!r}", param="order")
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be in [1, 100], not {limit}", param="limit")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
