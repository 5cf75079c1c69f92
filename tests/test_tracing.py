"""Tracing end to end: `epd serve --otlp-endpoint` against an OTLP/gRPC receiver
run here (opentelemetry-proto's TraceService), and with only the standard
OTEL_EXPORTER_OTLP_* variables against an OTLP/HTTP one: a request with two images is one
trace across the gateway, the broker, the encoder and the language instance,
its spans parented call by call and inside the request's time; a client's
`traceparent` is honoured and a malformed one starts a new trace; `epd trace`
prints the same steps from the processes' own records."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from services.loadgen.synthetic import random_image
from services.runtime.ports import free_serve_ports
from tests.otlp import Collector, Received, receiving
from tests.processes import served
from tests.test_serve import image_url

MODEL = "demo-tiny"
EPD = (sys.executable, "-m", "services.launcher.cli")
TOKEN = secrets.token_urlsafe(16)
# Each process's steps for a request with images (E/P/D aside), by component.
EXPECTED = {
    "gateway": {
        "POST /v1/chat/completions",
        "gateway.load_media",
        "gateway.route",
        "gateway.encode",
        "gateway.generate",
    },
    "broker": {"broker.route", "broker.rendezvous", "broker.transfer"},
    "encoder": {"encoder.encode", "encoder.preprocess", "encoder.triton_infer", "transfer.write"},
    "triton": {"InferRequest", "vit", "compute"},  # Triton's own (--triton-otlp-endpoint)
    "language": {
        "language.generate",
        "language.render",
        "language.receive",
        "engine.queue",
        "engine.prefill",
        "engine.decode",
    },
}
# A span's parent, by name: the hops between processes and the steps inside each.
PARENTS = {
    "gateway.load_media": "POST /v1/chat/completions",
    "gateway.route": "POST /v1/chat/completions",
    "gateway.generate": "POST /v1/chat/completions",
    "broker.route": "gateway.route",
    "broker.rendezvous": "broker.route",
    "broker.transfer": "broker.route",
    "gateway.encode": "gateway.generate",
    "encoder.encode": "gateway.encode",
    "encoder.preprocess": "encoder.encode",
    "encoder.triton_infer": "encoder.encode",
    "transfer.write": "encoder.encode",
    "InferRequest": "encoder.triton_infer",
    "vit": "InferRequest",
    "compute": "vit",
    "language.generate": "gateway.generate",
    "language.render": "language.generate",
    "language.receive": "language.generate",
    "engine.queue": "language.generate",
    "engine.prefill": "language.generate",
    "engine.decode": "language.generate",
}


@dataclass
class Stack:
    url: str
    broker: str
    collector: Collector
    logs: Path  # each process's log (triton.log, gateway.log, ...)


@contextlib.contextmanager
def traced(
    checkpoint: Path, logs: Path, collector: tuple[Collector, int], *flags: str
) -> Iterator[Stack]:
    """`epd serve FLAGS` exporting its spans (and Triton's) to the collector."""
    receiver, port = collector
    ports = free_serve_ports(encoders=2, languages=2)  # E/P/D runs two language instances
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
        env.setenv("EPD_CLUSTER_TOKEN", TOKEN)
        flags = (
            *flags,
            *("--otlp-endpoint", f"http://127.0.0.1:{port}"),
            *("--triton-otlp-endpoint", f"http://127.0.0.1:{receiver.http_port}/v1/traces"),
        )
        with served(checkpoint, MODEL, logs, *flags, ports=ports) as url:
            yield Stack(url, f"127.0.0.1:{ports['broker-port']}", receiver, logs)


@pytest.fixture(scope="module")
def stack(
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    collector: tuple[Collector, int],
) -> Iterator[Stack]:
    with traced(tiny_checkpoint, tmp_path_factory.mktemp("logs"), collector) as started:
        yield started


def _two_images(client: OpenAI, seed: int, **kwargs: Any) -> Any:
    """Two images of their own (an encoder's cache would skip their encode)."""
    images = [random_image(160 + 40 * i, 120, seed=seed + i) for i in range(2)]
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": "What differs?"})
    return client.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=0,
        messages=[{"role": "user", "content": content}],
        **kwargs,
    )


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _all_steps(
    collector: Collector,
    trace_id: bytes,
    expected: set[str] | None = None,
    counts: Mapping[str, int] | None = None,
) -> list[Received]:
    """The trace's spans once every expected step (EXPECTED's by default) has
    arrived, and `counts` of the spans so named (30 s at most)."""
    expected = expected or set().union(*EXPECTED.values())
    deadline = time.monotonic() + 30
    while True:
        spans = collector.trace(trace_id)
        names = [r.span.name for r in spans]
        arrived = expected <= set(names) and all(
            names.count(name) >= count for name, count in (counts or {}).items()
        )
        if arrived or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_a_request_with_two_images_is_one_trace_across_every_process(stack: Stack) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    reply = _two_images(
        _client(stack), 10, extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
    )
    spans = _all_steps(stack.collector, bytes.fromhex(trace_id), counts={"InferRequest": 2})
    assert stack.collector.refused == []  # every export was read
    for component, names in EXPECTED.items():
        mine = {r.span.name for r in spans if r.component == component}
        # A component's log is where a missing span starts (Triton's spans once went
        # to traces of their own: its gRPC server misread the traceparent, see
        # services/encoder/triton_client.py)
        logs = sorted(stack.logs.glob(f"{component}*.log")) if names - mine else []
        log = "".join(f.read_text()[-3000:] for f in logs)
        assert names <= mine, f"{component} is missing {names - mine}; its log ends:\n{log}"
    # every Triton request of the encoder's in this trace (one an image), not in one of its own
    names = [r.span.name for r in spans]
    assert names.count("InferRequest") == names.count("encoder.triton_infer") == 2
    by_name = {r.span.name: r.span for r in spans}
    root = by_name["POST /v1/chat/completions"]
    assert root.parent_span_id.hex() == client_span  # the client's traceparent, honoured
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["epd.request_id"].string_value == reply.id
    assert attributes["http.response.status_code"].int_value == 200
    by_id = {r.span.span_id: r.span for r in spans}
    failed = [r.span.name for r in spans if r.span.status.code == r.span.status.STATUS_CODE_ERROR]
    assert failed == []  # a stream read to its last choice's end is not cut short (no Abort)
    for name, parent in PARENTS.items():
        assert by_id[by_name[name].parent_span_id].name == parent, name
    # Every step lies within the request's time, and what runs one after the other
    # in the gateway adds up to no more than it (1 ms for the clocks' rounding). The
    # language's side of the stream is the one exception: the gateway answers on the
    # last choice's end and reads no further, while the language instance closes its
    # call after sending it (its span ends after the last engine step, in its own time).
    slack = 1_000_000
    for r in spans:
        assert root.start_time_unix_nano - slack <= r.span.start_time_unix_nano, r.span.name
        if r.span.name != "language.generate":
            assert r.span.end_time_unix_nano <= root.end_time_unix_nano + slack, r.span.name
    last_step = by_name["engine.decode"].end_time_unix_nano
    assert last_step <= by_name["language.generate"].end_time_unix_nano + slack
    in_turn = ("gateway.load_media", "gateway.route", "gateway.generate")
    took = sum(by_name[n].end_time_unix_nano - by_name[n].start_time_unix_nano for n in in_turn)
    assert took <= root.end_time_unix_nano - root.start_time_unix_nano + slack
    engine = ("engine.queue", "engine.prefill", "engine.decode")
    for earlier, later in itertools.pairwise(engine):
        assert by_name[earlier].end_time_unix_nano <= by_name[later].start_time_unix_nano + slack
    writes = [r.span for r in spans if r.span.name == "transfer.write"]
    write = {a.key: a.value for a in writes[0].attributes}
    assert write["epd.transport"].string_value == "shm" and write["epd.bytes"].int_value > 0
    queued = next(e.time_unix_nano for e in by_name["vit"].events if e.name == "QUEUE_START")
    assert queued <= by_name["compute"].start_time_unix_nano  # Triton's queue time, in the trace
    decode = {a.key: a.value for a in by_name["engine.decode"].attributes}
    assert decode["epd.tokens"].int_value == reply.usage.completion_tokens - 1


