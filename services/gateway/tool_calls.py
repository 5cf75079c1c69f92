"""Tool calls in the format Qwen2.5(-VL) and Qwen3(-VL) are trained on (Hermes'):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Three things: the grammar that forces calls (tool_choice "required" or a named
function: xgrammar's structural tag for this format, compiled by the language
instance); the check that each function's parameters are a schema the grammar
compiler takes; and ToolCallStream, which splits an output (whole or as it
streams) into content and calls. A closed block that does not parse as a call
stays content, as it was written; a block that never closed (the output ran out
of tokens) is the call it began, its arguments as far as they got, as OpenAI
returns a call cut by max_tokens, or nothing if not even its name was written:
template markup never reaches the content.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


def structural_tag(tools: list[Any], choice: Any, parallel: bool) -> str:
    """The structural tag (JSON) that holds the whole output to calls of `tools`:
    one or more for "required" (one unless `parallel`), exactly one of the
    named function for {"type": "function", "function": {"name": ...}}; nothing
    after the last call but the end."""
    tag = xgr.get_model_structural_tag(
        "qwen_3",  # Hermes' format, which Qwen2.5-VL uses too
        tools=tools,
        tool_choice=choice,
        reasoning="disabled",
        parallel_tool_calls=parallel,
        max_whitespace_cnt=1,  # a weak model must not pad its arguments forever
    )
    if isinstance(tag.format, xgr.structural_tag.TriggeredTagsFormat):
        # "required": its calls may have text between and after them, which a
        # random-weight demo writes to max_tokens; OpenAI's and vLLM's end after
        # the calls. Calls one after the other, as the chat template writes them.
        tag.format = xgr.structural_tag.TagsWithSeparatorFormat(
            tags=tag.format.tags, separator="\n", at_least_one=True, stop_after_first=not parallel
        )
    return str(tag.model_dump_json())


@functools.lru_cache(maxsize=256)
def schema_error(parameters: str) -> str | None:
    """Why the grammar compiler refuses a function's parameters (JSON), or None."""
    try:
        xgr.Grammar.from_json_schema(parameters)
    except (RuntimeError, ValueError, TypeError) as exc:
        return str(exc).strip().rpartition("] ")[2] or str(exc)
    return None


def _call(body: str) -> Call | None:
    """A block's call, or None where it is not {"name": str, "arguments": object}."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))


# What a block holds before its arguments: {"name": "...", "arguments":
_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _cut_call(body: str) -> Call | None:
    """The call a block that never closed began: its name and its arguments as
    far as they got (JSON cut short), or None if its name was not written yet."""
    opening = _OPENING.match(body)
    if opening is None:
        return None
    name = json.loads(f'"{opening.group(1)}"')
    arguments = body[opening.end() :].rstrip()
    for length in range(len(END), 0, -1):  # the block's end, begun but cut
        head = arguments[:-length].rstrip()
        if arguments.endswith(END[:length]) and head.endswith("}"):
            arguments = head
            break
    if arguments.endswith("}") and _is_object(arguments[:-1]):
        arguments = arguments[:-1]  # the call's own closing brace, after whole arguments
    return Call(name, arguments)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _held(text: str) -> int:
    """How many characters at the end of `text` may begin a block."""
    for length in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-length:]):
            return length
    return 0


class ToolCallStream:
    """Text in, as it comes; content and calls out, in order. Text that may
    begin a block is held until it is known not to, and a block is given out
    when it closes. Trailing whitespace is held until more content follows (so
    the text between and after calls goes nowhere)."""

    def __init__(self) -> None:
        self._text = ""  # not yet given out
        self._in_block = False
        self._space = ""  # whitespace-only content, held

    def feed(self, text: str) -> list[str | Call]:
        self._text += text
        out: list[str | Call] = []
        while True:
            if self._in_block:
                end = self._text.find(END)
                if end < 0:
                    return out
                block, self._text = self._text[: end + len(END)], self._text[end + len(END) :]
                self._in_block = False
                call = _call(block[len(START) : -len(END)].strip())
                out += [call] if call is not None else self._content(block)
                continue
            start = self._text.find(START)
            if start >= 0:
                out += self._content(self._text[:start])
                self._text, self._in_block = self._text[start:], True
                continue
            cut = len(self._text) - _held(self._text)
            out += self._content(self._text[:cut])
            self._text = self._text[cut:]
            return out

    def finish(self) -> list[str | Call]:
        """The rest: an unclosed block is the call it began (_cut_call); the start
        of a block's opening, cut there, goes nowhere."""
        rest, self._text, block = self._text, "", self._in_block
        self._in_block = False
        if block:
            call = _cut_call(rest[len(START) :])
            return [call] if call is not None else []
        return self._content(rest[: len(rest) - _held(rest)])

    def _content(self, text: str) -> list[str | Call]:
        """Content, less its trailing whitespace, which is held until more content
        follows: whitespace before a block, or at the end, goes nowhere."""
        kept = text.rstrip()
        if not kept:
            self._space += text
            return []
        kept, self._space = self._space + kept, text[len(kept) :]
        return [kept]


def split(text: str) -> tuple[str | None, list[Call]]:
    """A whole output's content (None if there is none) and calls, exactly as
    ToolCallStream gives them out."""
    stream = ToolCallStream()
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, Call)]


def message_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """Calls as a chat completion's `message.tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def call_deltas(call: Call, index: int) -> list[dict[str, Any]]:
    """One call as streamed deltas: its id and name, then its arguments."""
    opening = {"name": call.name, "arguments": ""}
    return [
        {"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": opening}]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]
