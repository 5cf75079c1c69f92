"""Two engine settings side by side, stepped in turn in one process.

    .venv/bin/python -m bench.engine_ab ops torch cpu [--waves 5] [--concurrency 16]
        [--prompt-len 220] [--output-len 64] [--size small] [--arch qwen2_5_vl]
        [--dtype float32]

Changes of a few percent are lost in this machine's run-to-run noise (±25%)
when each setting runs in its own process at its own time. Here two engines,
equal but for one EngineConfig field (`linear`, `attention`, `ops` or
`decode_layers`), get the same waves of requests and take their steps
alternately, so both see the same moment of the machine; each decode step is
compared with its twin. Prints the prefill time and the median decode step of
each, and B over A.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from bench.engine import load_engine
from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.request import SamplingParams, new_request
from services.language.engine.scheduler import SchedulerConfig
from services.launcher.flags import DTYPE_CHOICES
from services.model.demo import ARCHS, SIZES, cached_demo_checkpoint
from services.wire.dtypes import resolve_dtype

SETTINGS = ("linear", "attention", "ops", "decode_layers")


def add_wave(engine: LLMEngine, wave: int, prompts: list[list[int]], output_len: int) -> None:
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
        engine.add_request(new_request(f"w{wave}-{i}", ids, sampling, engine.spec))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("setting", choices=SETTINGS, help="the EngineConfig field that differs")
    parser.add_argument("a", help="its value in engine A (the baseline)")
    parser.add_argument("b", help="its value in engine B")
    parser.add_argument("--arch", default="qwen2_5_vl", choices=ARCHS)
    parser.add_argument("--size", default="small", choices=tuple(SIZES))
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=220)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    args = parser.parse_args()

    folder = cached_demo_checkpoint(args.size, args.arch)
    base = EngineConfig(
        max_model_len=2048,
        kv_cache_bytes=1 << 29,
        scheduler=SchedulerConfig(max_num_seqs=64),
        dtype=resolve_dtype(args.dtype),
    )
    engines = []
    for value in (args.a, args.b):
        engine = load_engine(folder, dataclasses.replace(base, **{args.setting: value}))
        engine.warm_up()
        engines.append(engine)
    text = " ".join(f"Tell me about topic {i}, please, in some detail." for i in range(400))
    ids = engines[0].tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[3 * i : 3 * i + args.prompt_len] for i in range(args.concurrency)]

    prefill = [0.0, 0.0]
    decode: list[list[float]] = [[], []]
    for wave in range(args.waves):
        for engine in engines:
            add_wave(engine, wave, prompts, args.output_len)
        while engines[0].has_work() or engines[1].has_work():
            seconds, tokens = [], []
            for engine in engines:
                started = time.perf_counter()
                _, stats = engine.step()
                seconds.append(time.perf_counter() - started)
                tokens.append(stats.num_tokens)
            for k in (0, 1):
                if tokens[k] > args.concurrency:
                    prefill[k] += seconds[k]
            if tokens == [args.concurrency] * 2:  # both decoding every sequence
                decode[0].append(seconds[0])
                decode[1].append(seconds[1])

    print(
        f"checkpoint: demo {args.arch} {args.size}, {args.dtype}; {args.waves} waves of "
        f"{args.concurrency} requests, {args.prompt_len}-token prompts, "
        f"{args.output_len} output tokens"
    )
    print(
        f"{'':>22} {args.setting + '=' + args.a:>14} {args.setting + '=' + args.b:>14} {'B/A':>7}"
    )
    print(
        f"{'prefill (s, total)':>22} {prefill[0]:>14.2f} {prefill[1]:>14.2f} "
        f"{prefill[1] / prefill[0]:>7.3f}"
    )
    medians = [statistics.median(d) * 1e3 for d in decode]
    paired = statistics.median(b / a for a, b in zip(*decode, strict=True))
    print(f"{'decode step (ms, p50)':>22} {medians[0]:>14.2f} {medians[1]:>14.2f} {paired:>7.3f}")
    print("B/A of decode: the median over pairs of steps taken back to back")


if __name__ == "__main__":
    main()