def test_a_malformed_traceparent_starts_a_new_trace(stack: Stack) -> None:
    reply = _two_images(_client(stack), 20, extra_headers={"traceparent": "00-not-a-trace-01"})
    assert reply.choices[0].message.content
    deadline = time.monotonic() + 30
    roots: list[Span] = []
    while not roots and time.monotonic() < deadline:
        with stack.collector.lock:
            roots = [
                r.span
                for r in stack.collector.received
                if any(a.value.string_value == reply.id for a in r.span.attributes)
                and r.component == "gateway"
                and r.span.name.startswith("POST")
            ]
        time.sleep(0.1)
    assert len(roots) == 1 and roots[0].parent_span_id == b""
    assert roots[0].trace_id != bytes(16)


def _epd_trace(stack: Stack, request_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EPD, "trace", request_id, "--broker", stack.broker, "--gateway", stack.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EPD_CLUSTER_TOKEN": TOKEN},
    )


def test_epd_trace_prints_the_steps_in_order(stack: Stack) -> None:
    reply = _two_images(_client(stack), 30)
    shown = _epd_trace(stack, reply.id)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"request {reply.id}, trace ")
    steps = [line.split() for line in lines[3:]]
    names = [next(w for w in words[3:] if "=" not in w) for words in steps]
    assert names[0] == "POST", lines  # the root: POST /v1/chat/completions
    ours = set().union(*(names for c, names in EXPECTED.items() if c != "triton"))
    for expected in ours - {"POST /v1/chat/completions"}:  # Triton's are the collector's
        assert expected in names, f"{expected} missing from:\n{shown.stdout}"
    # Each step's start and duration are numbers; siblings appear in time order.
    starts = {name: float(words[0]) for name, words in zip(names, steps, strict=True)}
    assert all(float(words[1]) >= 0 for words in steps)
    assert starts["gateway.route"] <= starts["gateway.generate"]
    assert starts["engine.queue"] <= starts["engine.prefill"] <= starts["engine.decode"]


def test_epd_trace_of_an_unknown_request_says_so(stack: Stack) -> None:
    shown = _epd_trace(stack, "chatcmpl-nosuchrequest")
    assert shown.returncode == 1
    assert "no spans for request chatcmpl-nosuchrequest" in shown.stdout


def test_spans_reach_an_otlp_http_collector_with_the_standard_variables_only(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, no
    flag: every EPD process's steps of a request arrive at the collector's
    /v1/traces as one trace (Triton's own exporter is its flag's, untouched)."""
    with receiving() as (receiver, _grpc_port), pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        env.setenv("EPD_CLUSTER_TOKEN", TOKEN)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.http_port}")
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        with served(tiny_checkpoint, MODEL, tmp_path, ports=free_serve_ports()) as url:
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            _two_images(
                client, 40, extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
            )
            ours = set().union(*(names for c, names in EXPECTED.items() if c != "triton"))
            spans = _all_steps(receiver, bytes.fromhex(trace_id), ours)
    assert receiver.refused == []
    assert ours <= {r.span.name for r in spans}
    assert {r.component for r in spans} == {"gateway", "broker", "encoder", "language"}
