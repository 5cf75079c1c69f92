"""Writes docs/performance-monolithic.md: monolithic against disaggregated serving, same
machine, same checkpoint (the small demo model), same workloads, one run.

    .venv/bin/python -m bench.report [--quick] [--raw DIR] [--arch qwen3_vl_moe]

With `--arch`, the small demo checkpoint of that family is served and the
report goes to docs/performance-monolithic-ARCH.md.

Each configuration is started as a user would (`epd serve ...`, a child
process on free ports) and driven with the same `epd bench` workloads:
text-only, image-only and a 1:9 image:text mix, at several request rates and
as a burst (every request at once, 32 in flight at most).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.launcher.serve import launch
from services.loadgen import plots
from services.loadgen.command import strict_json
from services.loadgen.runner import RunConfig, RunResult, run
from services.loadgen.summary import summarize
from services.loadgen.workload import Workload, build_requests
from services.model.demo import ARCHS, SIZES, cached_demo_checkpoint
from services.runtime.ports import free_serve_ports, serve_port_args

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "performance.md"  # the current report: the sections below
MONOLITHIC = REPO / "docs" / "performance-monolithic.md"  # this script's
TEMPLATE = Path(__file__).with_name("performance.md.in")
FIGURES = REPO / "docs" / "performance"
FAMILIES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE"}
# bench/peer.py, bench/pd.py, bench/encoder_planner.py and bench/tracing.py write
# their sections of DOC between these; bench/encoder_cache.py its of ENCODER_CACHE_DOC.
ENCODER_CACHE_DOC = REPO / "docs" / "encoder-cache.md"
START, END = "<!-- bench/peer.py: start -->", "<!-- bench/peer.py: end -->"
PD_START, PD_END = "<!-- bench/pd.py: start -->", "<!-- bench/pd.py: end -->"
CACHE_START = "<!-- bench/encoder_cache.py: start -->"
CACHE_END = "<!-- bench/encoder_cache.py: end -->"
PLANNER_START = "<!-- bench/encoder_planner.py: start -->"
PLANNER_END = "<!-- bench/encoder_planner.py: end -->"
TRACING_START = "<!-- bench/tracing.py: start -->"
TRACING_END = "<!-- bench/tracing.py: end -->"
MULTITURN_START = "<!-- bench/multiturn.py: start -->"
MULTITURN_END = "<!-- bench/multiturn.py: end -->"
STREAMED_START = "<!-- bench/prefill_while_encoding.py: start -->"
STREAMED_END = "<!-- bench/prefill_while_encoding.py: end -->"


@dataclass(frozen=True)
class Setup:
    name: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    name: str
    image_ratio: float
    num_prompts: int
    rates: tuple[float, ...]


def setups() -> list[Setup]:
    cores = len(os.sched_getaffinity(0))
    half = max(1, cores // 2)
    language = f"0-{half - 1}" if half > 1 else "0"
    encoder = f"{half}-{cores - 1}" if cores - half > 1 else str(half)
    return [
        Setup("monolithic", ("--monolithic",)),
        Setup("disaggregated", ()),
        Setup(
            f"disaggregated, cores split ({language} language / {encoder} vision)",
            ("--language-cpus", language, "--encoder-cpus", encoder),
        ),
    ]


def cases(quick: bool) -> list[Case]:
    scale = 0.5 if quick else 1.0
    return [
        Case("text-only", 0.0, round(48 * scale), (2.0, 4.0, 8.0, math.inf)),
        Case("image-only", 1.0, round(16 * scale), (0.5, 1.0, math.inf)),
        Case("mixed 1:9 image:text", 0.1, round(40 * scale), (1.0, 2.0, 4.0, math.inf)),
    ]


@dataclass(frozen=True)
class ProcessCpu:
    parent: int
    command: list[str]  # its command line's words
    seconds: float  # CPU so far, user and system


def process_cpu() -> dict[int, ProcessCpu]:
    """Every process's parent, command line and CPU seconds so far (/proc)."""
    hz = os.sysconf("SC_CLK_TCK")
    processes: dict[int, ProcessCpu] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        command = [word.decode(errors="replace") for word in cmdline.split(b"\0") if word]
        seconds = (int(fields[11]) + int(fields[12])) / hz  # utime + stime
        processes[int(entry.name)] = ProcessCpu(int(fields[1]), command, seconds)
    return processes


