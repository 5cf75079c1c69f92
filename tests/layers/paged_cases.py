"""Steps over a paged KV cache with shuffled page tables, for checking an
attention backend against the torch reference."""

from __future__ import annotations

import random

import torch

from services.layers.attention import AttentionMetadata

NUM_PAGES = 64


def paged_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    page_size: int,
    device: torch.device,
    seed: int,
    num_pages: int = NUM_PAGES,
) -> AttentionMetadata:
    """Each sequence's pages drawn at random from the whole cache, in no order:
    a backend that ignored the page table (or read it in order) would differ."""
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    tables, slots = [], []
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        table = [free.pop() for _ in range(-(-seq_len // page_size))]
        tables.append(table)
        slots += [
            table[i // page_size] * page_size + i % page_size
            for i in range(seq_len - q_len, seq_len)
        ]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        starts,
        seq_lens,
        tables,
        torch.tensor(slots, device=device),
        num_prefills=sum(1 for q in q_lens if q > 1),
        page_size=page_size,
    )


# (query lengths, KV lengths after the step); prefills first, as the runner orders them
STEPS = {
    "mixed": ([37, 5, 1, 1], [37, 20, 70, 3]),  # full prefill, chunked prefill, two decodes
    "prefill-only": ([64, 9], [64, 40]),
    "decode-only": ([1, 1, 1], [1, 33, 129]),
}
