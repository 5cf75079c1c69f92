"""The sampler on one step's logits, against drawing row by row.

    .venv/bin/python -m bench.sampler [--rows 16] [--vocab 1024 151936] [--repeat 20]

Times `Sampler.sample` on a batch of rows that sample (temperature; with top-k and
top-p; with top-p alone) against the row-by-row draw it replaced, measured in the
same run: each row filtered on its own and drawn with `torch.multinomial`, which
draws an exponential variate per token of the vocabulary (what vLLM's CPU sampler
draws too). Logits are peaked (standard normal times 4), as a trained model's are,
so that top-p's nucleus is the small set it is in practice.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.report import machine
from services.language.engine.request import Request
from services.language.engine.sampler import Sampler
from services.wire.request import SamplingParams

PARAMS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "+ top-k 50, top-p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


def row_by_row(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """The draw before the batched sampler: each row on its own."""
    tokens = []
    for row in logits:
        row = row / params.temperature
        if params.top_k:
            row = row.masked_fill(row < torch.topk(row, params.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if params.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(ordered, dim=-1) - ordered > params.top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill(drop, 0.0))
        tokens.append(int(torch.multinomial(probs / probs.sum(), 1)))
    return tokens


def ms_per_step(step: Callable[..., object], args: tuple[object, ...], repeat: int) -> float:
    step(*args)
    started = time.perf_counter()
    for _ in range(repeat):
        step(*args)
    return (time.perf_counter() - started) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(f"{machine()}; {torch.get_num_threads()} torch threads")
    print(f"{args.rows} rows a step; ms per step (lower is better)\n")
    print(f"{'vocab':>7}  {'sampling':<22} {'batched':>8} {'row by row':>11} {'speed-up':>9}")
    sampler = Sampler()
    for vocab in args.vocab:
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
        for name, params in PARAMS.items():
            requests = [Request(f"r{i}", [1], params, torch.zeros(3, 1)) for i in range(args.rows)]
            batched = ms_per_step(sampler.sample, (logits, requests), args.repeat)
            single = ms_per_step(row_by_row, (logits, params), args.repeat)
            print(
                f"{vocab:>7}  {name:<22} {batched:>8.2f} {single:>11.2f} {single / batched:>8.1f}x"
            )


if __name__ == "__main__":
    main()
