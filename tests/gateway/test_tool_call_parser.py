"""The tool-call parser on fixed model outputs: whole, and streamed in pieces of
every size, which must give out the same content and calls."""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tool_calls import (
    START,
    Arguments,
    Call,
    Forced,
    Opened,
    ToolCallStream,
    calls_of,
    split,
)
from services.launcher.protogen import REPO_ROOT

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
        "Let me look.\nDone.",  # the newline before a call is the template's
        [("get_weather", {"city": "Paris"})],
    ),
    "malformed arguments are the call's, as written": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        None,
        [("get_weather", '{"city":')],
    ),
    "a malformed block with no call stays text": (
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        [],
    ),
    "keys in another order": (
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
        None,
        [("f", {"x": 1})],
    ),
    "a block without a name stays text": (
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    "a block cut after its name is its call, with no arguments yet": (
        'Sure: <tool_call>\n{"name": "add", "argu',
        "Sure: ",
        [("add", "")],
    ),
    "a block cut before its name is content": (
        'Sure: <tool_call>\n{"na',
        'Sure: <tool_call>\n{"na',
        [],
    ),
    "a block's opening cut short is content": ("a <tool_ca", "a <tool_ca", []),
    "a trailing < is content": ("if a <", "if a <", []),
    "a trailing </ is content": ("if a </", "if a </", []),
    "trailing whitespace is content": ("Done. \n\n", "Done. \n\n", []),
    "whitespace after the last call is not": (
        WEATHER + "\n",
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "nested arguments, spaced out": (
        '<tool_call> {"name": "f", "arguments":  {"a": {"b": "}"}} }\n\n</tool_call>',
        None,
        [("f", {"a": {"b": "}"}})],
    ),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    "a call cut by max_tokens is a call with its arguments so far": (
        WEATHER + "\n" + '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2',
        None,
        [("get_weather", {"city": "Paris"}), ("add", '{"a": 1, "b": [2')],
    ),
}


def _calls(calls: list[Call]) -> list[tuple[str, object]]:
    """Each call's name and arguments (parsed where they are whole JSON)."""
    return [(c.name, _arguments(c.arguments)) for c in calls]


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # cut short: as far as it got


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_an_output_splits_into_content_and_calls(name: str) -> None:
    text, content, calls = OUTPUTS[name]
    got_content, got_calls = split(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert all(c.id.startswith("call_") for c in got_calls)


def _streamed(
    text: str, cuts: list[int], forced: Forced | None = None
) -> tuple[str | None, list[Call]]:
    stream = ToolCallStream(forced)
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += stream.feed(text[start:end])
    pieces += stream.finish()
    return calls_of(pieces)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(OUTPUTS)), st.data())
def test_streamed_in_any_pieces_it_gives_the_same(name: str, data: st.DataObject) -> None:
    text = OUTPUTS[name][0]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    content, calls = _streamed(text, [c for c in cuts if c < len(text)])
    whole_content, whole_calls = split(text)
    assert content == whole_content
    # each call's fragments concatenate to the arguments of the whole, to the character
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_a_call_is_given_out_as_it_is_written() -> None:
    """Its name as soon as its arguments begin; each fragment of them once it
    cannot be the block's end; the rest when the block closes."""
    stream = ToolCallStream()
    assert stream.feed("Checking. <tool") == ["Checking. "]  # "<tool" may begin a block
    assert stream.feed('_call>{"name": "now", "arguments": ') == []  # more space may follow
    (opened, first) = stream.feed('{"tz": "UTC"')
    assert isinstance(opened, Opened) and opened.name == "now" and opened.id.startswith("call_")
    assert first == Arguments('{"tz": "UTC"')
    assert stream.feed("}}\n</tool") == []  # the argument's brace or the call's
    assert stream.feed("_call>") == [Arguments("}")]
    assert stream.feed("\n") == []  # whitespace between calls goes nowhere
    assert stream.finish() == []


# A forced output (what the grammar holds "required" to: calls, a newline apart)
FORCED = WEATHER + "\n" + ADD


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(FORCED)), st.data())
def test_a_forced_output_cut_anywhere_and_streamed_anyhow_shows_no_markup(
    cut: int, data: st.DataObject
) -> None:
    """Cut by max_tokens at any point and streamed in any pieces: no content, and
    never the template's markup; the calls are those written, the last as far as
    it got, as the whole output gives them."""
    text = FORCED[:cut]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    content, calls = _streamed(text, [c for c in cuts if c < len(text)], Forced())
    assert content is None or not ({"<tool", "tool_call", "</"} & set(content.split()))
    assert content is None or "<tool_call>" not in content
    cut_calls = split(text, Forced())[1]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in cut_calls]
    whole = [c.arguments for c in split(FORCED, Forced())[1]]
    for call, arguments in zip(calls, whole, strict=False):
        assert arguments.startswith(call.arguments)  # what was cut is a prefix of the whole


def test_a_named_call_cut_before_its_name_is_still_that_call() -> None:
    """A named tool_choice forces the function: cut anywhere, even before its
    name is written, the output is that call with its arguments so far."""
    forced = Forced("get_weather")
    for cut in range(len(WEATHER) + 1):
        content, calls = split(WEATHER[:cut], forced)
        assert content is None
        assert [c.name for c in calls] == ["get_weather"]
        assert '{"city": "Paris"}'.startswith(calls[0].arguments)
    assert [c.name for c in split("", forced)[1]] == ["get_weather"]


# The chat template's own rendering of an assistant turn (services/model/chat_template.jinja,
# with transformers' tojson), less the turn's markers: what a model trained on it writes.
TEMPLATE = (REPO_ROOT / "services/model/chat_template.jinja").read_text()


def _rendered(content: str, calls: list[tuple[str, dict[str, object]]]) -> str:
    environment = jinja2.Environment()
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls],
    }
    turn = environment.from_string(TEMPLATE).render(messages=[message], tools=None)
    return turn.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
CONTENT = st.text(st.sampled_from(list('ab <>/\n\t{}"_toolcal')), max_size=30).filter(
    lambda text: START not in text
)


@settings(max_examples=400, deadline=None)
@given(
    CONTENT,
    st.lists(
        st.tuples(
            st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
            st.dictionaries(st.text(max_size=4), JSON, max_size=3),
        ),
        max_size=3,
    ),
    st.data(),
)
def test_content_and_calls_rendered_by_the_template_split_back(
    content: str, calls: list[tuple[str, dict[str, object]]], data: st.DataObject
) -> None:
    """Whatever the template renders from content and calls splits back into
    them, character for character, whole and streamed in any pieces."""
    text = _rendered(content, calls)
    want = (content or None, [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    got_content, got_calls = split(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == want
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    streamed_content, streamed_calls = _streamed(text, [c for c in cuts if c < len(text)])
    assert (streamed_content, [(c.name, c.arguments) for c in streamed_calls]) == want
