"""Attention of one layer: the compiled kernels against torch's path.

    .venv/bin/python -m bench.attention [--seqs 16] [--context 260] [--layers 8] [--repeat 300]
        [--prompt 207] [--prefix 16]

One decode step's attention for one layer (the new tokens' keys and values written
into the paged cache, then every sequence's query against its pages), on the small
and the medium demo's shapes, in float32 and bfloat16: `TorchAttention` with the
compiled kernel (cpu_kernels.py) against the same backend without it (each
sequence's pages gathered, then one padded SDPA), measured in the same run. Pages
are scattered over the cache, as a serving cache's are, and the calls take the
caches of `--layers` layers in turn, as a step does (one layer's cache, read over
and over, stays in the CPU's nearer caches, which a serving step's do not).

Then a prompt's attention in bfloat16 (`--prompt` new tokens after a cached
prefix of `--prefix`, as bench/peer.py's prompts after their shared chat header):
the prefill kernel this CPU has (AMX, else AVX512-BF16) against gather + SDPA,
both writing the prompt's keys and values first.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.report import machine
from services.layers import cpu_kernels
from services.layers.attention import AttentionMetadata, TorchAttention

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


def prefill_metadata(new: int, prefix: int) -> tuple[AttentionMetadata, int]:
    """One prompt: `new` tokens after `prefix` cached ones, its pages drawn at random."""
    length = prefix + new
    pages_each = -(-length // PAGE_SIZE)
    table = list(range(pages_each))
    random.Random(0).shuffle(table)
    slots = [table[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(prefix, length)]
    meta = AttentionMetadata(
        [0, new], [length], [table], torch.tensor(slots), num_prefills=1, page_size=PAGE_SIZE
    )
    return meta, pages_each


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
    parser.add_argument("--prompt", type=int, default=207, help="a prompt's new tokens")
    parser.add_argument("--prefix", type=int, default=16, help="and its cached ones")
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
    prefill = cpu_kernels.bf16_prefill_attention()
    if prefill is None:
        print("\nno bfloat16 prefill kernel on this CPU (it needs AMX or AVX512-BF16)")
        return
    print(
        f"\na prompt of {args.prompt} tokens after {args.prefix} cached, bfloat16; µs per layer\n"
    )
    print(f"{'shape':<8} {'kernel':>8} {'SDPA':>8} {'speed-up':>9}")
    meta, num_pages = prefill_metadata(args.prompt, args.prefix)
    for name, (heads, kv_heads, dim) in SHAPES.items():
        q, k, v = (
            torch.randn(args.prompt, h, dim, generator=generator).bfloat16()
            for h in (heads, kv_heads, kv_heads)
        )
        shape = (num_pages, PAGE_SIZE, kv_heads, dim)
        caches = [
            (
                torch.randn(*shape, generator=generator).bfloat16(),
                torch.randn(*shape, generator=generator).bfloat16(),
            )
            for _ in range(args.layers)
        ]
        repeat = max(10, args.repeat // 10)
        compiled_us = us_per_layer(
            TorchAttention(dim**-0.5, kernel, prefill), meta, q, k, v, caches, repeat
        )
        gathered_us = us_per_layer(TorchAttention(dim**-0.5, kernel), meta, q, k, v, caches, repeat)
        print(
            f"{name:<8} {compiled_us:>8.0f} {gathered_us:>8.0f} {gathered_us / compiled_us:>8.2f}x"
        )


if __name__ == "__main__":
    main()
