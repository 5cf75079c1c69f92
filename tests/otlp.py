"""An OTLP trace receiver for the tests: what a collector would get from a
stack run with --otlp-endpoint (OTLP/gRPC, opentelemetry-proto's TraceService)
and from Triton with --triton-otlp-endpoint (OTLP/HTTP, which Triton sends as
JSON: ids in hex, as the OTLP spec has it, not protobuf JSON's base64)."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

_IDS = ("traceId", "spanId", "parentSpanId")


@dataclass
class Received:
    component: str
    span: Span


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, over gRPC or HTTP (`http_port`)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.refused: list[str] = []  # HTTP exports that could not be read, and why
        self.lock = threading.Lock()
        self.http_port = 0

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.received.append(Received(attributes["epd.component"], span))

    def trace(self, trace_id: bytes) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.span.trace_id == trace_id]


def from_json(body: bytes) -> trace_service_pb2.ExportTraceServiceRequest:
    """OTLP/JSON (hex ids) as the protobuf message."""
    data = json.loads(body)
    for resource in data.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for key in _IDS:
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(data, trace_service_pb2.ExportTraceServiceRequest())


def _http_handler(collector: Collector) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                if self.headers.get("Content-Type") == "application/json":
                    collector.add(from_json(body))
                else:
                    collector.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            except Exception as exc:  # kept for the test to show: a lost export fails it
                collector.refused.append(f"{exc!r}: {body[:300]!r}")
                self.send_response(400)
            else:
                self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            """Quiet."""

    return Handler


@contextlib.contextmanager
def receiving() -> Iterator[tuple[Collector, int]]:
    """A Collector serving OTLP/gRPC on a free port of loopback (and OTLP/HTTP on
    its `http_port`), and the gRPC port."""
    server = grpc.server(ThreadPoolExecutor(4))
    receiver = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(receiver))
    receiver.http_port = web.server_address[1]
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        yield receiver, port
    finally:
        web.shutdown()
        server.stop(None)
