"""Admission and accounting of the generation endpoints, in one ASGI wrapper
(InFlight), so that no path through the app can leave them unbalanced: at most
`--max-concurrent-requests` in flight (429 beyond), the in-flight gauge, the
status counts, the request log line and the request's root span."""

from __future__ import annotations

import time

from opentelemetry.trace import Span, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_log import RequestRecord
from services.gateway.request_log import log as log_request
from services.runtime import tracing

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
CLIENT_LEFT = 499  # nginx's: the client closed the connection before the response


class InFlight:
    """ASGI wrapper of the generation endpoints: admits at most `limit` requests
    at once (429 beyond), and counts each one in flight from its first byte to
    the end of its response, whatever ends it, a client that leaves included."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, limit: int) -> None:
        self.app = app
        self.metrics = metrics
        self.limit = limit
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        if self.active >= self.limit:
            metrics.requests.labels("429").inc()
            busy = ApiError(429, f"the gateway has {self.limit} requests in flight, its limit")
            await busy.response()(scope, receive, send)
            return
        status = CLIENT_LEFT  # unless a response starts

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.monotonic()
        record = RequestRecord(scope["path"])
        scope.setdefault("state", {})["record"] = record  # the handlers' request.state.record
        self.active += 1
        metrics.in_flight.inc()
        headers = (  # for the client's traceparent; not read when tracing is off
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            if tracing.enabled()
            else None
        )
        with tracing.serving(f"POST {scope['path']}", headers) as span:
            record.trace_id = tracing.trace_id_hex()
            try:
                await self.app(scope, receive, watched)
            finally:
                self.active -= 1
                metrics.in_flight.dec()
                metrics.requests.labels(str(status)).inc()
                metrics.latency.observe(time.monotonic() - started)
                record.status = status
                record.total_ms = (time.monotonic() - started) * 1000
                log_request(record)
                _close_span(span, record)


def _close_span(span: Span, record: RequestRecord) -> None:
    """What the request log says, on the request's root span."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            tracing.REQUEST_ID: record.request_id,
            "http.response.status_code": record.status,
            "epd.media": record.media,
            "epd.prompt_tokens": record.prompt_tokens,
            "epd.completion_tokens": record.completion_tokens,
            "epd.language": record.language,
            "epd.encoder": record.encoder,
        }
    )
    if record.ttft_ms is not None:
        span.set_attribute("epd.ttft_ms", record.ttft_ms)
    if record.status >= 500:
        span.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))
