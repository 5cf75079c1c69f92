"""Throughput of tool calling: the same requests with `tool_choice="required"`
(the output held to a call by its grammar), with the tools offered but
`tool_choice="none"` (their prompt, no grammar), and without tools, against one
`epd serve` (the small demo model), in turns, in one run.

    .venv/bin/python -m bench.tools [--rounds 3] [--requests 32]

Each request has a 64-word text prompt and runs 32 output tokens (ignore_eos;
the function takes a free-text note, so a forced call runs as long as a free
answer); a burst of them, 8 at a time. The figure is each variant's request
throughput over the rounds (medians), as a ratio to the run without tools:
"required" against "none" is what the grammar costs, "none" against no tools
is what the tools' longer prompt costs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
from pathlib import Path
from typing import Any

from bench.report import Setup, machine, serve
from services.loadgen.runner import RunConfig, run
from services.loadgen.summary import summarize
from services.loadgen.workload import Workload, build_requests

VARIANTS: dict[str, dict[str, Any]] = {
    "without tools": {},
    'tools, tool_choice="none"': {"tool_ratio": 1.0, "tool_choice": "none"},
    'tools, tool_choice="required"': {"tool_ratio": 1.0, "tool_choice": "required"},
}


def measure(base_url: str, requests: int, variant: dict[str, Any]) -> float:
    """Requests/s of one burst of the variant's requests."""
    workload = Workload(
        num_prompts=requests, input_len=64, output_len=32, image_ratio=0.0, **variant
    )
    config = RunConfig(
        base_url=base_url,
        request_rate=math.inf,
        max_concurrency=8,
        warmup=2,
        seed=0,
        progress=False,
    )
    summary = summarize(asyncio.run(run(config, build_requests(workload, "demo-small"))))
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed")
    return float(summary["request_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with serve(Setup("epd serve", ()), Path("/tmp/epd-tools")) as (url, _):
        for round_ in range(args.rounds):
            for name, variant in VARIANTS.items():
                rates[name].append(measure(url, args.requests, variant))
                print(f"round {round_ + 1}: {name}: {rates[name][-1]:.2f} req/s", flush=True)
    base = statistics.median(rates["without tools"])
    print(f"\n{machine()}; {args.rounds} rounds of {args.requests} requests, medians")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<32} {median:6.2f} req/s  {median / base:5.2f}x")
    none = statistics.median(rates['tools, tool_choice="none"'])
    required = statistics.median(rates['tools, tool_choice="required"'])
    print(f"{'the grammar: required / none':<32} {required / none:13.2f}x")


if __name__ == "__main__":
    main()
