"""A Response's output built from the text as it streams (events.py), and the
store of responses (store.py), on fixed outputs: no server needed."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.responses.events import ResponseOutput
from services.gateway.responses.protocol import ResponsesRequest
from services.gateway.responses.store import ResponseStore
from services.wire import request as wire

CALL = '<tool_call>\n{"name": "f", "arguments": {"q": "a}b", "n": [1, {"m": 2}]}}\n</tool_call>'
TEXT = "Looking it up. " + CALL + "\n" + CALL.replace('"f"', '"g"')
BODY = ResponsesRequest.model_validate(
    {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f"}]}
)


def _built(text: str, cuts: list[int], reason: wire.FinishReason) -> tuple[list[Any], list[Any]]:
    """The output items and the events of `text` fed in pieces cut at `cuts`."""
    output = ResponseOutput("resp-1", BODY, tool_calls=True)
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        output.text(text[start:end])
    output.finish(wire.GenerateComplete(reason, 5, 7, 0, 3))
    events = [json.loads(e.split("data: ", 1)[1]) for e in output.take()]
    return output.output, events


def _replayed(events: list[Any]) -> list[Any]:
    """The items as a client puts them together from the deltas alone."""
    items: dict[int, Any] = {}
    for event in events:
        if event["type"] == "response.output_item.added":
            items[event["output_index"]] = {**event["item"], "text": "", "arguments": ""}
        elif event["type"] == "response.output_text.delta":
            items[event["output_index"]]["text"] += event["delta"]
        elif event["type"] == "response.function_call_arguments.delta":
            items[event["output_index"]]["arguments"] += event["delta"]
    return [
        ("message", i["text"]) if i["type"] == "message" else (i["name"], i["arguments"])
        for _, i in sorted(items.items())
    ]


def _items(output: list[Any]) -> list[Any]:
    return [
        ("message", item["content"][0]["text"])
        if item["type"] == "message"
        else (item["name"], item["arguments"])
        for item in output
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(TEXT)), st.data())
def test_streamed_anyhow_and_cut_anywhere_the_output_is_the_wholes(
    cut: int, data: st.DataObject
) -> None:
    """Whatever the pieces: the deltas add up to the items, the items equal those
    of the text given whole, no message ever shows a call's markup, and
    the sequence numbers count up from 0."""
    text = TEXT[:cut]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    reason = wire.FinishReason.LENGTH if cut < len(TEXT) else wire.FinishReason.STOP
    output, events = _built(text, [c for c in cuts if c < len(text)], reason)
    whole, _ = _built(text, [], reason)
    assert _items(output) == _items(whole) == _replayed(events)
    messages = [text for kind, text in _items(output) if kind == "message"]
    # a call's markup never shows; a block cut before its name is written is text
    assert not any(f'"name": "{name}"' in text for text in messages for name in "fg")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = "response.completed" if cut == len(TEXT) else "response.incomplete"
    assert events[-1]["type"] == last
    if cut == len(TEXT):
        assert _items(output) == [
            ("message", "Looking it up. "),  # only a newline before a call is the template's
            ("f", '{"q": "a}b", "n": [1, {"m": 2}]}'),
            ("g", '{"q": "a}b", "n": [1, {"m": 2}]}'),
        ]


def test_each_item_opens_and_closes_in_the_documented_order() -> None:
    _, events = _built(TEXT, [], wire.FinishReason.STOP)
    kinds = [e["type"].removeprefix("response.") for e in events]
    kinds = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
    message = ["output_item.added", "content_part.added", "output_text.delta"]
    message += ["output_text.done", "content_part.done", "output_item.done"]
    call = ["output_item.added", "function_call_arguments.delta"]
    call += ["function_call_arguments.done", "output_item.done"]
    assert kinds == ["created", "in_progress", *message, *call, *call, "completed"]
    assert events[-1]["response"]["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }


def test_the_store_keeps_to_its_bytes_and_its_age() -> None:
    store = ResponseStore(max_bytes=1000, ttl_s=60)

    def response(name: str, size: int) -> dict[str, Any]:
        return {"id": name, "pad": "x" * size}

    assert store.put(response("a", 400), [])
    assert store.put(response("b", 400), [])
    assert store.put(response("c", 400), [])  # over 1000 bytes: "a" goes
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    assert not store.put(response("huge", 2000), [])  # alone over the limit: not kept
    assert store.delete("b") and not store.delete("b")
    assert store.bytes == store.get("c").size  # type: ignore[union-attr]
    old = ResponseStore(max_bytes=1000, ttl_s=0.05)
    old.put(response("d", 10), [])
    time.sleep(0.06)
    assert old.get("d") is None and old.bytes == 0


def _turn(size: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "x" * size}]


def test_one_clients_burst_leaves_earlier_small_conversations_retrievable() -> None:
    """The issue's flush, scaled down (a 256 kB store, 60 kB requests as 60 MiB
    ones under the 64 MiB body limit): ten small three-turn conversations, then
    eight large responses in a row. The burst gives way among itself: every
    small conversation stays whole."""
    store = ResponseStore(max_bytes=256_000, ttl_s=60)
    last = []
    for chat in range(10):
        previous = None
        for turn in range(3):
            response = {"id": f"chat{chat}-{turn}"}
            assert store.put(response, _turn(1000), [], previous)
            previous = store.get(response["id"])
        last.append(f"chat{chat}-2")
    for burst in range(8):
        assert store.put({"id": f"burst{burst}"}, _turn(60_000))
    assert store.bytes <= store.max_bytes
    for response_id in last:
        stored = store.get(response_id)
        assert stored is not None and len(stored.conversation) == 3
    assert 0 < sum(store.get(f"burst{b}") is not None for b in range(8)) < 8


def test_a_conversations_history_is_counted_once() -> None:
    """A ten-turn chat about one large image: the image's turn is counted once,
    not once a turn; a turn whose predecessor went keeps its history."""
    store = ResponseStore(max_bytes=10_000_000, ttl_s=60)
    assert store.put({"id": "t0"}, _turn(1_000_000))
    for turn in range(1, 10):
        assert store.put({"id": f"t{turn}"}, _turn(100), [], store.get(f"t{turn - 1}"))
    assert store.bytes < 1_000_000 + 10 * 200
    assert store.delete("t0") and store.get("t0") is None
    last = store.get("t9")
    assert last is not None and len(last.conversation) == 10
    held = store.bytes
    for turn in range(1, 10):
        store.delete(f"t{turn}")
    assert store.bytes == 0 < held  # the last holder gone, the image's turn goes too


def test_one_response_takes_at_most_its_share() -> None:
    store = ResponseStore(max_bytes=1000, ttl_s=60)
    assert not store.put({"id": "big"}, _turn(600))  # over half the store
    assert store.put({"id": "fits"}, _turn(400)) and store.bytes > 400
