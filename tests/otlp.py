"""An OTLP/gRPC trace receiver for the tests (opentelemetry-proto's TraceService):
what a collector would get from a stack run with --otlp-endpoint."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class Received:
    component: str
    span: Span


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span exported to it."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.received.append(Received(attributes["epd.component"], span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.span.trace_id == trace_id]


@contextlib.contextmanager
def receiving() -> Iterator[tuple[Collector, int]]:
    """A Collector serving on a free port of loopback, and the port."""
    server = grpc.server(ThreadPoolExecutor(4))
    receiver = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(None)
