"""Decode attention of one layer: the compiled paged kernel against torch's path.

    .venv/bin/python -m bench.attention [--seqs 16] [--context 260] [--layers 8] [--repeat 300]

One decode step's attention for one layer (the new tokens' keys and values written
into the paged cache, then every sequence's query against its pages), on the small
and the medium demo's shapes, in float32 and bfloat16: `TorchAttention` with the
compiled kernel (cpu_kernels.py) against the same backend without it (each
sequence's pages gathered, then one padded SDPA), measured in the same run. Pages
are scattered over the cache, as a serving cache's are, and the calls take the
caches of `--layers` layers in turn, as a step does (one layer's cache, read over
and over, stays in the CPU's nearer caches, which a serving step's do not).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.report import machine
from services.language.engine import cpu_kernels
from services.language.engine.attention import AttentionMetadata, TorchAttention

PAGE_SIZE = 16
SHAPES = {  # name: (query heads, KV heads, head dim), from services/model/demo.py
    "small": (8, 4, 64),
    "medium": (16, 8, 64),
}


def decode_metadata(seqs: int, context: int) -> tuple[AttentionMetadata, int]:
    """One decode token per sequence, each sequence's pages drawn at random."""
    pages_each = -(-context // PAGE_SIZE)
    num_pages = seqs * pages_each
    free = list(range(num_pages))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(pages_each)] for _ in range(seqs)]
    last = context - 1
    slots = [table[last // PAGE_SIZE] * PAGE_SIZE + last % PAGE_SIZE for table in tables]
    meta = AttentionMetadata(
        list(range(seqs + 1)),
        [context] * seqs,
        tables,
        torch.tensor(slots),
        num_prefills=0,
        page_size=PAGE_SIZE,
    )
    return meta, num_pages


def us_per_layer(
    backend: TorchAttention,
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    repeat: int,
) -> float:
    """Each call on the next layer's cache, as a step's layers take them: a layer's
    pages have left the nearer CPU caches by the time it comes round again."""
    backend.plan(meta)
    backend.forward(q, k, v, caches[0])
    started = time.perf_counter()
    for i in range(repeat):
        backend.forward(q, k, v, caches[i % len(caches)])
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=260, help="keys per sequence")
    parser.add_argument("--layers", type=int, default=8, help="caches, taken in turn")
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    kernel = cpu_kernels.paged_decode_attention()
    if kernel is None:
        raise SystemExit("the paged kernel could not be built here (no C compiler?)")
    print(f"{machine()}; {torch.get_num_threads()} torch threads")
    print(
        f"{args.seqs} sequences of {args.context} keys, pages of {PAGE_SIZE}, "
        f"{args.layers} layers' caches in turn; µs per layer\n"
    )
    print(f"{'shape':<8} {'dtype':<9} {'kernel':>8} {'torch':>8} {'speed-up':>9}")
    meta, num_pages = decode_metadata(args.seqs, args.context)
    generator = torch.Generator().manual_seed(0)
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):

            def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=generator).to(dtype)

            q, k, v = (randn(args.seqs, h, dim) for h in (heads, kv_heads, kv_heads))
            caches = [
                (
                    randn(num_pages, PAGE_SIZE, kv_heads, dim),
                    randn(num_pages, PAGE_SIZE, kv_heads, dim),
                )
                for _ in range(args.layers)
            ]
            compiled = TorchAttention(dim**-0.5, kernel)
            gathered = TorchAttention(dim**-0.5)
            compiled_us = us_per_layer(compiled, meta, q, k, v, caches, args.repeat)
            gathered_us = us_per_layer(gathered, meta, q, k, v, caches, args.repeat)
            print(
                f"{name:<8} {str(dtype).removeprefix('torch.'):<9} {compiled_us:>8.0f} "
                f"{gathered_us:>8.0f} {gathered_us / compiled_us:>8.2f}x"
            )


if __name__ == "__main__":
    main()
