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

`--uneven` runs another case instead (issue 76): two language instances, and chats
in two families, each family's chats beginning with the family's system prompt
(which routes them together), then a picture and a ~400-token document of the
chat's own; one family has twice as many chats as the other, so prefix routing
sends twice the load to one instance. Under one load bound (`--load-factor 1.5
--load-slack 1`, so that the busy instance is past it), three routings in one run:
by prefix with the chat's KV moved where a turn goes elsewhere, by prefix alone
(the turn computes its history again), and by load alone. Reported for each:
later-turn TTFT p50 and p99, requests/s, and what moved (turns, pages, bytes, the
fetches' mean time, the instances' crossover in pages); `--doc` writes
docs/kv-moves.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import random
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
from bench.report import (
    DOC,
    MULTITURN_END,
    MULTITURN_START,
    REPO,
    Setup,
    head_commit,
    machine,
    serve,
)
from services.loadgen.client import RequestResult, send
from services.loadgen.synthetic import encode_image, random_image
from services.loadgen.workload import BenchRequest
from services.model.demo import cached_demo_checkpoint
from services.runtime.ports import METRICS_OFFSET, free_serve_ports

KV_MOVES_DOC = REPO / "docs" / "kv-moves.md"

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


def document(seed: int, words: int = 300) -> str:
    """A chat's own document (~1.3 tokens a word)."""
    rng = random.Random(seed)
    vocabulary = ("catalogue", "item", "colour", "size", "price", "shelf", "order", "label")
    return " ".join(rng.choice(vocabulary) for _ in range(words))


