"""Conversations about images: EPD against a peer (vLLM's CPU build), one server
at a time, same machine, same checkpoint, same client, one run.

    .venv/bin/python -m bench.multiturn --peer-url http://127.0.0.1:8100/v1 \\
        --peer-start '../shared/peers/vllm-cpu.sh serve /work/peer {checkpoint} 8100 bfloat16' \\
        --peer-stop '../shared/peers/vllm-cpu.sh stop /work/peer' [--sessions 16 --turns 3]

A session is a chat of `--turns` turns that starts with its own 448x448 image
(`--new-images`: each later turn brings another beside its question, so a turn
has held images and a new one); each turn resends the whole history (the
images, every question and the answers the server gave), streamed,
`--output-len` tokens (ignore_eos); `--concurrency`
sessions run at once, each turn after the last one's answer. Reported for each
server: the first turns' TTFT p50 (the image is new), the later turns' (the
history is what a prefix cache holds) and requests/s over the run. Then EPD with
two language instances, with the broker's prefix routing and by load alone: the
share of later turns routed to an instance that served the conversation before
(the broker's epd_broker_prefix_routes counter).

Targets (issue 58): later-turn TTFT p50 at most 0.5x EPD's own first-turn TTFT and
at most the peer's; requests/s at least the peer's; with two instances, at least
90 % of later turns on the instance of the turn before with prefix routing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.peer import shell, with_section
from bench.report import DOC, MULTITURN_END, MULTITURN_START, Setup, head_commit, machine, serve
from services.loadgen.client import RequestResult, send
from services.loadgen.synthetic import encode_image, random_image
from services.loadgen.workload import BenchRequest
from services.model.demo import cached_demo_checkpoint
from services.runtime.ports import METRICS_OFFSET, free_serve_ports

QUESTIONS = (
    "What is in this picture?",
    "Describe its colours in detail.",
    "What would you call it?",
    "Which part of it stands out most?",
    "Summarize what we said about it.",
)


def image_url(session: int, turn: int = 0) -> str:
    data = encode_image(random_image(448, 448, seed=1000 + session + 100_000 * turn), "JPEG")
    return f"data:image/jpeg;base64,{base64.b64encode(data).decode()}"


def image_part(session: int, turn: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": image_url(session, turn)}}


async def converse(
    http: aiohttp.ClientSession,
    base_url: str,
    model: str,
    session: int,
    turns: int,
    output_len: int,
    run_start: float,
    new_images: bool = False,
) -> list[tuple[int, RequestResult]]:
    """One session's turns, in order: (turn, its result)."""
    messages: list[dict[str, Any]] = []
    out = []
    for turn in range(turns):
        question = {"type": "text", "text": QUESTIONS[turn % len(QUESTIONS)]}
        image = [image_part(session, turn)] if turn == 0 or new_images else []
        messages.append({"role": "user", "content": [*image, question]})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = BenchRequest(session * turns + turn, "image" if turn == 0 else "text", body)
        result = await send(http, base_url + request.path, request, run_start)
        out.append((turn, result))
        if not result.ok:
            break  # the rest of this chat has no history to resend
        messages.append({"role": "assistant", "content": result.text})
    return out


async def conversations(
    base_url: str,
    model: str,
    sessions: int,
    turns: int,
    output_len: int,
    concurrency: int,
    new_images: bool = False,
) -> dict[str, Any]:
    """Every session, `concurrency` at a time; TTFT p50 of first and later turns, req/s."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        warm = await converse(http, base_url, model, 10_000, 1, 4, time.perf_counter())
        if not warm[0][1].ok:
            raise RuntimeError(f"the warm-up request failed: {warm[0][1].error}")
        start = time.perf_counter()

        async def one(session: int) -> list[tuple[int, RequestResult]]:
            async with gate:
                return await converse(
                    http, base_url, model, session, turns, output_len, start, new_images
                )

        done = await asyncio.gather(*(one(s) for s in range(sessions)))
        elapsed = time.perf_counter() - start
    results = [item for chat in done for item in chat]
    first = [r.ttft for t, r in results if t == 0 and r.ok and r.ttft is not None]
    later = [r.ttft for t, r in results if t > 0 and r.ok and r.ttft is not None]
    return {
        "first_ttft_ms": 1000 * statistics.median(first) if first else math.nan,
        "later_ttft_ms": 1000 * statistics.median(later) if later else math.nan,
        "req_s": sum(r.ok for _, r in results) / elapsed,
        "failed": sum(not r.ok for _, r in results),
        "requests": len(results),
    }


def run(args: argparse.Namespace, base_url: str, model: str) -> dict[str, Any]:
    """The command line's conversations against one server."""
    return asyncio.run(
        conversations(
            base_url,
            model,
            args.sessions,
            args.turns,
            args.output_len,
            args.concurrency,
            args.new_images,
        )
    )


