"""Tracing under E/P/D (`epd serve --prefill 1 --decode 1 --otlp-endpoint`): a
request with two images is one trace across the gateway, the broker, the
encoder, the prefill and the decode instance, the KV hand-off in it on both
sides and at the broker."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.otlp import Collector
from tests.test_tracing import Stack, _all_steps, _client, _two_images, traced

# Each span's parent, by name, where the name is the only one of its kind.
PARENTS = {
    "gateway.prefill": "gateway.generate",
    "language.prefill": "gateway.prefill",
    "language.decode": "gateway.generate",
    "language.kv_send": "language.prefill",
    "language.kv_receive": "language.decode",
    "engine.prefill": "language.prefill",
    "engine.decode": "language.decode",
    "encoder.encode": "gateway.encode",
}


@pytest.fixture(scope="module")
def stack(
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    collector: tuple[Collector, int],
) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    with traced(tiny_checkpoint, logs, collector, "--prefill", "1", "--decode", "1") as started:
        yield started


def test_prefill_decode_and_the_kv_hand_off_are_in_the_request_trace(stack: Stack) -> None:
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    reply = _two_images(_client(stack), 40, extra_headers={"traceparent": traceparent})
    expected = {*PARENTS, *PARENTS.values(), "transfer.write", "broker.transfer"}
    # both transfers at the broker: the KV hand-off's span may be exported after the rest
    spans = _all_steps(stack.collector, bytes.fromhex(trace_id), expected, {"broker.transfer": 2})
    names = [r.span.name for r in spans]
    assert expected <= set(names), expected - set(names)
    by_name = {r.span.name: r.span for r in spans}
    by_id = {r.span.span_id: r.span for r in spans}
    for name, parent in PARENTS.items():
        assert by_id[by_name[name].parent_span_id].name == parent, name
    transfers = [
        {a.key: a.value.string_value for a in r.span.attributes}["epd.request_id"]
        for r in spans
        if r.span.name == "broker.transfer"
    ]
    assert sorted(transfers) == [reply.id, f"{reply.id}/kv"]  # embeddings E>P, KV P>D
    writers = {by_id[r.span.parent_span_id].name for r in spans if r.span.name == "transfer.write"}
    assert writers == {"encoder.encode", "language.prefill"}
