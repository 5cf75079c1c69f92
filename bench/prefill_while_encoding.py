"""Prefill while the images arrive: EPD with the feature on and off, one stack
at a time, same machine, same checkpoint, same client, one run.

    .venv/bin/python -m bench.prefill_while_encoding [--size medium --rounds 2]

Each stack runs Triton and the encoder on one core and the language instance on
another (`--encoder-cpus`, `--language-cpus`), as a GPU host gives the tower
and the language model devices of their own. Measured on each:

- at low load (one request at a time, every image new to the encoder's cache):
  TTFT p50 of a request with four 448x448 images, and of one with a 16-frame
  video (8 s at 2 frames a second, 336x336);
- at load (`--concurrency` in flight): a mixed workload (half text, half one
  image), its requests/s and TPOT p50.

Off and on alternate for `--rounds` rounds, which goes first alternating too
(each stack started anew, each request's images its own); every figure is the
median over the rounds.

Targets (issue 60): the four-image and video TTFT p50 at most 0.75x with the
feature off; requests/s and TPOT within noise of off.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.peer import with_section
from bench.report import DOC, STREAMED_END, STREAMED_START, Setup, head_commit, machine, serve
from services.loadgen.client import RequestResult, send
from services.loadgen.synthetic import encode_image, random_image, random_video
from services.loadgen.workload import BenchRequest
from services.model.demo import cached_demo_checkpoint
from services.runtime.ports import free_serve_ports

OFF = "--no-prefill-while-encoding"


def image_part(seed: int) -> dict[str, Any]:
    data = encode_image(random_image(448, 448, seed=seed), "JPEG")
    url = f"data:image/jpeg;base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(seed: int) -> dict[str, Any]:
    data = random_video(num_frames=80, width=336, height=336, fps=10, seed=seed)
    url = f"data:video/mp4;base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": url}}


def body(model: str, media: list[dict[str, Any]], text: str, output_len: int) -> dict[str, Any]:
    content = [*media, {"type": "text", "text": text}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_at_a_time(
    http: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]
) -> list[RequestResult]:
    start = time.perf_counter()
    results = []
    for i, b in enumerate(bodies):
        result = await send(http, url + "/chat/completions", BenchRequest(i, "image", b), start)
        if not result.ok:
            raise RuntimeError(f"a request failed: {result.error}")
        results.append(result)
    return results


async def measure(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        # warm-up: every path once (images of their own: nothing measured is cached)
        warm = [body(model, [image_part(seed - 1 - i) for i in range(4)], "Hi", 4)]
        warm.append(body(model, [video_part(seed - 1)], "Hi", 4))
        await one_at_a_time(http, url, warm)
        four = [
            body(model, [image_part(seed + 10 * r + i) for i in range(4)], "Compare them.", 8)
            for r in range(args.repeats)
        ]
        video = [
            body(model, [video_part(seed + r)], "What happens?", 8) for r in range(args.repeats)
        ]
        four_ttft = [r.ttft for r in await one_at_a_time(http, url, four)]
        video_ttft = [r.ttft for r in await one_at_a_time(http, url, video)]
        mixed = [
            body(
                model,
                [image_part(seed + 5000 + i)] if i % 2 else [],
                f"Tell me a story, number {i}.",
                args.output_len,
            )
            for i in range(args.mixed)
        ]
        gate = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()

        async def under_load(i: int, b: dict[str, Any]) -> RequestResult:
            async with gate:
                request = BenchRequest(i, "image" if i % 2 else "text", b)
                return await send(http, url + "/chat/completions", request, start)

        loaded = await asyncio.gather(*(under_load(i, b) for i, b in enumerate(mixed)))
        elapsed = time.perf_counter() - start
    tpots = [r.tpot for r in loaded if r.ok and r.tpot is not None]
    return {
        "four_ttft_ms": 1000 * statistics.median(t for t in four_ttft if t is not None),
        "video_ttft_ms": 1000 * statistics.median(t for t in video_ttft if t is not None),
        "req_s": sum(r.ok for r in loaded) / elapsed,
        "tpot_ms": 1000 * statistics.median(tpots) if tpots else math.nan,
        "failed": sum(not r.ok for r in loaded),
    }


def stack(args: argparse.Namespace, checkpoint: Path, on: bool, seed: int) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    language, vision = str(cores[0]), str(cores[-1])
    flags = ("--language-cpus", language, "--encoder-cpus", vision, *(() if on else (OFF,)))
    setup = Setup("on" if on else "off", flags)
    ports = free_serve_ports(encoders=1, languages=1)
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(setup, Path(logs), checkpoint, max_num_batched_tokens=None, ports=ports) as (url, _),
    ):
        return asyncio.run(measure(url, checkpoint.name, args, seed))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="small", help="the demo checkpoint's size")
    parser.add_argument("--repeats", type=int, default=8, help="requests per low-load figure")
    parser.add_argument("--mixed", type=int, default=32, help="requests of the loaded workload")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of off and on")
    parser.add_argument("--doc", action="store_true", help="write docs/performance.md's section")
    args = parser.parse_args()
    checkpoint = cached_demo_checkpoint(args.size)
    print(f"{machine()}\ncheckpoint: {checkpoint}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            name = "on" if on else "off"
            runs[name].append(stack(args, checkpoint, on, 10_000 * (1 + 2 * round_ + on)))
            print(f"  round {round_ + 1}, {name}: {runs[name][-1]}", flush=True)
    rows = {
        name: {key: statistics.median(run[key] for run in done) for key in done[0]}
        for name, done in runs.items()
    }
    print(
        f"\n{'prefill while encoding':<24} {'4-image TTFT p50':>17} {'video TTFT p50':>15} "
        f"{'req/s':>7} {'TPOT p50':>10} {'failed':>7}"
    )
    for name, row in rows.items():
        print(
            f"{name:<24} {row['four_ttft_ms']:>14.0f} ms {row['video_ttft_ms']:>12.0f} ms "
            f"{row['req_s']:>7.2f} {row['tpot_ms']:>7.1f} ms {row['failed']:>7}"
        )
    print(ratios(rows))
    if args.doc:
        command = "python -m bench.prefill_while_encoding " + shlex.join(sys.argv[1:])
        body = markdown(args, rows, command)
        DOC.write_text(with_section(DOC.read_text(), body, STREAMED_START, STREAMED_END))


def ratios(rows: dict[str, dict[str, Any]]) -> str:
    on, off = rows["on"], rows["off"]
    return (
        f"on / off: four-image TTFT {on['four_ttft_ms'] / off['four_ttft_ms']:.2f}x, "
        f"video TTFT {on['video_ttft_ms'] / off['video_ttft_ms']:.2f}x, "
        f"req/s {on['req_s'] / off['req_s']:.2f}x, TPOT {on['tpot_ms'] / off['tpot_ms']:.2f}x"
    )


def markdown(args: argparse.Namespace, rows: dict[str, dict[str, Any]], command: str) -> str:
    commit = head_commit()
    return "\n".join(
        [
            "## Prefill while the images arrive",
            "",
            f"Generated by `bench/prefill_while_encoding.py` on {time.strftime('%Y-%m-%d')} at "
            f"{commit}: {machine()}; the {args.size} demo; Triton and the encoder on one core, "
            f"the language instance on the other; low load: {args.repeats} requests one at a "
            f"time (four 448x448 images; a 16-frame video); at load: {args.mixed} requests, "
            f"half text, half one image, {args.concurrency} in flight, {args.output_len} "
            f"output tokens; medians of {args.rounds} rounds of off and on: `{command}`.",
            "",
            "| prefill while encoding | 4-image TTFT p50 (ms) | video TTFT p50 (ms) "
            "| req/s | TPOT p50 (ms) | failed |",
            "|---|---:|---:|---:|---:|---:|",
            *(
                f"| {name} | {row['four_ttft_ms']:.0f} | {row['video_ttft_ms']:.0f} | "
                f"{row['req_s']:.2f} | {row['tpot_ms']:.1f} | {row['failed']:.0f} |"
                for name, row in rows.items()
            ),
            "",
            ratios(rows).replace("on / off", "On / off") + ".",
        ]
    )


if __name__ == "__main__":
    main()
