"""Decode near the memory limit: the bytes a decode step reads over its time,
as a share of the machine's read bandwidth, on the medium demo.

    .venv/bin/python -m bench.decode_bandwidth [--size medium] [--dtype auto]

The baseline, in the same run on the same threads: torch.sum over 512 MiB (a
read of memory at the rate this machine gives one process), three times right
before each step that is timed, each figure taken against the reads beside its
own steps: on a 2-core AVX2 VM the read rate moved between 17 and 29 GB/s within
minutes, and a figure against a run's overall median read 128 % one day.
A decode step reads every weight of the decoder layers and the LM head once,
and each sequence's KV once. Three figures:

- weights: batch 1 at a 16-token context, (weights + KV) / step time;
- KV: batch B at a long context L against the same batch at 16 tokens: the KV
  bytes added over the time added;
- KV alone: the same KV in one request alone (batch 1 at B x L tokens), whose
  keys the attention kernel splits over the threads.

Each is the median of `--rounds` rounds of the four steps (the KV's are
differences of two steps, taken within a round: one run's drift in the machine's
memory speed moved them by 50 % and more), each round's share against the reads
beside its steps.

Memory as `epd language` has it: torch's allocations of 2 MiB and more advised into
transparent huge pages (services/runtime/malloc.py), the read's tensor too; the
output says whether the KV cache is.

The dtype is what `epd serve` picks on this CPU (`--dtype auto`: bfloat16 with
AVX512-BF16 or AMX, else float32); the CPU class is named in the output. `--doc`
writes this class's line of docs/performance.md's section.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.engine import load_engine, text_prompts
from bench.peer import with_section
from bench.report import DOC, cpu_class, head_commit, machine
from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.request import SamplingParams, new_request
from services.language.engine.scheduler import SchedulerConfig
from services.model.demo import SIZES, cached_demo_checkpoint
from services.model.spec import TextSpec
from services.runtime.malloc import HUGE_PAGES, advise_huge_pages, huge_pages_advised
from services.wire.dtypes import AUTO, resolve_dtype

READ_MIB = 512
START = "<!-- bench/decode_bandwidth.py: start -->"
END = "<!-- bench/decode_bandwidth.py: end -->"
HEADER = (
    "## Decode against the memory limit",
    "",
    "A decode step's bytes read over its time, as a share of the read bandwidth "
    "(torch.sum over 512 MiB on the same threads, three times right before each timed step; "
    "each figure against its own steps' reads; rows dated before 2026-12-03 against the run's "
    "median read): the weights at batch 1 "
    "and 16 tokens, the KV as what batch 8 adds from 16 to 1024 tokens, and as what one "
    "request alone adds from 16 to 8192 (KV alone); the medium demo in the dtype `--dtype auto` "
    "picks, in transparent huge pages as `epd language` asks for them (rows from "
    "2026-12-03 on); medians of 3 rounds or more. `python -m bench.decode_bandwidth --doc` "
    "rewrites this class's row.",
    "",
    "| CPU class | date | commit | dtype | read GB/s | weights | KV | KV alone |",
    "|---|---|---|---|---:|---:|---:|---:|",
)
SHORT = 16  # tokens of context where the weights dominate
STEPS = 24  # decode steps timed a point (after 4 untimed)


def read_seconds(dtype: torch.dtype, times: int = 9) -> list[float]:
    """Seconds of each of `times` torch.sum over READ_MIB of `dtype`."""
    x = torch.ones(READ_MIB * 2**20 // dtype.itemsize, dtype=dtype)
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - started)
    return seconds


def weight_bytes(text: TextSpec, dtype: torch.dtype) -> int:
    """What a decode step reads of the weights: each layer's projections and
    norms, the final norm and the LM head (the embedding table: one row a token)."""
    h, heads, kv, d, inter = (
        text.hidden_size,
        text.num_heads,
        text.num_kv_heads,
        text.head_dim,
        text.intermediate_size,
    )
    attention = h * heads * d * 2 + h * kv * d * 2  # q and o; k and v
    layer = attention + 3 * h * inter + 2 * h
    return (text.num_layers * layer + h + text.vocab_size * h) * dtype.itemsize


def kv_bytes(text: TextSpec, dtype: torch.dtype, tokens: int) -> int:
    return 2 * text.num_layers * text.num_kv_heads * text.head_dim * tokens * dtype.itemsize


def decode_step_s(engine: LLMEngine, batch: int, context: int) -> float:
    """The median decode-only step of `batch` sequences at about `context` tokens."""
    for i, ids in enumerate(text_prompts(engine, context, batch)):
        engine.add_request(
            new_request(
                f"bw{time.monotonic_ns()}-{i}",
                ids,
                SamplingParams(max_tokens=STEPS + 8, ignore_eos=True),
                engine.spec,
            )
        )
    times = []
    while engine.has_work():
        started = time.perf_counter()
        _, stats = engine.step()
        if stats.num_tokens == batch == stats.num_generated:  # decode-only
            times.append(time.perf_counter() - started)
    return statistics.median(times[4 : 4 + STEPS])


# a decode step's seconds and the read rate (bytes/s) measured right before it
Paired = tuple[float, float]


def paired(engine: LLMEngine, batch: int, context: int, dtype: torch.dtype) -> Paired:
    """decode_step_s, and the median of three reads just before its steps."""
    read = READ_MIB * 2**20 / statistics.median(read_seconds(dtype, 3))
    return decode_step_s(engine, batch, context), read


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="medium", choices=tuple(SIZES))
    parser.add_argument("--dtype", default=AUTO)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the four steps, one after another"
    )
    parser.add_argument("--doc", action="store_true", help="write this class's row")
    args = parser.parse_args()
    if HUGE_PAGES not in os.environ:
        # as `epd language` sets it, before torch's first allocation: this
        # module's imports have made one (xgrammar's), so it starts again
        advise_huge_pages()
        os.execv(sys.executable, [sys.executable, "-m", "bench.decode_bandwidth", *sys.argv[1:]])
    dtype = resolve_dtype(args.dtype)
    folder = cached_demo_checkpoint(args.size)
    engine = load_engine(
        folder,
        EngineConfig(
            max_model_len=args.batch * args.context + 64,
            kv_cache_bytes=1 << 30,
            scheduler=SchedulerConfig(max_num_seqs=64),
            dtype=dtype,
            prefix_caching=False,
        ),
    )
    engine.warm_up()
    text = engine.spec.text
    rounds = [
        (
            paired(engine, 1, SHORT, dtype),
            paired(engine, args.batch, SHORT, dtype),
            paired(engine, args.batch, args.context, dtype),
            paired(engine, 1, args.batch * args.context, dtype),
        )
        for _ in range(args.rounds)
    ]  # the KV's figures are differences of two steps: taken within each round, where
    # this machine's neighbours weigh on both alike
    bandwidth = statistics.median(read for r in rounds for _, read in r)
    huge = huge_pages_advised(engine.runner.kv_cache.pool.tensors[0].data_ptr())
    print(
        f"{machine()}; demo {args.size}, {dtype}, torch threads {torch.get_num_threads()}, "
        f"huge pages {'advised' if huge else 'not advised'}"
    )
    print(
        f"read bandwidth (torch.sum over {READ_MIB} MiB beside each step, the median): "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    one = statistics.median(r[0][0] for r in rounds)
    weights_bytes = weight_bytes(text, dtype) + kv_bytes(text, dtype, SHORT)
    weights = statistics.median(weights_bytes / step / read for (step, read), *_ in rounds)
    print(
        f"weights: batch 1, {SHORT} tokens: {one * 1e3:.2f} ms a step, "
        f"{weights_bytes / 2**20:.0f} MiB read: {weights_bytes / one / 1e9:.1f} GB/s, "
        f"{weights:.0%} of the read bandwidth beside it (the median of {len(rounds)} rounds)"
    )
    kv = kv_share("KV", [(r[1], r[2]) for r in rounds], args.batch, args.context, text, dtype)
    alone = kv_share(
        "KV alone", [(r[0], r[3]) for r in rounds], 1, args.batch * args.context, text, dtype
    )
    if args.doc:
        row = (
            f"| {cpu_class()} | {time.strftime('%Y-%m-%d')} | {head_commit()} | {dtype} "
            f"| {bandwidth / 1e9:.1f} | {weights:.0%} | {kv:.0%} | {alone:.0%} |"
        )
        DOC.write_text(with_section(DOC.read_text(), _section(DOC.read_text(), row), START, END))


def kv_share(
    name: str,
    steps: list[tuple[Paired, Paired]],
    batch: int,
    context: int,
    text: TextSpec,
    dtype: torch.dtype,
) -> float:
    """The KV's share of the read bandwidth: what `batch` sequences' KV adds from
    SHORT to `context` tokens over the time it adds, against the mean of the reads
    beside the two steps; the median of the rounds' (short, long) pairs; printed."""
    added = batch * kv_bytes(text, dtype, context - SHORT)
    shares = sorted(
        added / (long - short) / ((before + beside) / 2)
        for (short, before), (long, beside) in steps
    )
    rate = statistics.median(added / (long - short) for (short, _), (long, _) in steps)
    short, long = (statistics.median(step[i][0] for step in steps) for i in (0, 1))
    share = statistics.median(shares)
    print(
        f"{name}: batch {batch}, {SHORT} -> {context} tokens: {short * 1e3:.2f} -> "
        f"{long * 1e3:.2f} ms a step for {added / 2**20:.0f} MiB more KV: "
        f"{rate / 1e9:.1f} GB/s, {share:.0%} of the read bandwidth beside it "
        f"(the median of {len(steps)} rounds: {', '.join(f'{x:.0%}' for x in shares)})"
    )
    return share


def _section(doc: str, row: str) -> str:
    """The section with `row` in place of its class's earlier one."""
    cls = row.split("|")[1]
    old = doc.partition(START)[2].partition(END)[0].splitlines()
    rows = [line for line in old if line.startswith("| ") and line.split("|")[1] != cls]
    rows = [r for r in rows if not r.startswith("| CPU class")]
    return "\n".join([*HEADER, *sorted([*rows, row])])


if __name__ == "__main__":
    main()
