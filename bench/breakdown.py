"""Where an image request's time to first token goes, stage by stage, from the
traces the stack already records (issue 74, item 2).

    .venv/bin/python -m bench.breakdown [--images 4] [--requests 6] [--epd-arg FLAG]

`epd serve` on the small demo checkpoint, its spans (and Triton's) exported over
OTLP to a receiver in this process; requests with `--images` new 448x448 images
and 16 output tokens, one at a time (the first a warm-up). For each span name:
how many a request has, and the median, over the requests, of when the first
starts and the last ends, in ms from the request's root span (the gateway's),
and of their summed time. The TTFT each request saw is printed beside them.

After each request, while the stack is idle, its compute alone in this process:
one image's preprocessing, the vision tower on one image (times the request's
images: the encoder sends them a forward each) and the prefill of a prompt of as
many tokens (text: the same work; no prefix cache, where the stack's may hold the
chat template's first page), in the dtype and step budget the stack runs.
A request's TTFT over its own sample is what the serving path adds (or gains, by
prefilling while the tower computes); paired so, seconds apart, it moves less
with this host's drift than either alone (on a 2-core AVX2 machine both moved by
half within minutes).
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
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.engine import load_engine, text_prompts
from bench.report import Setup, machine, serve
from services.encoder.preprocess import Preprocessor
from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.request import SamplingParams, new_request
from services.language.engine.scheduler import SchedulerConfig
from services.launcher.cli import build_parser
from services.layers.vision_tower import fuse_vision_tower
from services.loadgen.runner import RunConfig, run
from services.loadgen.synthetic import encode_image, random_image
from services.loadgen.workload import BenchRequest, Workload, build_requests
from services.media.limits import ImageLimits
from services.model.checkpoint import load_vision_tower
from services.model.demo import cached_demo_checkpoint
from services.model.spec import load_spec
from services.wire.dtypes import resolve_dtype

BUDGET = 256  # tokens a step (short prefill chunks), unless an --epd-arg sets it
# seconds between a request's end and its compute alone: a server's threads may
# spin on after a request (vLLM's CPU worker held a core for ~1.5 s)
QUIET_S = 2.0


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


class ComputeAlone:
    """The small demo's image path without the stack, in this process: the
    encoder's preprocessing, the vision tower and the language engine."""

    def __init__(self, dtype: torch.dtype, budget: int) -> None:
        checkpoint = cached_demo_checkpoint("small")
        spec = load_spec(checkpoint)
        self.dtype = dtype
        self.preprocessor = Preprocessor(checkpoint, ImageLimits())
        self.tower = load_vision_tower(checkpoint, spec, dtype=dtype)
        fuse_vision_tower(self.tower)
        scheduler = SchedulerConfig(max_num_batched_tokens=budget)
        config = EngineConfig(dtype=dtype, prefix_caching=False, scheduler=scheduler)
        self.engine: LLMEngine = load_engine(checkpoint, config)
        self.engine.warm_up()
        self.image = encode_image(random_image(448, 448, seed=1), "JPEG")
        self.sample(16)  # warms the tower and the preprocessing up

    def sample(self, prompt_tokens: int) -> tuple[float, float, float]:
        """One image's preprocessing, the tower on one image, and a prefill of
        `prompt_tokens` to its first token (ms)."""
        started = time.perf_counter()
        (image,) = asyncio.run(self.preprocessor.preprocess([(0, self.image)]))
        preprocessed = time.perf_counter()
        with torch.inference_mode():
            pixels = torch.from_numpy(image.pixel_values).to(self.dtype)
            grid = torch.tensor([[image.grid.t, image.grid.h, image.grid.w]])
            self.tower(pixels, grid_thw=grid)
        encoded = time.perf_counter()
        (ids,) = text_prompts(self.engine, prompt_tokens, 1)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        name = f"alone-{time.monotonic_ns()}"
        self.engine.add_request(new_request(name, ids, params, self.engine.spec))
        while self.engine.has_work():
            self.engine.step()
        ended = time.perf_counter()
        return (
            1000 * (preprocessed - started),
            1000 * (encoded - preprocessed),
            1000 * (ended - encoded),
        )


def one_by_one(
    url: str, requests: list[BenchRequest], alone: ComputeAlone
) -> tuple[list[float], list[tuple[float, float, float]]]:
    """Each request's TTFT (ms), sent one at a time, each followed by a sample of
    its compute alone (its prompt's tokens) once the server is quiet: the two a few
    seconds apart."""
    config = RunConfig(url, max_concurrency=1, warmup=0, progress=False)
    ttfts, samples = [], []
    for request in requests:
        (result,) = asyncio.run(run(config, [request])).results
        if result.ttft is None:
            raise SystemExit(f"a request failed: {result.status} {result.error}")
        ttfts.append(1000 * result.ttft)
        time.sleep(QUIET_S)
        samples.append(alone.sample(result.prompt_tokens))
    return ttfts, samples


def over_alone(
    images: int, ttfts: list[float], samples: list[tuple[float, float, float]]
) -> tuple[tuple[float, ...], float, float]:
    """The medians of the compute alone's parts and of its sum (the tower once an
    image), and the median of each request's TTFT over its own sample's sum."""
    floors = [pre + images * tower + prefill for pre, tower, prefill in samples]
    parts = tuple(statistics.median(part) for part in zip(*samples, strict=True))
    ratio = statistics.median(t / f for t, f in zip(ttfts, floors, strict=True))
    return parts, statistics.median(floors), ratio


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
    served = build_parser().parse_args(["serve", "--max-num-batched-tokens", str(BUDGET), *flags])
    alone = ComputeAlone(resolve_dtype(served.dtype), served.max_num_batched_tokens)
    with serve(setup, Path("/tmp/epd-breakdown"), max_num_batched_tokens=BUDGET) as (url, _):
        requests = build_requests(workload, "demo-small")
        one_by_one(url, requests[:1], alone)
        sink.settle()  # the warm-up's spans, all in before they are dropped
        with sink.lock:
            sink.by_trace.clear()
        ttfts, samples = one_by_one(url, requests[1:], alone)
        sink.settle()
    server.stop(None)
    print(f"{machine()}; the small demo; {args.images} image(s) a request, one at a time")
    print(f"TTFT p50 {statistics.median(ttfts):.0f} ms over {len(ttfts)} requests")
    (pre, tower, prefill), floor, ratio = over_alone(args.images, ttfts, samples)
    print(
        f"compute alone (medians): preprocessing {pre:.0f} + {args.images} x tower {tower:.0f} "
        f"+ prefill {prefill:.0f} = {floor:.0f} ms; TTFT over it: {ratio:.2f} "
        "(the median of each request's over its own)"
    )
    traces = [t for t in sink.by_trace.values() if any(n.startswith("gateway.") for n, _, _ in t)]
    if len(traces) < len(ttfts):
        print(f"only {len(traces)} of {len(ttfts)} requests' traces arrived")
    print(f"{'span':<34} {'count':>5} {'first start':>12} {'last end':>9} {'summed':>8}  (ms)")
    for name, first, last, total, count in stages(traces):
        print(f"{name:<34} {count:>5} {first:>12.1f} {last:>9.1f} {total:>8.1f}")


if __name__ == "__main__":
    main()
