"""Tool calls in the format Qwen2.5(-VL) and Qwen3(-VL) are trained on (Hermes'):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Three things: the grammar that forces calls (tool_choice "required" or a named
function: xgrammar's structural tag for this format, compiled by the language
instance); the check that each function's parameters are a schema the grammar
compiler takes; and ToolCallStream, which splits an output (whole or as it
streams) into content and calls. A block that opens as a call
(`{"name": ..., "arguments": `) is that call, its arguments streamed as they
are written, exactly as the model wrote them (OpenAI's arguments are the
model's text too, not always valid JSON); a block that never closed (the
output ran out of tokens) is the call it began, its arguments as far as they
got, as OpenAI returns a call cut by max_tokens, or nothing if not even its
name was written. Only a closed block that holds no call at all stays content,
as it was written.
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


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text of an object (cut short where max_tokens cut it)
    id: str = field(default_factory=call_id)


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
    """A closed block's call where it never showed the usual opening (its keys
    in another order, no arguments), or None where it is not {"name": str,
    "arguments": object}."""
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


@dataclass(frozen=True, slots=True)
class Opened:
    """A call begins: its id and name (its arguments follow as Arguments)."""

    id: str
    name: str


@dataclass(frozen=True, slots=True)
class Arguments:
    """The next fragment of the open call's arguments."""

    text: str


Piece = str | Opened | Arguments  # content, or a call as it is written


def _unsure(arguments: str) -> int:
    """How many characters at the end of arguments still being written may
    turn out to be the block's end rather than arguments: whitespace and
    braces (the call's own closing brace among them), and a block's end begun."""
    kept = arguments
    for length in range(min(len(END) - 1, len(kept)), 0, -1):
        if END.startswith(kept[-length:]):
            kept = kept[:-length]
            break
    return len(arguments) - len(kept.rstrip(" \t\r\n}"))


def _closed_arguments(arguments: str) -> str:
    """A closed block's arguments: what followed the opening, less the call's
    own closing brace."""
    arguments = arguments.rstrip()
    return arguments[:-1].rstrip() if arguments.endswith("}") else arguments


def _cut_arguments(arguments: str) -> str:
    """A block that never closed: its arguments as far as they got (JSON cut short)."""
    arguments = arguments.rstrip()
    for length in range(len(END), 0, -1):  # the block's end, begun but cut
        head = arguments[:-length].rstrip()
        if arguments.endswith(END[:length]) and head.endswith("}"):
            arguments = head
            break
    if arguments.endswith("}") and _is_object(arguments[:-1]):
        arguments = arguments[:-1]  # the call's own closing brace, after whole arguments
    return arguments


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
    begin a block is held until it is known not to. A call is given out as
    it is written: Opened once its name is, then its arguments in fragments,
    each held only while it may be the block's end; every fragment's text
    concatenates to the arguments the whole output gives. Trailing whitespace
    is held until more content follows (so the text between and after calls
    goes nowhere)."""

    def __init__(self) -> None:
        self._text = ""  # not yet given out (in a block: from its START)
        self._in_block = False
        self._call: Opened | None = None  # the call the open block began
        self._arguments_at = 0  # where its arguments start in the block's body
        self._given = 0  # how much of them went out
        self._space = ""  # whitespace-only content, held

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                end = self._text.find(END)
                body = self._text[len(START) : end if end >= 0 else None]
                if end < 0:
                    return out + self._written(body)
                out += self._written(body) + self._closed(self._text[: end + len(END)], body)
                self._text = self._text[end + len(END) :]
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

    def finish(self) -> list[Piece]:
        """The rest: an unclosed block is the call it began, its arguments as
        far as they got, or nothing if not even its name was written; the
        start of a block's opening, cut there, goes nowhere."""
        rest, self._text = self._text, ""
        if not self._in_block:
            return self._content(rest[: len(rest) - _held(rest)])
        out = self._written(rest[len(START) :], final=True)
        if self._call is not None:
            arguments = _cut_arguments(rest[len(START) + self._arguments_at :])
            out += self._more(arguments)
        self._in_block, self._call = False, None
        return out

    def _written(self, body: str, final: bool = False) -> list[Piece]:
        """An open block's news: its call opened once the name and the start of
        the arguments are in (at the `final` end: the name), then what of its
        arguments is sure."""
        out: list[Piece] = []
        if self._call is None:
            opening = _OPENING.match(body)
            if opening is None or (opening.end() == len(body) and not final):
                return out  # more space may follow
            self._call = Opened(call_id(), json.loads(f'"{opening.group(1)}"'))
            self._arguments_at, self._given = opening.end(), 0
            out.append(self._call)
        arguments = body[self._arguments_at :]
        return out + self._more(arguments[: len(arguments) - _unsure(arguments)])

    def _closed(self, block: str, body: str) -> list[Piece]:
        """A block that closed: the rest of the call it began, or the call it
        holds in another form, or, where it holds none, the block as content."""
        self._in_block, call = False, self._call
        if call is not None:
            self._call = None
            return self._more(_closed_arguments(body[self._arguments_at :]))
        whole = _call(body.strip())
        if whole is None:
            return self._content(block)
        return [Opened(whole.id, whole.name), Arguments(whole.arguments)]

    def _more(self, arguments: str) -> list[Piece]:
        """The open call's arguments beyond what went out."""
        fragment, self._given = arguments[self._given :], max(self._given, len(arguments))
        return [Arguments(fragment)] if fragment else []

    def _content(self, text: str) -> list[Piece]:
        """Content, less its trailing whitespace, which is held until more content
        follows: whitespace before a block, or at the end, goes nowhere."""
        kept = text.rstrip()
        if not kept:
            self._space += text
            return []
        kept, self._space = self._space + kept, text[len(kept) :]
        return [kept]


def calls_of(pieces: list[Piece]) -> tuple[str | None, list[Call]]:
    """Pieces put together: the content (None if there is none) and the calls."""
    content, calls = "", []
    for piece in pieces:
        if isinstance(piece, Opened):
            calls.append(Call(piece.name, "", piece.id))
        elif isinstance(piece, Arguments):
            last = calls[-1]
            calls[-1] = Call(last.name, last.arguments + piece.text, last.id)
        else:
            content += piece
    return content or None, calls


def split(text: str) -> tuple[str | None, list[Call]]:
    """A whole output's content (None if there is none) and calls, exactly as
    ToolCallStream gives them out."""
    stream = ToolCallStream()
    return calls_of(stream.feed(text) + stream.finish())


def message_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """Calls as a chat completion's `message.tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
