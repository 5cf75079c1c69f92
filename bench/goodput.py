"""Goodput against offered load: EPD and a peer (vLLM's CPU build), one server at
a time, same machine, same checkpoint, same client, one run.

    .venv/bin/python -m bench.goodput --peer-url http://127.0.0.1:8100/v1 \\
        --peer-start '../shared/peers/vllm-cpu.sh serve /work/peer {checkpoint} 8100 bfloat16' \\
        --peer-stop '../shared/peers/vllm-cpu.sh stop /work/peer' [--quick] [--doc]

Goodput is the requests a second that finish inside both SLOs (`--goodput`,
default TTFT 3 s and TPOT 100 ms, what a chat user accepts), as vLLM's own
benchmark client counts it. The workload is bench/peer.py's image workload (one
448x448 image, 64 output tokens), sent at Poisson arrivals: a request does not
wait for another to finish, as users do not.

The peer runs first: its closed-loop capacity (image req/s at 16 in flight, as
bench/peer.py measures it) sets the rates, from 30 % to 110 % of it
(`--shares`); then the peer at each rate, then `epd serve` at the same rates.
Every rate point sends other images (EPD's encoder caches by content).
Prints, per rate, each server's goodput, the share of its requests inside both
SLOs, TTFT and TPOT p50/p99, and EPD's goodput over the peer's; the headline is
that ratio at the rate where the peer's own goodput peaks. Where the peer still
keeps every request inside the SLOs at its peak, no server can do better there,
so a second figure says how far each one holds: the highest rate at which it
keeps HELD of its requests inside both SLOs (the rates go past the peer's
capacity, to 150 %, to find EPD's). `--doc` writes docs/goodput.md's section for this CPU
class and demo size and its plot (docs/performance/goodput-CLASS-SIZE.png).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.peer import CONCURRENCY, WARMUP, p, peer_parser, shell, with_section, workloads
from bench.report import FIGURES, REPO, Setup, cpu_class, head_commit, machine, serve
from services.loadgen.command import first_model, parse_slo, strict_json
from services.loadgen.runner import RunConfig, run
from services.loadgen.summary import summarize
from services.loadgen.workload import build_requests
from services.model.demo import SIZES, cached_demo_checkpoint

DOC = REPO / "docs" / "goodput.md"
SHARES = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5)
HELD = 0.9  # of a rate point's requests inside both SLOs: the server holds that rate
SLO = ("ttft:3000", "tpot:100")
SECONDS = 40.0  # of arrivals a rate point sends (quick: half)
LEAST = 12  # requests a rate point sends at the least


@dataclass(frozen=True)
class Point:
    """One server at one offered rate."""

    rate: float
    goodput: float
    completed: int
    failed: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    attained: float  # the share of the requests sent that finished inside both SLOs

    @classmethod
    def of(cls, rate: float, summary: dict[str, Any]) -> Point:
        return cls(
            rate=rate,
            goodput=summary["goodput"],
            completed=summary["completed"],
            failed=summary["failed"],
            ttft_p50=p(summary, "ttft", "median"),
            ttft_p99=p(summary, "ttft", "p99"),
            tpot_p50=p(summary, "tpot", "median"),
            tpot_p99=p(summary, "tpot", "p99"),
            attained=summary["slo_attainment"],
        )


def warm(base_url: str, model: str) -> None:
    requests = build_requests(replace(workloads(True)["image"], seed=99), model)
    config = RunConfig(base_url, max_concurrency=1, warmup=0, progress=False)
    asyncio.run(run(config, requests[:WARMUP]))


def capacity(base_url: str, model: str, quick: bool) -> float:
    """Image requests a second at 16 in flight (bench/peer.py's closed loop)."""
    requests = build_requests(replace(workloads(quick)["image"], seed=98), model)
    config = RunConfig(base_url, max_concurrency=CONCURRENCY, warmup=0, progress=False)
    return float(summarize(asyncio.run(run(config, requests)))["request_throughput"])


def sweep(base_url: str, rates: list[float], quick: bool, slo: dict[str, float]) -> list[Point]:
    """The image workload at each rate, Poisson arrivals, other images at each."""
    model = first_model(base_url, "")
    warm(base_url, model)
    points = []
    for index, rate in enumerate(rates):
        count = max(LEAST, round(rate * SECONDS / (2 if quick else 1)))
        workload = replace(workloads(quick)["image"], num_prompts=count, seed=200 + index)
        config = RunConfig(base_url, request_rate=rate, warmup=0, seed=index, progress=False)
        summary = summarize(asyncio.run(run(config, build_requests(workload, model))), slo)
        points.append(Point.of(rate, summary))
        print(
            f"  {rate:.2f} req/s: goodput {points[-1].goodput:.2f} "
            f"({points[-1].attained:.0%} inside the SLOs), TTFT p50 "
            f"{points[-1].ttft_p50:.0f} ms, TPOT p99 {points[-1].tpot_p99:.0f} ms",
            flush=True,
        )
    return points


def headline(epd: list[Point], peer: list[Point]) -> tuple[float, float]:
    """(the rate where the peer's goodput peaks, EPD's goodput over the peer's there)."""
    best = max(range(len(peer)), key=lambda i: peer[i].goodput)
    ratio = epd[best].goodput / peer[best].goodput if peer[best].goodput else float("inf")
    return peer[best].rate, ratio


def held(points: list[Point]) -> float:
    """The highest rate at which a server kept HELD of its requests inside both
    SLOs (0.0: none)."""
    return max((q.rate for q in points if q.attained >= HELD), default=0.0)


def holding(epd: list[Point], peer: list[Point], peer_name: str) -> str:
    """The sentence of `held`: each server's rate, and EPD's over the peer's."""
    top = max(q.rate for q in epd)
    rates = {"EPD": held(epd), peer_name: held(peer)}
    said = [f"{n} {'at least ' if rate == top else ''}{rate:.2f}" for n, rate in rates.items()]
    ratio = f"{rates['EPD'] / rates[peer_name]:.2f}x" if rates[peer_name] else "-"
    return (
        f"Highest offered rate with {HELD:.0%} of requests inside both SLOs: "
        f"{', '.join(said)} req/s; EPD / {peer_name} {ratio}."
    )


def table(epd: list[Point], peer: list[Point], peer_name: str) -> list[str]:
    lines = [
        f"| offered req/s | EPD goodput | {peer_name} goodput | EPD / peer | inside SLOs | "
        f"TTFT p50 EPD / {peer_name} (ms) | TTFT p99 | TPOT p50 | TPOT p99 | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e, q in zip(epd, peer, strict=True):
        ratio = f"{e.goodput / q.goodput:.2f}x" if q.goodput else "-"
        lines.append(
            f"| {e.rate:.2f} | {e.goodput:.2f} | {q.goodput:.2f} | {ratio} | "
            f"{e.attained:.0%} / {q.attained:.0%} | {e.ttft_p50:.0f} / {q.ttft_p50:.0f} | "
            f"{e.ttft_p99:.0f} / {q.ttft_p99:.0f} | "
            f"{e.tpot_p50:.0f} / {q.tpot_p50:.0f} | {e.tpot_p99:.0f} / {q.tpot_p99:.0f} | "
            f"{e.failed} / {q.failed} |"
        )
    return lines


def plot(epd: list[Point], peer: list[Point], peer_name: str, path: Path) -> None:
    from services.loadgen.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in (("EPD", epd), (peer_name, peer)):
        ax.plot([q.rate for q in points], [q.goodput for q in points], "o-", label=name)
    top = max(q.rate for q in epd)
    ax.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax.set_xlabel("offered load (image requests/s, Poisson)")
    ax.set_ylabel("goodput (requests/s inside both SLOs)")
    ax.set_title(cpu_class())
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def picture_path(size: str) -> Path:
    """This CPU class's and demo size's plot."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{cpu_class()} {size}".lower()).strip("-")
    return FIGURES / f"goodput-{slug}.png"


def section(
    epd: list[Point], peer: list[Point], peer_name: str, capacity_rps: float, args: Any
) -> str:
    rate, ratio = headline(epd, peer)
    picture = picture_path(args.size)
    command = "python -m bench.goodput " + shlex.join(sys.argv[1:])
    return "\n".join(
        [
            f"## {cpu_class()}, the {args.size} demo",
            "",
            f"Generated by `bench/goodput.py` on {time.strftime('%Y-%m-%d')} at "
            f"{head_commit() or 'an unknown commit'}: {machine()}. "
            f"One 448x448 image and 64 output tokens a request, Poisson arrivals; SLO "
            f"{' '.join(args.goodput)} (ms). {peer_name}'s closed-loop capacity (16 in "
            f"flight): {capacity_rps:.2f} image req/s; the rates are "
            f"{', '.join(f'{s:.0%}' for s in args.shares)} of it.",
            "",
            "```",
            command,
            "```",
            "",
            f"**Goodput at the rate where {peer_name}'s peaks ({rate:.2f} req/s): "
            f"EPD / {peer_name} {ratio:.2f}x.** {holding(epd, peer, peer_name)}",
            "",
            *table(epd, peer, peer_name),
            "",
            f"![goodput against offered load]({picture.relative_to(DOC.parent)})",
        ]
    )


def with_class_section(doc: str, body: str, size: str) -> str:
    start = f"<!-- bench/goodput.py: {cpu_class()}, {size} demo: start -->"
    end = f"<!-- bench/goodput.py: {cpu_class()}, {size} demo: end -->"
    if start in doc:
        return with_section(doc, body, start, end)
    return doc.rstrip("\n") + f"\n\n{start}\n{body}\n{end}\n"


def main() -> None:
    parser = peer_parser(__doc__)
    parser.add_argument("--goodput", nargs="+", default=list(SLO), help="SLOs, e.g. ttft:3000")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    parser.add_argument("--quick", action="store_true", help="half the requests")
    parser.add_argument("--size", default="small", choices=tuple(SIZES), help="the demo's size")
    parser.add_argument("--json", help="write every point here")
    parser.add_argument("--doc", action="store_true", help="write docs/goodput.md's section")
    args = parser.parse_args()
    slo = parse_slo(args.goodput)
    checkpoint = cached_demo_checkpoint(args.size)
    print(f"{machine()}\ncheckpoint: {checkpoint}\n{args.peer_name}", flush=True)
    if args.peer_start:
        shell(args.peer_start, checkpoint)
    try:
        model = first_model(args.peer_url, "")
        warm(args.peer_url, model)
        capacity_rps = capacity(args.peer_url, model, args.quick)
        rates = [round(share * capacity_rps, 3) for share in args.shares]
        print(f"  capacity {capacity_rps:.2f} req/s; rates {rates}", flush=True)
        peer = sweep(args.peer_url, rates, args.quick, slo)
    finally:
        if args.peer_stop:
            shell(args.peer_stop, checkpoint)
    print("EPD (epd serve)", flush=True)
    epd_args = ("--model", str(checkpoint), *(a for f in args.epd_arg for a in shlex.split(f)))
    with (
        tempfile.TemporaryDirectory() as logs,
        serve(Setup("epd", epd_args), Path(logs), max_num_batched_tokens=None) as (url, _),
    ):
        epd = sweep(url, rates, args.quick, slo)
    print("\n".join(table(epd, peer, args.peer_name)))
    rate, ratio = headline(epd, peer)
    print(f"goodput at {args.peer_name}'s peak ({rate:.2f} req/s): EPD / peer {ratio:.2f}x")
    print(holding(epd, peer, args.peer_name))
    if args.doc:
        plot(epd, peer, args.peer_name, picture_path(args.size))
        body = section(epd, peer, args.peer_name, capacity_rps, args)
        DOC.write_text(with_class_section(DOC.read_text(), body, args.size))
    if args.json:
        points = {"epd": [asdict(q) for q in epd], "peer": [asdict(q) for q in peer]}
        payload = {"machine": machine(), "capacity": capacity_rps, **points}
        Path(args.json).write_text(json.dumps(strict_json(payload), indent=1))


if __name__ == "__main__":
    main()