def broker_counter(metrics_url: str, name: str) -> dict[str, float]:
    """A counter's values by its one label's value (prometheus_client's parser)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        next(iter(sample.labels.values())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if sample.name == name + "_total"
    }


def epd(args: argparse.Namespace, checkpoint: Path, languages: int, routing: str) -> dict[str, Any]:
    """`epd serve` with `languages` language instances and the broker's `routing`."""
    ports = free_serve_ports(encoders=1, languages=languages)
    setup = Setup(
        "epd",
        ("--model", str(checkpoint), "--languages", str(languages), "--language-routing", routing),
    )
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(setup, Path(logs), max_num_batched_tokens=None, ports=ports) as (url, _),
    ):
        result = run(args, url, checkpoint.name)
        metrics = f"http://127.0.0.1:{ports['broker-port'] + METRICS_OFFSET}/metrics"
        routes = broker_counter(metrics, "epd_broker_prefix_routes")
    later = args.sessions * (args.turns - 1)
    result["later_on_their_instance"] = routes.get("yes", 0.0) / later if later else math.nan
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer-url", help="the peer's /v1 URL (none: EPD alone)")
    parser.add_argument("--peer-name", default="vLLM")
    parser.add_argument("--peer-start", help="shell command that starts the peer and waits")
    parser.add_argument("--peer-stop", help="shell command that stops the peer")
    parser.add_argument("--size", default="small", help="the demo checkpoint's size")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions at once")
    parser.add_argument(
        "--new-images", action="store_true", help="each later turn brings a new image too"
    )
    parser.add_argument("--doc", action="store_true", help="write docs/performance.md's section")
    args = parser.parse_args()
    checkpoint = cached_demo_checkpoint(args.size)
    print(f"{machine()}\ncheckpoint: {checkpoint}", flush=True)
    rows = {"EPD": epd(args, checkpoint, 1, "prefix")}
    print(f"  EPD: {rows['EPD']}", flush=True)
    if args.peer_url:
        if args.peer_start:
            shell(args.peer_start, checkpoint)
        try:
            rows[args.peer_name] = run(args, args.peer_url, checkpoint.name)
        finally:
            if args.peer_stop:
                shell(args.peer_stop, checkpoint)
        print(f"  {args.peer_name}: {rows[args.peer_name]}", flush=True)
    routed = {routing: epd(args, checkpoint, 2, routing) for routing in ("prefix", "least-loaded")}
    print(
        f"\n{'server':<12} {'first TTFT p50':>15} {'later TTFT p50':>15} {'req/s':>7} {'failed':>7}"
    )
    for name, row in rows.items():
        print(
            f"{name:<12} {row['first_ttft_ms']:>12.0f} ms {row['later_ttft_ms']:>12.0f} ms "
            f"{row['req_s']:>7.2f} {row['failed']:>7}"
        )
    ours = rows["EPD"]
    print(f"EPD later / first turn TTFT: {ours['later_ttft_ms'] / ours['first_ttft_ms']:.2f}x")
    if args.peer_url:
        peer = rows[args.peer_name]
        print(
            f"EPD / {args.peer_name}: later-turn TTFT "
            f"{ours['later_ttft_ms'] / peer['later_ttft_ms']:.2f}x, "
            f"first-turn TTFT {ours['first_ttft_ms'] / peer['first_ttft_ms']:.2f}x, "
            f"req/s {ours['req_s'] / peer['req_s']:.2f}x"
        )
    for routing, row in routed.items():
        print(
            f"two language instances, {routing} routing: "
            f"{row['later_on_their_instance']:.0%} of later turns on their chat's instance, "
            f"later TTFT p50 {row['later_ttft_ms']:.0f} ms, {row['req_s']:.2f} req/s, "
            f"{row['failed']} failed"
        )
    if args.doc:
        body = markdown(args, rows, routed, "python -m bench.multiturn " + shlex.join(sys.argv[1:]))
        DOC.write_text(with_section(DOC.read_text(), body, MULTITURN_START, MULTITURN_END))


def markdown(
    args: argparse.Namespace,
    rows: dict[str, dict[str, Any]],
    routed: dict[str, dict[str, Any]],
    command: str,
) -> str:
    commit = head_commit()
    lines = [
        "## Conversations about images",
        "",
        f"Generated by `bench/multiturn.py` on {time.strftime('%Y-%m-%d')} at {commit}: "
        f"{machine()}; the {args.size} demo; {args.sessions} chats of {args.turns} turns, each "
        f"starting with its own 448x448 image, the history resent each turn, "
        f"{args.output_len} output tokens, {args.concurrency} chats at once: `{command}`.",
        "",
        "| server | first-turn TTFT p50 (ms) | later-turn TTFT p50 (ms) | req/s | failed |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {row['first_ttft_ms']:.0f} | {row['later_ttft_ms']:.0f} | "
            f"{row['req_s']:.2f} | {row['failed']} |"
            for name, row in rows.items()
        ),
        "",
        "With two language instances, later turns routed to their chat's instance: "
        + ", ".join(
            f"{row['later_on_their_instance']:.0%} by {routing} routing "
            f"(later-turn TTFT p50 {row['later_ttft_ms']:.0f} ms)"
            for routing, row in routed.items()
        )
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
