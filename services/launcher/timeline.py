"""`epd trace REQUEST_ID`: what happened to a recent request, step by step.

Every process that traces keeps its recent spans (services/runtime/tracing.py); this
asks each of them (the broker, every instance the broker knows, the gateway)
for the request's, and prints them as one tree in time order, with each step's
start, duration and attributes. No tracing backend is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from services.proto import broker_pb2, broker_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc
from services.runtime.grpc_server import channel

TIMEOUT_S = 5.0
# Attributes that say who the span is, not what it did: not printed.
_QUIET = {"epd.request_id"}


@dataclass
class Step:
    component: str
    name: str
    start_ns: int
    end_ns: int
    span_id: bytes
    parent_id: bytes
    trace_id: bytes
    attributes: dict[str, Any]
    failed: str = ""
    children: list[Step] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def decode(raw: bytes) -> list[Step]:
    """The spans of an OTLP ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest.FromString(raw)
    steps = []
    for resource in request.resource_spans:
        resource_attributes = {a.key: _value(a.value) for a in resource.resource.attributes}
        component = str(resource_attributes.get("epd.component", "?"))
        for scope in resource.scope_spans:
            for span in scope.spans:
                steps.append(
                    Step(
                        component,
                        span.name,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        span.span_id,
                        span.parent_span_id,
                        span.trace_id,
                        {a.key: _value(a.value) for a in span.attributes},
                        span.status.message if span.status.code == 2 else "",
                    )
                )
    return steps


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


async def _instance_spans(address: str, request_id: str) -> list[Step]:
    async with channel(address) as ch:
        reply = await telemetry_pb2_grpc.TelemetryStub(ch).RecentSpans(
            telemetry_pb2.RecentSpansRequest(request_id=request_id), timeout=TIMEOUT_S
        )
    return decode(reply.traces)


async def _addresses(broker: str) -> list[str]:
    async with channel(broker) as ch:
        reply = await broker_pb2_grpc.BrokerStub(ch).ListInstances(
            broker_pb2.ListInstancesRequest(), timeout=TIMEOUT_S
        )
    return [broker, *(i.registration.grpc_address for i in reply.instances)]


async def _gateway_spans(url: str, request_id: str, api_key: str) -> list[Step]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        response = await client.get(f"{url.rstrip('/')}/debug/spans/{request_id}", headers=headers)
    response.raise_for_status()
    return decode(response.content)


async def gather(request_id: str, broker: str, gateway: str, api_key: str = "") -> list[Step]:
    """Every reachable process's spans of the request (one that cannot be reached
    is left out: its steps are missing from the tree, the rest still show)."""
    work = [_instance_spans(address, request_id) for address in await _addresses(broker)]
    if gateway:
        work.append(_gateway_spans(gateway, request_id, api_key))
    found: list[Step] = []
    for result in await asyncio.gather(*work, return_exceptions=True):
        if isinstance(result, list):
            found.extend(result)
        elif not isinstance(result, grpc.aio.AioRpcError | httpx.HTTPError | OSError):
            raise result
    return found


def tree(steps: Iterable[Step]) -> list[Step]:
    """The roots (no parent among the steps), each step's children in time order."""
    ordered = sorted(steps, key=lambda s: s.start_ns)
    by_id = {s.span_id: s for s in ordered}
    roots: list[Step] = []
    for step in ordered:
        parent = by_id.get(step.parent_id)
        (parent.children if parent is not None else roots).append(step)
    return roots


def render(request_id: str, steps: list[Step]) -> str:
    roots = tree(steps)
    if not roots:
        return (
            f"no spans for request {request_id}: tracing is off (start with --trace), "
            "or the request is older than what the processes keep"
        )
    origin = roots[0].start_ns
    lines = [
        f"request {request_id}, trace {roots[0].trace_id.hex()}: "
        f"{max(s.end_ns for s in steps) / 1e6 - origin / 1e6:.1f} ms",
        "",
        f"{'start ms':>9} {'took ms':>9}  {'component':<9} step",
    ]

    def walk(step: Step, depth: int) -> None:
        shown = " ".join(
            f"{k.removeprefix('epd.')}={_short(v)}"
            for k, v in step.attributes.items()
            if k not in _QUIET
        )
        failed = f"  FAILED: {step.failed}" if step.failed else ""
        lines.append(
            f"{(step.start_ns - origin) / 1e6:9.1f} {step.duration_ms:9.1f}  "
            f"{step.component:<9} {'  ' * depth}{step.name}  {shown}{failed}".rstrip()
        )
        for child in step.children:
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def main(request_id: str, broker: str, gateway: str, api_key: str) -> int:
    steps = asyncio.run(gather(request_id, broker, gateway, api_key))
    print(render(request_id, steps))
    return 0 if steps else 1
