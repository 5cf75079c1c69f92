"""Tracing: one trace per request across every process, with OpenTelemetry.

Off unless asked for (`--trace`, `--otlp-endpoint` or the standard
OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT): then every process records a span per
step that costs time, keeps the spans of its recent requests in memory (for
`epd trace`, over the Telemetry service) and, given an endpoint, exports them
in a background thread over OTLP/gRPC, or OTLP/HTTP (protobuf) where the standard
OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says http/protobuf (gRPC by default, as
vLLM's). The sampler is the SDK's, read from
OTEL_TRACES_SAMPLER (every request by default, a client's sampled flag
honoured). Off, every helper here returns at once: no span, no context.

The W3C trace context crosses every gRPC hop in the call's metadata: the
client interceptors add the current span's `traceparent`, and a server span
starts from the metadata of the call it serves (`serving`). What a process
does later for a request (a transfer part, the engine's steps) is parented by
the context it keeps under that request's id while serving it (`context_for`),
so messages the broker relays need no context of their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from services.runtime import env

logger = logging.getLogger(__name__)

REQUEST_ID = "epd.request_id"
RECENT_TRACES = 2000  # traces each process keeps for `epd trace`
MAX_SPANS_PER_TRACE = 256

_tracer = trace.get_tracer("epd")
_enabled = False
_recent: RecentSpans | None = None
# The context each request in flight here is served under, by request id.
_requests: dict[str, otel_context.Context] = {}


def enabled() -> bool:
    return _enabled


def endpoint() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


PROTOCOLS = ("grpc", "http/protobuf")


def protocol() -> str:
    """OTLP's transport, as the specification's variables choose it (the traces'
    own first); ValueError for one this exporter does not speak (http/json)."""
    chosen = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if chosen not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {chosen!r}: EPD exports traces over {PROTOCOLS}")
    return chosen


def traces_url(url: str, chosen: str) -> str:
    """Where OTLP/HTTP posts: the traces' own endpoint as it is, the general
    one with the signal's path (/v1/traces) appended, as the specification says."""
    if chosen == "grpc" or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return url
    return url.rstrip("/") + "/v1/traces"


def configure(component: str) -> bool:
    """Tracing for this process (`component`: gateway, broker, encoder, language),
    when EPD_TRACE or an OTLP endpoint asks for it; whether it is on."""
    global _enabled, _recent
    if not (env.TRACE.get() or endpoint()) or _enabled:
        return _enabled
    attributes = {
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or f"epd-{component}",
        "epd.component": component,
    }
    provider = TracerProvider(resource=Resource.create(attributes))
    _recent = RecentSpans()
    provider.add_span_processor(_recent)
    if endpoint():
        exporter = _OnceLoggedExporter(endpoint(), protocol())
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    where = f"exporting to {endpoint()} over OTLP ({protocol()})" if endpoint() else "kept here"
    logger.info("tracing on (%s)", where)
    return True


class _OnceLoggedExporter(SpanExporter):
    """The OTLP exporter (gRPC or HTTP), whose failures (a collector that does not
    answer) are said once, not once a batch: spans are dropped, requests go on."""

    def __init__(self, url: str, chosen: str = "grpc") -> None:
        self.url = traces_url(url, chosen)
        self.exporter: SpanExporter
        if chosen == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_otlp

            logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").setLevel(
                logging.CRITICAL
            )
            insecure = not url.startswith("https")
            self.exporter = grpc_otlp.OTLPSpanExporter(endpoint=url, insecure=insecure)
        else:
            from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_otlp

            logging.getLogger(http_otlp.__name__).setLevel(logging.CRITICAL)
            self.exporter = http_otlp.OTLPSpanExporter(endpoint=self.url)
        self.failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.exporter.export(spans)
        if result is SpanExportResult.FAILURE and not self.failing:
            logger.warning("traces to %s are dropped: the collector does not answer", self.url)
        elif result is SpanExportResult.SUCCESS and self.failing:
            logger.info("traces reach %s again", self.url)
        self.failing = result is SpanExportResult.FAILURE
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis))


class RecentSpans(SpanProcessor):
    """A span processor that keeps the finished spans of the last RECENT_TRACES
    traces, and which traces each request id took part in."""

    def __init__(self, max_traces: int = RECENT_TRACES) -> None:
        self.max_traces = max_traces
        self.traces: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self.by_request: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        trace_id = span.context.trace_id
        request_id = (span.attributes or {}).get(REQUEST_ID)
        with self.lock:
            spans = self.traces.setdefault(trace_id, [])
            self.traces.move_to_end(trace_id)
            if len(spans) < MAX_SPANS_PER_TRACE:
                spans.append(span)
            if isinstance(request_id, str):
                self.by_request[request_id] = trace_id
                self.by_request.move_to_end(request_id)
            while len(self.traces) > self.max_traces:
                self.traces.popitem(last=False)
            while len(self.by_request) > 4 * self.max_traces:
                self.by_request.popitem(last=False)

    def spans(self, request_id: str) -> list[ReadableSpan]:
        """The spans of every trace the request (or a retry of it: ID-retryN, or
        a part of it: ID/kv, ID-0) took part in."""
        if not request_id:
            return []
        with self.lock:
            ids = {t for r, t in self.by_request.items() if r.startswith(request_id)}
            return [s for t in ids for s in self.traces.get(t, ())]


