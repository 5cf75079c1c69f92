"""The tool-call parser on fixed model outputs: whole, and streamed in pieces of
every size, which must give out the same content and calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tool_calls import Call, ToolCallStream, split

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "é"]}}\n</tool_call>'

OUTPUTS: dict[str, tuple[str, str | None, list[tuple[str, dict[str, object]]]]] = {
    "text only": ("The weather is fine.", "The weather is fine.", []),
    "one call": (WEATHER, None, [("get_weather", {"city": "Paris"})]),
    "two calls": (
        WEATHER + "\n" + ADD,
        None,
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, "é"]})],
    ),
    "text around a call": (
        "Let me look.\n" + WEATHER + "\nDone.",
        "Let me look.\n\nDone.",
        [("get_weather", {"city": "Paris"})],
    ),
    "a malformed block stays text": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        [],
    ),
    "a block without a name stays text": (
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    "an unclosed block stays text": (
        'Sure: <tool_call>\n{"name": "add", "argu',
        'Sure: <tool_call>\n{"name": "add", "argu',
        [],
    ),
    "what only looks like a block's start": ("a <tool_ca", "a <tool_ca", []),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
}


def _calls(calls: list[Call]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_an_output_splits_into_content_and_calls(name: str) -> None:
    text, content, calls = OUTPUTS[name]
    got_content, got_calls = split(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert all(c.id.startswith("call_") for c in got_calls)


def _streamed(text: str, cuts: list[int]) -> tuple[str | None, list[Call]]:
    stream = ToolCallStream()
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += stream.feed(text[start:end])
    pieces += stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, Call)]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(OUTPUTS)), st.data())
def test_streamed_in_any_pieces_it_gives_the_same(name: str, data: st.DataObject) -> None:
    text = OUTPUTS[name][0]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    content, calls = _streamed(text, [c for c in cuts if c < len(text)])
    whole_content, whole_calls = split(text)
    assert content == whole_content
    assert _calls(calls) == _calls(whole_calls)


def test_a_call_is_given_out_when_its_block_closes() -> None:
    stream = ToolCallStream()
    assert stream.feed("Checking. <tool") == ["Checking. "]
    assert stream.feed('_call>{"name": "now", "arguments": {}}') == []
    (call,) = stream.feed("</tool_call>")
    assert isinstance(call, Call) and call.name == "now"
    assert stream.feed("\n") == []  # whitespace between calls goes nowhere
    assert stream.finish() == []
