"""The encoder planner under a load whose image share steps up, then down.

    .venv/bin/python -m bench.encoder_planner [--doc] [--plot PATH]

`epd serve --encoders auto --min-encoders 1 --max-encoders 3` on the small demo
checkpoint (the planner's timings shortened so that a run takes minutes:
`--scale-up-after 3 --scale-down-after 20 --scale-cooldown 8`) takes requests
at a fixed rate in three phases: text only, then 80 % images (every image new:
no cache helps), then text only again. Once a second the benchmark reads the
gateway's /health (the encoders serving); per window it prints the encoders,
the requests' image share and the image requests' TTFT p99: the timeline. It
then says how long after the step up the planner added an encoder, how the
image TTFT p99 of the image phase's last windows compares with its first, how
long after the step down the extra encoders were retired, and how many
requests failed (the goal: none, retirements included). `--plot` draws the
timeline; `--doc` writes docs/performance.md's section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.peer import with_section
from bench.report import DOC, PLANNER_END, PLANNER_START, Setup, machine, serve
from services.loadgen.client import RequestResult
from services.loadgen.runner import RunConfig, run
from services.loadgen.stats import percentile
from services.loadgen.workload import Workload, build_requests

PLANNER_ARGS = (
    *("--encoders", "auto", "--min-encoders", "1", "--max-encoders", "3"),
    *("--scale-up-after", "3", "--scale-down-after", "20", "--scale-cooldown", "8"),
)
WINDOW_S = 5.0


@dataclass(frozen=True)
class Phase:
    name: str
    image_ratio: float
    seconds: float


PHASES = (Phase("text", 0.0, 20.0), Phase("80% images", 0.8, 60.0), Phase("text", 0.0, 60.0))


class EncoderCount(threading.Thread):
    """Polls /health once a second: (seconds since start, encoders serving)."""

    def __init__(self, base_url: str, start: float) -> None:
        super().__init__(daemon=True)
        self.url = base_url.removesuffix("/v1") + "/health"
        self.start_time = start
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as reply:
                    components = json.load(reply)["components"].values()
            except OSError:
                continue
            serving = sum(c["role"] == "encoder" and c["state"] == "serving" for c in components)
            self.samples.append((time.monotonic() - self.start_time, serving))


@dataclass
class Trace:
    results: list[tuple[float, RequestResult]]  # each with its start, seconds since t0
    samples: list[tuple[float, int]]  # encoders serving, once a second
    phase_starts: list[float]


def drive(base_url: str, rate: float) -> Trace:
    """The three phases at `rate` requests/s, one after the other."""
    t0 = time.monotonic()
    watch = EncoderCount(base_url, t0)
    watch.start()
    results: list[tuple[float, RequestResult]] = []
    starts = []
    for n, phase in enumerate(PHASES):
        workload = Workload(
            num_prompts=round(rate * phase.seconds),
            input_len=32,
            output_len=16,
            image_ratio=phase.image_ratio,
            seed=20 + n,
        )
        config = RunConfig(base_url=base_url, request_rate=rate, warmup=0, seed=n, progress=False)
        began = time.monotonic() - t0
        starts.append(began)
        result = asyncio.run(run(config, build_requests(workload, "demo-small")))
        results += [(began + r.start, r) for r in result.results]
    watch.stopped.set()
    watch.join()
    return Trace(results, watch.samples, starts)


@dataclass(frozen=True)
class Window:
    start: float
    encoders: int
    image_share: float
    image_ttft_p99: float | None
    failed: int


def windows(
    results: list[tuple[float, RequestResult]], samples: list[tuple[float, int]]
) -> list[Window]:
    end = max(t for t, _ in results)
    out = []
    start = 0.0
    while start <= end:
        inside = [r for t, r in results if start <= t < start + WINDOW_S]
        counts = [n for t, n in samples if start <= t < start + WINDOW_S]
        images = [r.ttft for r in inside if r.kind == "image" and r.ok and r.ttft is not None]
        out.append(
            Window(
                start,
                max(counts, default=0),
                sum(r.kind == "image" for r in inside) / len(inside) if inside else 0.0,
                percentile(images, 99) if images else None,
                sum(not r.ok for r in inside),
            )
        )
        start += WINDOW_S
    return out


def first_after(
    samples: list[tuple[float, int]], moment: float, test: Callable[[int], bool]
) -> float | None:
    """Seconds from `moment` to the first sample after it that passes `test`."""
    return next((t - moment for t, n in samples if t >= moment and test(n)), None)


def image_ttft_p99(trace: Trace, start: float, end: float) -> float:
    ttfts = [
        r.ttft
        for t, r in trace.results
        if start <= t < end and r.kind == "image" and r.ok and r.ttft is not None
    ]
    return percentile(ttfts, 99)


def markdown(rows: list[Window], trace: Trace, rate: float) -> str:
    up, down = trace.phase_starts[1], trace.phase_starts[2]
    samples = trace.samples
    added = first_after(samples, up, lambda n: n > 1)
    most = first_after(samples, up, lambda n: n == max(count for _, count in samples))
    retired = first_after(samples, down, lambda n: n == 1)
    one = image_ttft_p99(trace, up, up + (added if added is not None else down - up))
    more = image_ttft_p99(trace, up + most, down) if most is not None else float("nan")
    failed = sum(not r.ok for _, r in trace.results)
    lines = [
        "## The encoder planner: a step of image traffic",
        "",
        f"Generated by `bench/encoder_planner.py` on {time.strftime('%Y-%m-%d')}: {machine()}; "
        f"the small demo checkpoint; `epd serve {' '.join(PLANNER_ARGS)}`; {rate:g} requests/s: "
        f"{PHASES[0].seconds:.0f} s text, {PHASES[1].seconds:.0f} s 80 % images (each new), "
        f"{PHASES[2].seconds:.0f} s text.",
        "",
        "```",
        "python -m bench.encoder_planner",
        "```",
        "",
        "| t (s) | encoders | image share | image TTFT p99 (s) | failed |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {w.start:.0f} | {w.encoders} | {w.image_share:.0%} | "
            f"{'-' if w.image_ttft_p99 is None else f'{w.image_ttft_p99:.2f}'} | {w.failed} |"
            for w in rows[:: round(30 / WINDOW_S)]  # every 30 s; the plot has every window
        ),
        "",
        f"An encoder was added {_seconds(added)} after the step up. The image requests' "
        f"TTFT p99 was {one:.2f} s while one encoder served them and {more:.2f} s once the "
        f"most encoders did; the extra encoders were all retired {_seconds(retired)} after "
        f"the step down; {failed} requests failed. On this machine every encoder shares "
        "the same cores with Triton and the language instance: more encoders add "
        "preprocessing and encode concurrency, not compute.",
    ]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def plot(rows: list[Window], steps: list[float], path: Path) -> None:
    from services.loadgen.plots import _pyplot

    plt = _pyplot()
    fig, left = plt.subplots(figsize=(8, 4))
    starts = [w.start for w in rows]
    left.step(starts, [w.encoders for w in rows], where="post", label="encoders", color="C0")
    left.set_xlabel("seconds")
    left.set_ylabel("encoders serving")
    right = left.twinx()
    ttfts = [w.image_ttft_p99 for w in rows]
    right.plot(starts, [t if t is not None else float("nan") for t in ttfts], "o-", color="C1")
    right.set_ylabel("image TTFT p99 (s)", color="C1")
    for moment in steps:  # the step up and the step down
        left.axvline(moment, color="grey", linestyle=":")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s")
    parser.add_argument("--plot", type=Path, help="draw the timeline here (PNG)")
    parser.add_argument("--doc", action="store_true", help="write docs/performance.md's section")
    args = parser.parse_args()
    with serve(Setup("planner", PLANNER_ARGS), Path("/tmp/epd-planner")) as (url, _):
        trace = drive(url, args.rate)
    rows = windows(trace.results, trace.samples)
    body = markdown(rows, trace, args.rate)
    if args.plot:
        plot(rows, trace.phase_starts[1:], args.plot)
        if args.plot.resolve().is_relative_to(DOC.parent):
            picture = args.plot.resolve().relative_to(DOC.parent)
            body += f"\n\n![encoders and image TTFT p99 over time]({picture})"
    print(body)
    if args.doc:
        DOC.write_text(with_section(DOC.read_text(), body, PLANNER_START, PLANNER_END))


if __name__ == "__main__":
    main()
