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
output ran out of tokens) is the call it began once its name is written, its
arguments as far as they got, as OpenAI returns a call cut by max_tokens (a
named tool_choice's call even before that). Whatever did not become a call is
content, character for character: what the chat template renders from content
and calls splits back into them.
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
# ... and of a block cut after its name: {"name": "..."
_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


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


def _sure_end(text: str, start: int, stop: int) -> int:
    """Where the arguments in text[start:stop], still being written, surely end:
    before what may turn out to be the block's end rather than arguments (a
    block's end begun, and the whitespace and braces before it, the call's own
    closing brace among them). It reads only that end of them."""
    end = stop
    for length in range(min(len(END) - 1, stop - start), 0, -1):
        if text.startswith(END[:length], stop - length):
            end = stop - length
            break
    while end > start and text[end - 1] in " \t\r\n}":
        end -= 1
    return end


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


@dataclass(frozen=True, slots=True)
class Forced:
    """A forced tool_choice: the output is calls only; `name`: the function a
    named choice calls ("" for "required")."""

    name: str = ""


class ToolCallStream:
    """Text in, as it comes; content and calls out, in order. Text is held back
    only while it may still be the template's: the start of a block, a newline
    just before one (the chat template's separator), and whitespace after a
    call (the end of the calls). A call is given out as it is written: Opened
    once its name is, then its arguments in fragments, each held only while it
    may be the block's end; every fragment's text concatenates to the arguments
    the whole output gives. At the end, whatever did not become a call is
    content, character for character, but the whitespace after the last call;
    where a forced tool_choice held the output to calls, a block that never
    became one is not content either (and a named choice's call is that
    function's even where the output was cut before its name was written)."""

    def __init__(self, forced: Forced | None = None) -> None:
        # Not yet given out: outside a block, what may begin one; in a block, from
        # its START, and once its call opened, from the arguments not given out
        # (so that each token costs what it adds: linear in the arguments' length)
        self._text = ""
        self._in_block = False
        self._call: Opened | None = None  # the call the open block began
        self._at = 0  # where in _text its arguments not yet given out start
        self._given: list[str] = []  # its arguments' fragments given out
        self._scan = 0  # where in _text the block's END may begin
        self._space = ""  # content held: a final newline, or whitespace after a call
        self._after_call = False  # the last thing given out is a call
        self._forced = forced
        self._called = False  # a call was given out

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                end = self._text.find(END, self._scan)
                if end < 0:
                    out += self._written(len(self._text))
                    self._keep_unsure()
                    return out
                out += self._written(end) + self._closed(end)
                self._text, self._scan = self._text[end + len(END) :], 0
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
        """The rest: an unclosed block is the call it began, its arguments as far
        as they got, once its name is written; else it is content, as is the
        start of a block's opening (but for a forced output)."""
        out: list[Piece] = []
        if self._in_block:
            self._in_block = False
            out += self._written(len(self._text), final=True)
            if self._call is not None:
                given = "".join(self._given)
                arguments = _cut_arguments(given + self._text[self._at :])
                self._call, self._text = None, ""
                return out + self._fragment(arguments[len(given) :])
        rest, self._text = self._text, ""
        if self._forced is not None:  # what is not a call is the calls' markup
            named = self._forced.name and not self._called
            return out + ([Opened(call_id(), self._forced.name)] if named else [])
        out += self._content(rest)
        if not self._after_call:
            out += [self._space] if self._space else []
        self._space = ""
        return out

    def _written(self, stop: int, final: bool = False) -> list[Piece]:
        """An open block's news, up to `stop` in _text: its call opened once the
        name and the start of the arguments are in (at the `final` end: once the
        name is), then what of its arguments is sure."""
        out: list[Piece] = []
        if self._call is None:
            opening = _OPENING.match(self._text, len(START), stop)
            if opening is None and final:
                opening = _NAMED.match(self._text, len(START), stop)
            if opening is None or (opening.end() == stop and not final):
                return out  # more space may follow
            self._call = self._opened(json.loads(f'"{opening.group(1)}"'))
            self._at = opening.end() if opening.re is _OPENING else stop
            out.append(self._call)
        sure = _sure_end(self._text, self._at, stop)
        fragment, self._at = self._text[self._at : sure], max(self._at, sure)
        return out + self._fragment(fragment)

    def _keep_unsure(self) -> None:
        """An open call's arguments given out leave _text (and the END search
        goes on from where it stopped)."""
        self._scan = max(0, len(self._text) - len(END) + 1)
        if self._call is not None:
            self._text = self._text[self._at :]
            self._scan, self._at = max(0, self._scan - self._at), 0

    def _opened(self, name: str) -> Opened:
        """A call begins: the newline before its block was the template's."""
        self._space, self._after_call, self._called, self._given = "", True, True, []
        return Opened(call_id(), name)

    def _closed(self, end: int) -> list[Piece]:
        """A block that closed at `end` in _text: the rest of the call it began,
        or the call it holds in another form, or, where it holds none, the block
        as content."""
        self._in_block, call = False, self._call
        if call is not None:
            self._call = None
            return self._fragment(_closed_arguments(self._text[self._at : end]))
        whole = _call(self._text[len(START) : end].strip())
        if whole is None:
            return self._content(self._text[: end + len(END)])
        return [self._opened(whole.name), Arguments(whole.arguments)]

    def _fragment(self, text: str) -> list[Piece]:
        """The next fragment of the open call's arguments."""
        if not text:
            return []
        self._given.append(text)
        return [Arguments(text)]

    def _content(self, text: str) -> list[Piece]:
        """Content, less what may still be the template's: a final newline (a
        block may follow), and whitespace right after a call."""
        text, self._space = self._space + text, ""
        if self._after_call and not text.strip():
            self._space = text
            return []
        if text.endswith("\n"):
            text, self._space = text[:-1], "\n"
        if text:
            self._after_call = False
        return [text] if text else []


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


def split(text: str, forced: Forced | None = None) -> tuple[str | None, list[Call]]:
    """A whole output's content (None if there is none) and calls, exactly as
    ToolCallStream gives them out."""
    stream = ToolCallStream(forced)
    return calls_of(stream.feed(text) + stream.finish())


def message_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """Calls as a chat completion's `message.tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