def component(command: list[str]) -> str | None:
    """The `epd` component a command line runs (`python -m services.launcher.cli NAME`), if any."""
    return (
        command[3] if len(command) > 3 and command[1:3] == ["-m", "services.launcher.cli"] else None
    )


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds so far of each `epd` component under the process `root`
    (a component's whole tree: tritonserver and its Python stub count for triton)."""
    processes = process_cpu()
    names = {pid: name for pid, p in processes.items() if (name := component(p.command))}
    totals: dict[str, float] = {}
    for pid, process in processes.items():
        node = pid
        while node in processes and node not in names and node != root:
            node = processes[node].parent
        if node in names and node != root:
            totals[names[node]] = totals.get(names[node], 0.0) + process.seconds
    return totals


@contextmanager
def serve(
    setup: Setup,
    log_dir: Path,
    checkpoint: Path | None = None,
    max_num_batched_tokens: int | None = 256,
    ports: dict[str, int] | None = None,
) -> Iterator[tuple[str, int]]:
    """`epd serve` on the small demo checkpoint, or on `checkpoint`. This report
    caps a step at 256 tokens (short prefill chunks: steadier TPOT beside images);
    None keeps `epd serve`'s default. `ports`: free_serve_ports()' (default: new ones)."""
    ports = ports or free_serve_ports(encoders=4, languages=4)
    port = ports["port"]
    budget = ("--max-num-batched-tokens", str(max_num_batched_tokens))
    args = [
        "--demo-size",
        "small",
        *serve_port_args(ports),
        "--max-model-len",
        "2048",
        *(budget if max_num_batched_tokens else ()),
        "--log-dir",
        str(log_dir),
        *(("--model", str(checkpoint)) if checkpoint else ()),
        *setup.args,
    ]
    process = launch(args)
    try:
        yield f"http://127.0.0.1:{port}/v1", process.pid
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)


def measure(base_url: str, case: Case, rate: float) -> tuple[RunResult, dict[str, Any]]:
    """One run. Every run has its own images (the disaggregated encoder caches
    embeddings by content, the monolithic server does not), the same in every setup."""
    seed = 1 + case.rates.index(rate)
    workload = Workload(
        num_prompts=case.num_prompts,
        input_len=64,
        output_len=32,
        image_ratio=case.image_ratio,
        seed=seed,
    )
    requests = build_requests(workload, "demo-small")
    config = RunConfig(
        base_url=base_url,
        request_rate=rate,
        max_concurrency=32,
        warmup=2,
        seed=seed,
        progress=False,
    )
    result = asyncio.run(run(config, requests))
    return result, summarize(result)


def _proc(path: str, key: str) -> str:
    lines = Path(path).read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")


