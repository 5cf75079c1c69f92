"""Where an image request's time to first token goes, stage by stage, from the
traces the stack already records (issue 74, item 2).

    .venv/bin/python -m bench.breakdown [--images 4] [--requests 6] [--epd-arg FLAG]

`epd serve` on the small demo checkpoint, its spans (and Triton's) exported over
OTLP to a receiver in this process; requests with `--images` new 448x448 images
and 16 output tokens, one at a time (the first a warm-up). For each span name:
how many a request has, and the median, over the requests, of when the first
starts and the last ends, in ms from the request's root span (the gateway's),
and of their summed time. The TTFT each request saw is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.report import Setup, machine, serve
from services.loadgen.runner import RunConfig, run
from services.loadgen.workload import Workload, build_requests


class Spans(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that keeps (name, start ns, end ns) by trace."""

    def __init__(self) -> None:
        self.by_trace: dict[bytes, list[tuple[str, int, int]]] = defaultdict(list)
        self.lock = threading.Lock()
        self.received = 0

    def settle(self, quiet_s: float = 6.0, deadline_s: float = 30.0) -> None:
        """Returns once no span has come for `quiet_s` (each process sends its spans
        in batches, every 5 s), or after `deadline_s`: while the stack still runs,
        not from the flushes of its stop, which do not always arrive."""
        deadline = time.monotonic() + deadline_s
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            if self.received != seen:
                seen, since = self.received, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.2)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.by_trace[span.trace_id].append(
                            (span.name, span.start_time_unix_nano, span.end_time_unix_nano)
                        )
                        self.received += 1
        return trace_service_pb2.ExportTraceServiceResponse()


def stages(traces: list[list[tuple[str, int, int]]]) -> list[tuple[str, float, float, float, int]]:
    """Per span name: the medians of its first start, last end and summed time (ms
    from each trace's earliest span), and how many a trace has; by first start."""
    per_name: dict[str, list[tuple[float, float, float, int]]] = defaultdict(list)
    for spans in traces:
        root = min(start for _, start, _ in spans)
        named: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for name, start, end in spans:
            named[name].append((start, end))
        for name, times in named.items():
            first = (min(s for s, _ in times) - root) / 1e6
            last = (max(e for _, e in times) - root) / 1e6
            total = sum(e - s for s, e in times) / 1e6
            per_name[name].append((first, last, total, len(times)))
    rows = [
        (
            name,
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
            statistics.median(r[2] for r in runs),
            max(r[3] for r in runs),
        )
        for name, runs in per_name.items()
    ]
    return sorted(rows, key=lambda row: (row[1], row[2]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--epd-arg", action="append", default=[], help="an `epd serve` flag")
    args = parser.parse_args()
    sink = Spans()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    flags = [a for f in args.epd_arg for a in f.split()]
    traced = ("--otlp-endpoint", endpoint, "--triton-otlp-endpoint", endpoint)
    setup = Setup("traced", (*traced, *flags))
    workload = Workload(
        num_prompts=args.requests + 1,
        input_len=8,
        output_len=16,
        images_per_request=args.images,
        seed=21,
    )
    with serve(setup, Path("/tmp/epd-breakdown")) as (url, _):
        one_at_a_time = RunConfig(url, max_concurrency=1, warmup=0, progress=False)
        requests = build_requests(workload, "demo-small")
        asyncio.run(run(one_at_a_time, requests[:1]))
        sink.settle()  # the warm-up's spans, all in before they are dropped
        with sink.lock:
            sink.by_trace.clear()
        result = asyncio.run(run(one_at_a_time, requests[1:]))
        sink.settle()
    server.stop(None)
    ttfts = [1000 * r.ttft for r in result.results if r.ttft is not None]
    print(f"{machine()}; the small demo; {args.images} image(s) a request, one at a time")
    print(f"TTFT p50 {statistics.median(ttfts):.0f} ms over {len(ttfts)} requests")
    traces = [t for t in sink.by_trace.values() if any(n.startswith("gateway.") for n, _, _ in t)]
    if len(traces) < len(ttfts):
        print(f"only {len(traces)} of {len(ttfts)} requests' traces arrived")
    print(f"{'span':<34} {'count':>5} {'first start':>12} {'last end':>9} {'summed':>8}  (ms)")
    for name, first, last, total, count in stages(traces):
        print(f"{name:<34} {count:>5} {first:>12.1f} {last:>9.1f} {total:>8.1f}")


if __name__ == "__main__":
    main()
