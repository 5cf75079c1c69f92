"""services/runtime/tracing.py's parts, in this process without touching its global
tracer provider: off, nothing is recorded and no interceptor is added; the
recent spans are kept by request, bounded; a collector that does not answer is
said once, not per batch."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from services.runtime import tracing


def test_off_nothing_is_recorded_and_nothing_intercepts() -> None:
    assert not tracing.enabled()
    with tracing.span("step", items=2) as span:
        assert not span.is_recording()
    with tracing.serving("call", [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")], "r"):
        assert tracing.context_for("r") is None
    assert tracing.client_interceptors() == []
    assert tracing.recent_spans("r") == b""
    assert tracing.trace_id_hex() == ""


def _spans(kept: tracing.RecentSpans, *request_ids: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(kept)
    tracer = provider.get_tracer("test")
    for request_id in request_ids:
        root = tracer.start_span("root", attributes={tracing.REQUEST_ID: request_id})
        tracer.start_span("child", trace.set_span_in_context(root)).end()
        root.end()


def test_recent_spans_are_found_by_request_and_its_retries() -> None:
    kept = tracing.RecentSpans()
    _spans(kept, "chatcmpl-a", "chatcmpl-a-retry1", "chatcmpl-b")
    names = sorted(s.name for s in kept.spans("chatcmpl-a"))
    assert names == ["child", "child", "root", "root"]  # the request's trace and its retry's
    assert len(kept.spans("chatcmpl-b")) == 2
    assert kept.spans("") == [] and kept.spans("nothing") == []


def test_recent_spans_keep_the_last_traces_only() -> None:
    kept = tracing.RecentSpans(max_traces=3)
    _spans(kept, *(f"r{i}" for i in range(10)))
    assert len(kept.traces) == 3
    assert kept.spans("r0") == [] and len(kept.spans("r9")) == 2


def test_a_collector_that_does_not_answer_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.runtime.ports import free_port

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    exporter = tracing._OnceLoggedExporter(f"http://127.0.0.1:{free_port()}")
    kept = tracing.RecentSpans()
    _spans(kept, "r")
    with caplog.at_level(logging.INFO, logger="services.runtime.tracing"):
        results = [exporter.export(kept.spans("r")) for _ in range(3)]
    exporter.shutdown()
    assert results == [SpanExportResult.FAILURE] * 3
    said = [r.message for r in caplog.records if "dropped" in r.message]
    assert len(said) == 1 and "does not answer" in said[0]


def test_spans_go_over_otlp_http_with_the_standard_variables_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf,
    as a collector's documentation gives them: the spans arrive at its /v1/traces."""
    from opentelemetry.sdk.resources import Resource

    from tests.otlp import receiving

    with receiving() as (collector, _grpc_port):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.http_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        assert tracing.protocol() == "http/protobuf"
        exporter = tracing._OnceLoggedExporter(tracing.endpoint(), tracing.protocol())
        assert exporter.url == f"http://127.0.0.1:{collector.http_port}/v1/traces"
        provider = TracerProvider(resource=Resource.create({"epd.component": "test"}))
        kept = tracing.RecentSpans()
        provider.add_span_processor(kept)
        provider.get_tracer("test").start_span("step", attributes={tracing.REQUEST_ID: "r"}).end()
        assert exporter.export(kept.spans("r")) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert [r.span.name for r in collector.received] == ["step"]
        assert collector.refused == []


def test_the_protocol_and_url_follow_the_specification(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.protocol() == "grpc"  # unset: gRPC, as before and as vLLM's
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert tracing.protocol() == "grpc"  # the signal's own variable first
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.protocol()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.traces_url("http://c:4318/", "http/protobuf") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4317", "grpc") == "http://c:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom")
    assert tracing.traces_url("http://c:4318/custom", "http/protobuf") == "http://c:4318/custom"