def recent_spans(request_id: str) -> bytes:
    """This process's spans of the request, as an OTLP ExportTraceServiceRequest."""
    if _recent is None:
        return b""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return bytes(encode_spans(_recent.spans(request_id)).SerializeToString())


# -- spans ------------------------------------------------------------------------------


@contextlib.contextmanager
def span(
    name: str,
    parent: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    **attributes: Any,
) -> Iterator[Span]:
    """A span over the block, current inside it (no `yield` of an async generator
    may happen inside: the context would leak to its consumer)."""
    if not _enabled:
        yield INVALID_SPAN
        return
    with _tracer.start_as_current_span(name, parent, kind, attributes=_attrs(attributes)) as s:
        yield s


def start(
    name: str,
    parent: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    **attributes: Any,
) -> Span:
    """A span started now and ended by the caller (`end`), never current: for
    what lasts across an async generator's yields."""
    if not _enabled:
        return INVALID_SPAN
    return _tracer.start_span(name, parent, kind, attributes=_attrs(attributes))


def end(span: Span, error: BaseException | str | None = None, **attributes: Any) -> None:
    """Ends a span from `start`, failed if `error` says why."""
    if not span.is_recording():
        return
    span.set_attributes(_attrs(attributes))
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}"
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def record(
    name: str,
    started: float,
    ended: float,
    parent: otel_context.Context | None,
    **attributes: Any,
) -> None:
    """A finished span from two time.monotonic() readings: for steps timed where
    no span can be open (the engine's thread)."""
    if not _enabled:
        return
    s = _tracer.start_span(name, parent, attributes=_attrs(attributes), start_time=_wall(started))
    s.end(end_time=_wall(ended))


def _wall(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _attrs(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {f"epd.{k}" if "." not in k else k: v for k, v in attributes.items() if v is not None}


def current(span: Span) -> contextlib.AbstractContextManager[Span]:
    """The span current for a synchronous block (e.g. starting a gRPC call, whose
    interceptor reads it)."""
    if not _enabled:
        return contextlib.nullcontext(span)
    return trace.use_span(span, end_on_exit=False)


# -- requests served here -------------------------------------------------------------------


@contextlib.contextmanager
def serving(
    name: str, metadata: Iterable[tuple[str, Any]] | None, request_id: str = "", **attributes: Any
) -> Iterator[Span]:
    """The server span of a call, its parent the caller's span (from the call's
    metadata or HTTP headers: a missing or malformed `traceparent` starts a new
    trace), current inside the block, and kept as the request's context until
    the block ends."""
    if not _enabled:
        yield INVALID_SPAN
        return
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    if request_id:
        attributes = {REQUEST_ID: request_id, **attributes}
    with _tracer.start_as_current_span(
        name, propagate.extract(carrier), SpanKind.SERVER, attributes=_attrs(attributes)
    ) as served:
        if request_id:
            _requests[request_id] = otel_context.get_current()
        try:
            yield served
        finally:
            _requests.pop(request_id, None)


def context_for(request_id: str) -> otel_context.Context | None:
    """The context a request in flight here is served under (a transfer's id may
    be the request's + /kv)."""
    if not _enabled:
        return None
    return _requests.get(request_id) or _requests.get(request_id.split("/")[0])


def outgoing() -> dict[str, str]:
    """The current span's context as headers (`traceparent`): for the channels'
    interceptors, and for calls made with another client (Triton's); {} when off."""
    carrier: dict[str, str] = {}
    if _enabled:
        propagate.inject(carrier)
    return carrier


def trace_id_hex() -> str:
    """The current trace's id (32 hex digits), or "" without one."""
    if not _enabled:
        return ""
    span_context = trace.get_current_span().get_span_context()
    return f"{span_context.trace_id:032x}" if span_context.is_valid else ""


# -- the context across gRPC ------------------------------------------------------------------


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier = outgoing()
    if not carrier:
        return details
    merged = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
    return details._replace(metadata=merged)  # type: ignore[attr-defined]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_context(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_context(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_context(details), requests)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What carries the current span's context on a channel's calls (none when
    tracing is off: an interceptor costs a task per call). Streams between
    instances and the broker carry none: they outlive any request."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary()] if _enabled else []
