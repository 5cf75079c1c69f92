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