async def converse(
    http: aiohttp.ClientSession,
    base_url: str,
    model: str,
    session: int,
    turns: int,
    output_len: int,
    run_start: float,
    new_images: bool = False,
    family: int | None = None,
) -> list[tuple[int, RequestResult]]:
    """One session's turns, in order: (turn, its result). In a `family`, the chat
    begins with the family's system prompt (which routes the family's chats
    together), then its picture with a document of its own."""
    messages: list[dict[str, Any]] = []
    if family is not None:
        messages.append({"role": "system", "content": f"You help the staff of shop {family}."})
    out = []
    for turn in range(turns):
        text = QUESTIONS[turn % len(QUESTIONS)]
        if family is not None and turn == 0:
            text = f"{document(session)}\n\n{text}"
        question = {"type": "text", "text": text}
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
    families: bool = False,
) -> dict[str, Any]:
    """Every session, `concurrency` at a time; TTFT p50 of first and later turns
    (and p99 of later ones), req/s. `families`: two of them, two chats of the
    first for one of the second, interleaved."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        warm = await converse(http, base_url, model, 10_000, 1, 4, time.perf_counter())
        if not warm[0][1].ok:
            raise RuntimeError(f"the warm-up request failed: {warm[0][1].error}")
        start = time.perf_counter()

        async def one(session: int) -> list[tuple[int, RequestResult]]:
            async with gate:
                family = (0 if session % 3 < 2 else 1) if families else None
                return await converse(
                    http, base_url, model, session, turns, output_len, start, new_images, family
                )

        done = await asyncio.gather(*(one(s) for s in range(sessions)))
        elapsed = time.perf_counter() - start
    results = [item for chat in done for item in chat]
    first = [r.ttft for t, r in results if t == 0 and r.ok and r.ttft is not None]
    later = [r.ttft for t, r in results if t > 0 and r.ok and r.ttft is not None]
    return {
        "first_ttft_ms": 1000 * statistics.median(first) if first else math.nan,
        "later_ttft_ms": 1000 * statistics.median(later) if later else math.nan,
        "later_ttft_p99_ms": 1000 * _p99(later) if later else math.nan,
        "req_s": sum(r.ok for _, r in results) / elapsed,
        "failed": sum(not r.ok for _, r in results),
        "requests": len(results),
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


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
            args.uneven,
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


# The uneven case's routings: (name, `epd serve` flags), one load bound for all.
UNEVEN_BOUND = ("--load-factor", "1.5", "--load-slack", "1")
UNEVEN = (
    ("prefix, KV moved", ("--language-routing", "prefix")),
    ("prefix alone", ("--language-routing", "prefix", "--no-prefix-moves")),
    ("load alone", ("--language-routing", "least-loaded", "--no-prefix-moves")),
)


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page by its name, summed over its labels."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def uneven(args: argparse.Namespace, checkpoint: Path, flags: tuple[str, ...]) -> dict[str, Any]:
    """The uneven case under one routing: the conversations, then what moved."""
    ports = free_serve_ports(encoders=1, languages=2)
    setup = Setup("epd", ("--model", str(checkpoint), "--languages", "2", *UNEVEN_BOUND, *flags))
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(setup, Path(logs), max_num_batched_tokens=None, ports=ports) as (url, _),
    ):
        result = run(args, url, checkpoint.name)
        metrics = "http://127.0.0.1:{}/metrics"
        broker = scrape(metrics.format(ports["broker-port"] + METRICS_OFFSET))
        port = ports["language-port"] + METRICS_OFFSET
        languages = [scrape(metrics.format(port + i)) for i in range(2)]

    def summed(name: str) -> float:
        return sum(language.get(name, 0.0) for language in languages)

    fetched = summed("epd_language_prefix_fetch_seconds_count")
    result |= {
        "moved_turns": broker.get("epd_broker_prefix_moves_total", 0.0),
        "fetched": fetched,
        "pages": summed("epd_language_prefix_fetch_pages_total"),
        "mib": summed("epd_language_prefix_fetch_bytes_total") / 2**20,
        "fetch_ms": 1000 * summed("epd_language_prefix_fetch_seconds_sum") / max(1.0, fetched),
        "crossover": [
            language.get("epd_language_prefix_move_min_pages", 0) for language in languages
        ],
        "prefill_ms_per_page": [
            1000 * 16 * language.get("epd_language_prefill_token_seconds", 0)
            for language in languages
        ],
        "computed_tokens": summed("epd_language_prompt_tokens_total"),
    }
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
    parser.add_argument(
        "--uneven", action="store_true", help="the uneven case instead (the module's doc)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="the uneven case's rounds")
    parser.add_argument("--doc", action="store_true", help="write docs/performance.md's section")
    args = parser.parse_args()
    checkpoint = cached_demo_checkpoint(args.size)
    print(f"{machine()}\ncheckpoint: {checkpoint}", flush=True)
    if args.uneven:
        main_uneven(args, checkpoint)
        return
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


def main_uneven(args: argparse.Namespace, checkpoint: Path) -> None:
    """Each routing `--rounds` times, in turn (the order reversed every other
    round: this machine drifts), and each figure's median over the rounds."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in UNEVEN}
    for round_ in range(args.rounds):
        for name, flags in UNEVEN if round_ % 2 == 0 else reversed(UNEVEN):
            runs[name].append(uneven(args, checkpoint, flags))
            print(f"  {name}: {runs[name][-1]}", flush=True)
    rows = {name: _medians(results) for name, results in runs.items()}
    table = uneven_table(rows)
    print("\n".join(table))
    if args.doc:
        command = "python -m bench.multiturn " + shlex.join(sys.argv[1:])
        KV_MOVES_DOC.write_text(uneven_markdown(args, table, command) + "\n")


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (a list figure: the last round's)."""
    return {
        key: statistics.median(r[key] for r in results)
        if isinstance(value, int | float)
        else results[-1][key]
        for key, value in results[0].items()
    }


def uneven_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    moved = rows[UNEVEN[0][0]]
    lines = [
        "| routing | later-turn TTFT p50 (ms) | p99 (ms) | req/s | prompt tokens computed "
        "| turns moved | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {row['later_ttft_ms']:.0f} | {row['later_ttft_p99_ms']:.0f} | "
            f"{row['req_s']:.2f} | {row['computed_tokens']:.0f} | {row['moved_turns']:.0f} | "
            f"{row['failed']} |"
            for name, row in rows.items()
        ),
        "",
        f"With the KV moved: {moved['fetched']:.0f} fetches brought {moved['pages']:.0f} pages "
        f"({moved['mib']:.1f} MiB), {moved['fetch_ms']:.1f} ms each on average; the "
        f"instances' crossover at the end: {', '.join(f'{n:.0f}' for n in moved['crossover'])} "
        f"pages (a page's measured prefill: "
        f"{', '.join(f'{ms:.1f}' for ms in moved['prefill_ms_per_page'])} ms; "
        f"fetched: {moved['fetch_ms'] / max(1.0, moved['pages'] / max(1.0, moved['fetched'])):.1f}"
        " ms). The KV moved, "
        + "; ".join(
            f"against {name}: later-turn TTFT p99 "
            f"{moved['later_ttft_p99_ms'] / row['later_ttft_p99_ms']:.2f}x, "
            f"req/s {moved['req_s'] / row['req_s']:.2f}x"
            for name, row in list(rows.items())[1:]
        )
        + ".",
    ]
    return lines


def uneven_markdown(args: argparse.Namespace, table: list[str], command: str) -> str:
    return "\n".join(
        [
            "# A conversation moves with its KV",
            "",
            f"Generated by `bench/multiturn.py --uneven` on {time.strftime('%Y-%m-%d')} at "
            f"{head_commit()}: {machine()}; the {args.size} demo; two language instances, one "
            f"encoder; {args.sessions} chats of {args.turns} turns in two families (each chat "
            "begins with its family's system prompt, then a 448x448 picture and a ~400-token "
            "document of its own; two chats of the first family for one of the second), "
            f"{args.output_len} output tokens, "
            f"{args.concurrency} chats at once; load bound {' '.join(UNEVEN_BOUND)}; "
            f"medians of {args.rounds} rounds: `{command}`.",
            "",
            *table,
        ]
    )


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
