"""`epd bench`: a serving benchmark against any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from services.loadgen import plots
from services.loadgen.runner import RunConfig, RunResult, run
from services.loadgen.summary import render, summarize
from services.loadgen.workload import Workload, build_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`epd bench`'s options: the server, the workload, the arrivals, the outputs."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("--api-key", default="")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions, or /v1/completions (text prompts only: --image-ratio 0)",
    )
    p.add_argument(
        "--schema-ratio",
        type=float,
        default=0.0,
        help="share of requests with a response_format JSON schema (structured output)",
    )
    p.add_argument(
        "--tool-ratio",
        type=float,
        default=0.0,
        help="share of requests that offer tools (a function taking a free-text note)",
    )
    p.add_argument(
        "--tool-choice",
        choices=("required", "auto", "none"),
        default="required",
        help="those requests' tool_choice",
    )
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--input-len", type=int, default=64, help="words of text per prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (by default they ask for exactly --output-len)",
    )
    _media_arguments(p)
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[math.inf],
        help="requests/s (Poisson); inf sends all at once; several values sweep",
    )
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:100 e2e:10000",
    )
    p.add_argument("--result-json", help="write every run's summary and requests here")
    p.add_argument("--plot-dir", help="write latency CDFs and throughput-vs-rate PNGs here")


def _media_arguments(p: argparse.ArgumentParser) -> None:
    """Which requests have images or a video, and what those are."""
    p.add_argument(
        "--image-ratio",
        type=float,
        default=1.0,
        help="share of requests with images: 0 text-only, 0.1 a 1:9 mix",
    )
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument(
        "--distinct-images",
        type=int,
        default=0,
        metavar="K",
        help="draw each request's images from a pool of K (repeats across requests, as "
        "caches see them); 0: every image new",
    )
    p.add_argument(
        "--image-skew",
        type=float,
        default=0.0,
        metavar="S",
        help="with --distinct-images: draw the pool's k-th image with weight 1/k**S "
        "(Zipf: a few popular images among many); 0: evenly",
    )
    p.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT of random images")
    p.add_argument("--image-format", default="jpeg", choices=("jpeg", "png", "webp"))
    p.add_argument("--image-dir", help="use these images instead of random ones")
    p.add_argument(
        "--video-ratio",
        type=float,
        default=0.0,
        help="share of requests with one video (drawn from those without images)",
    )
    p.add_argument("--video-frames", type=int, default=16, help="frames of random videos")
    p.add_argument("--video-size", default="224x224", help="WIDTHxHEIGHT of random videos")
    p.add_argument("--video-fps", type=int, default=4, help="frame rate of random videos")
    p.add_argument("--video-dir", help="use these videos instead of random ones")


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        metric, _, value = item.partition(":")
        if metric not in ("ttft", "tpot", "e2e") or not value:
            raise SystemExit(
                f"--goodput takes METRIC:MS with METRIC in ttft, tpot, e2e; got {item!r}"
            )
        slo[metric] = float(value)
    return slo


def first_model(base_url: str, api_key: str) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10)
    reply.raise_for_status()
    models = [m["id"] for m in reply.json()["data"]]
    if not models:
        raise SystemExit(f"{base_url} serves no models")
    return str(models[0])


def strict_json(value: Any) -> Any:
    """Infinity and NaN are not JSON: a burst's rate is written "inf", an empty
    statistic "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def record(run_result: RunResult, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": summary,
        "requests": [asdict(r) | {"tpot": r.tpot} for r in run_result.results],
    }


def workload_of(args: argparse.Namespace) -> Workload:
    width, _, height = args.image_size.partition("x")
    video_width, _, video_height = args.video_size.partition("x")
    return Workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        image_ratio=args.image_ratio,
        images_per_request=args.images_per_request,
        distinct_images=args.distinct_images,
        image_skew=args.image_skew,
        image_size=(int(width), int(height)),
        image_format=args.image_format,
        image_dir=Path(args.image_dir) if args.image_dir else None,
        ignore_eos=not args.no_ignore_eos,
        seed=args.seed,
        endpoint=args.endpoint,
        schema_ratio=args.schema_ratio,
        tool_ratio=args.tool_ratio,
        tool_choice=args.tool_choice,
        video_ratio=args.video_ratio,
        video_frames=args.video_frames,
        video_size=(int(video_width), int(video_height)),
        video_fps=args.video_fps,
        video_dir=Path(args.video_dir) if args.video_dir else None,
    )


def main(args: argparse.Namespace) -> int:
    workload = workload_of(args)
    slo = parse_slo(args.goodput)
    model = args.model or first_model(args.base_url, args.api_key)
    requests = build_requests(workload, model)
    print(
        f"benchmarking {model!r} at {args.base_url}: {len(requests)} requests, "
        f"{sum(r.kind == 'image' for r in requests)} with images, "
        f"{sum(r.kind == 'video' for r in requests)} with a video",
        flush=True,
    )
    runs: dict[str, RunResult] = {}
    summaries = []
    for rate in args.request_rate:
        config = RunConfig(
            base_url=args.base_url,
            request_rate=rate,
            max_concurrency=args.max_concurrency,
            warmup=args.warmup,
            api_key=args.api_key,
            seed=args.seed,
        )
        result = asyncio.run(run(config, requests))
        summary = summarize(result, slo)
        runs[f"{rate:g} req/s"] = result
        summaries.append(summary)
        print(render(summary), flush=True)
    write_outputs(args, model, workload, runs, summaries)
    failed = sum(s["failed"] for s in summaries)
    return 1 if failed and failed == sum(s["failed"] + s["completed"] for s in summaries) else 0


def write_outputs(
    args: argparse.Namespace,
    model: str,
    workload: Workload,
    runs: dict[str, RunResult],
    summaries: list[dict[str, Any]],
) -> None:
    """--result-json's report and --plot-dir's plots, where asked for."""
    if args.result_json:
        report = {
            "model": model,
            "base_url": args.base_url,
            "workload": asdict(workload) | {"image_dir": args.image_dir},
            "runs": [record(runs[k], s) for k, s in zip(runs, summaries, strict=True)],
        }
        Path(args.result_json).write_text(
            json.dumps(strict_json(report), indent=1, default=str, allow_nan=False)
        )
    if args.plot_dir:
        folder = Path(args.plot_dir)
        folder.mkdir(parents=True, exist_ok=True)
        plots.latency_cdfs(runs, folder / "latency_cdf.png", f"{model} at {args.base_url}")
        if len(summaries) > 1:
            plots.throughput_vs_rate({model: summaries}, folder / "throughput_vs_rate.png")