def cpu_class() -> str:
    """The vector extensions the fast paths choose by: AMX, AVX512-BF16, AVX-512, AVX2."""
    flags = set(_proc("/proc/cpuinfo", "flags").split())
    names = {"amx_tile": "AMX", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX-512", "avx2": "AVX2"}
    found = [name for flag, name in names.items() if flag in flags]
    return " + ".join(found[:2]) if found else "no AVX2"


def head_commit() -> str:
    """The checked-out commit, short, that a report names; "+ changes" after it where
    the code the stack runs (services/, model_repository/) differs from it: a figure
    taken while the tree was being edited measured no commit."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout

    commit = git("rev-parse", "--short", "HEAD").strip()
    edited = git("status", "--porcelain", "--", "services", "model_repository").strip()
    return f"{commit} + changes" if commit and edited else commit


def machine() -> str:
    cpu = _proc("/proc/cpuinfo", "model name") or platform.processor()
    cpu = f"{cpu} ({cpu_class()})"
    memory = int(_proc("/proc/meminfo", "MemTotal").split()[0]) // 1024**2
    cores = len(os.sched_getaffinity(0))
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    return f"{cpu}, {cores} cores, {memory} GiB; {versions}"


def fmt_rate(rate: float) -> str:
    return "burst" if math.isinf(rate) else f"{rate:g}/s"


def ms(summary: dict[str, Any], metric: str, q: str, kind: str | None = None) -> float:
    part = summary["by_kind"].get(kind, {}) if kind else summary
    return float(part.get("latency_ms", {}).get(metric, {}).get(q, math.nan))


def table(case: Case, results: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    names = "rate, setup, req/s, output tok/s, TTFT p50, TTFT p99, TPOT p50, TPOT p99"
    names += ", text TPOT p99, failed"
    header = names.split(", ")
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for rate in case.rates:
        for setup, by_rate in results.items():
            s = by_rate[rate]
            text = ms(s, "tpot", "p99", "text") if case.image_ratio < 1 else math.nan
            cells = [
                fmt_rate(rate),
                setup,
                f"{s['request_throughput']:.2f}",
                f"{s['output_throughput']:.1f}",
                f"{ms(s, 'ttft', 'median'):.0f}",
                f"{ms(s, 'ttft', 'p99'):.0f}",
                f"{ms(s, 'tpot', 'median'):.1f}",
                f"{ms(s, 'tpot', 'p99'):.1f}",
                "" if math.isnan(text) else f"{text:.1f}",
                str(s["failed"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def cpu_table(results: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    burst = {setup: by_rate[math.inf] for setup, by_rate in results.items()}
    components = sorted({c for s in burst.values() for c in s.get("cpu_seconds", {})})
    header = ["setup", *components, "total", "run time (s)", "completed"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for setup, s in burst.items():
        cpu = s.get("cpu_seconds", {})
        cells = [f"{cpu[c]:.1f}" if c in cpu else "" for c in components]
        lines.append(
            f"| {setup} | "
            + " | ".join(cells)
            + f" | {sum(cpu.values()):.1f} | {s['duration_s']:.1f} | {s['completed']} |"
        )
    return lines


def verdict(case: Case, results: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    """Met or missed, and by how much, for the plain disaggregated setup."""
    mono, disagg = results["monolithic"], results["disaggregated"]
    finite = [r for r in case.rates if not math.isinf(r)]
    tpot = [
        ms(disagg[r], "tpot", "p99", "text") / ms(mono[r], "tpot", "p99", "text") for r in finite
    ]
    burst = disagg[math.inf]["request_throughput"] / mono[math.inf]["request_throughput"]
    rates = f"{fmt_rate(finite[0])} to {fmt_rate(finite[-1])}"
    tpot_goal = (
        "meets the goal"
        if max(tpot) <= 0.6
        else f"misses the 0.6x goal by {max(0.0, min(tpot) - 0.6):.2f} to {max(tpot) - 0.6:.2f}"
    )
    throughput_goal = (
        "meets the goal" if burst >= 1.2 else f"misses the 1.2x goal by {1.2 - burst:.2f}"
    )
    cores = len(os.sched_getaffinity(0))

    def busy(summary: dict[str, Any]) -> str:
        work = sum(summary.get("cpu_seconds", {}).values())
        return f"{work:.1f} CPU-seconds, {work / (summary['duration_s'] * cores):.0%} of the cores"

    return [
        f"- Disaggregated, text-request TPOT p99 at {rates}: {min(tpot):.2f}x to {max(tpot):.2f}x "
        f"monolithic; this {tpot_goal}.",
        f"- Disaggregated, request throughput in the burst: {burst:.2f}x monolithic; this "
        f"{throughput_goal}. During the burst, monolithic used {busy(mono[math.inf])}, "
        f"disaggregated {busy(disagg[math.inf])} (table below).",
    ]


def headline(case: Case, results: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    """The goal, for the mixed workload: text TPOT p99 <= 0.6x and throughput >= 1.2x."""
    mono = results["monolithic"]
    finite = [r for r in case.rates if not math.isinf(r)]
    lines = [
        "| setup | text TPOT p99 vs monolithic (at " + ", ".join(fmt_rate(r) for r in finite) + ") "
        "| burst throughput vs monolithic |",
        "|---|---|---:|",
    ]
    for setup, by_rate in results.items():
        if setup == "monolithic":
            continue
        ratios = ", ".join(
            f"{ms(by_rate[r], 'tpot', 'p99', 'text') / ms(mono[r], 'tpot', 'p99', 'text'):.2f}x"
            for r in finite
        )
        burst = by_rate[math.inf]["request_throughput"] / mono[math.inf]["request_throughput"]
        lines.append(f"| {setup} | {ratios} | {burst:.2f}x |")
    return lines


def outputs(arch: str) -> tuple[Path, Path]:
    """The report and its figures' folder for a demo family."""
    if arch == ARCHS[0]:
        return MONOLITHIC, FIGURES
    page = MONOLITHIC.with_name(f"performance-monolithic-{arch}.md")
    return page, FIGURES.with_name(f"performance-{arch}")


def write(
    results: dict[str, dict[str, dict[float, dict[str, Any]]]],
    runs: dict[str, dict[str, RunResult]],
    all_cases: list[Case],
    elapsed: float,
    arch: str = ARCHS[0],
) -> None:
    doc, figures = outputs(arch)
    figures.mkdir(parents=True, exist_ok=True)
    spec = SIZES["small"]
    commit = head_commit()
    mixed = all_cases[-1]
    sections: list[str] = []
    for case in all_cases:
        name = case.name.split()[0]
        plots.throughput_vs_rate(
            {
                s: [by_rate[r] for r in case.rates if not math.isinf(r)]
                for s, by_rate in results[case.name].items()
            },
            figures / f"{name}_throughput.png",
            f"{case.name}: throughput",
        )
        sections += [
            f"## {case.name} ({case.num_prompts} requests)",
            "",
            *table(case, results[case.name]),
            "",
            f"![{case.name} throughput]({figures.name}/{name}_throughput.png)",
            "",
        ]
    sections += [
        "## Where the CPU time goes: the mixed workload's burst",
        "",
        "CPU seconds each component used during the run (its whole process tree), "
        "read from /proc; the benchmark client is not counted.",
        "",
        *cpu_table(results[mixed.name]),
        "",
    ]
    top = max(r for r in mixed.rates if not math.isinf(r))
    text_runs = {
        s: RunResult(r.request_rate, r.duration_s, [x for x in r.results if x.kind == "text"])
        for s, r in runs[f"{mixed.name}@{top:g}"].items()
    }
    plots.latency_cdfs(
        text_runs,
        figures / "mixed_text_latency_cdf.png",
        f"mixed 1:9 at {top:g} req/s: text requests",
    )
    serve_command = "epd serve --demo-size small"
    if arch != ARCHS[0]:
        serve_command = f"epd serve --model DEMO (epd demo-model DEMO --arch {arch} --size small)"
    doc.write_text(
        TEMPLATE.read_text().format(
            date=time.strftime("%Y-%m-%d"),
            commit=commit or "unknown",
            minutes=f"{elapsed / 60:.0f}",
            machine=machine(),
            family=FAMILIES[arch],
            serve=serve_command,
            figures=figures.name,
            model=f"text {spec.text_hidden}x{spec.text_layers}, "
            f"vision {spec.vision_hidden}x{spec.vision_layers}",
            headline="\n".join(
                [*headline(mixed, results[mixed.name]), "", *verdict(mixed, results[mixed.name])]
            ),
            sections="\n".join(sections),
            top=f"{top:g}",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="half the requests per run")
    parser.add_argument("--raw", help="also write every run's summary as JSON into this folder")
    parser.add_argument("--arch", default=ARCHS[0], choices=ARCHS, help="the demo's family")
    args = parser.parse_args()
    checkpoint = cached_demo_checkpoint("small", args.arch)
    started = time.monotonic()
    all_cases = cases(args.quick)
    results: dict[str, dict[str, dict[float, dict[str, Any]]]] = {c.name: {} for c in all_cases}
    runs: dict[str, dict[str, RunResult]] = {}
    log_root = Path(args.raw or "/tmp/epd-report")
    for setup in setups():
        print(f"== {setup.name}", flush=True)
        logs = log_root / setup.name.split()[0]
        with serve(setup, logs, checkpoint if args.arch != ARCHS[0] else None) as (url, pid):
            for case in all_cases:
                results[case.name][setup.name] = {}
                for rate in case.rates:
                    before = cpu_seconds(pid)
                    run_result, summary = measure(url, case, rate)
                    after = cpu_seconds(pid)
                    summary["cpu_seconds"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    results[case.name][setup.name][rate] = summary
                    runs.setdefault(f"{case.name}@{rate:g}", {})[setup.name] = run_result
                    tpot, text = ms(summary, "tpot", "p99"), ms(summary, "tpot", "p99", "text")
                    print(
                        f"   {case.name:<22} {fmt_rate(rate):>6}: "
                        f"{summary['request_throughput']:.2f} req/s, TPOT p99 {tpot:.1f} ms "
                        f"(text {text:.1f}), failed {summary['failed']}",
                        flush=True,
                    )
    if args.raw:
        Path(args.raw).mkdir(parents=True, exist_ok=True)
        raw = {
            case: {
                setup: {str(rate): summary for rate, summary in by_rate.items()}
                for setup, by_rate in by_setup.items()
            }
            for case, by_setup in results.items()
        }
        (Path(args.raw) / "summaries.json").write_text(json.dumps(strict_json(raw), indent=1))
    write(results, runs, all_cases, time.monotonic() - started, args.arch)
    print(f"wrote {outputs(args.arch)[0]}")


if __name__ == "__main__":
    main()
