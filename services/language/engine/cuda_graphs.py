"""Decode steps replayed from CUDA graphs (CUDA, FlashInfer attention).

A decode step launches a few hundred small kernels; launched one by one from
Python they cost more GPU time than they run. As vLLM and SGLang do, the model's
forward for decode-only batches is captured once per batch size bucket before
serving (`graph_batch_sizes`) and replayed: a step of n decodes runs the graph of
the smallest bucket >= n, its extra rows padding. Outside the graph, each step
copies its inputs (embeddings, rotary cos/sin, KV slots) into the graph's fixed
tensors and re-plans FlashInfer, whose `use_cuda_graph` wrappers keep the page
tables in fixed buffers the captured kernels read. Prefill and mixed steps run
eagerly.

Padding rows decode one token at position 0 of the KV cache's sink page, one
page past those the block manager hands out: they write and read only there.

Written against PyTorch's CUDA graph API and FlashInfer's documented wrappers;
needs CUDA (gpu-marked tests compare greedy outputs with graphs on and off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.layers.attention import AttentionMetadata, FlashInferAttention

logger = logging.getLogger(__name__)

# forward(embeds, cos, sin, attention) -> logits for every row
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FlashInferAttention], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs
    (vLLM's capture sizes)."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


@dataclass(slots=True)
class _Graph:
    """One bucket's captured forward and the fixed tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    attention: FlashInferAttention
    embeds: torch.Tensor  # [size, hidden]
    cos: torch.Tensor  # [size, head_dim]
    sin: torch.Tensor
    slots: torch.Tensor  # [size] flat KV slot of each row
    logits: torch.Tensor  # [size, vocab]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        attention: FlashInferAttention,
        hidden_size: int,
        head_dim: int,
        dtype: torch.dtype,
        page_size: int,
        sink_page: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
    ) -> None:
        self.forward = forward
        self.attention = attention
        self.hidden_size, self.head_dim, self.dtype = hidden_size, head_dim, dtype
        self.page_size = page_size
        self.sink_page = sink_page  # pages [0, sink_page) hold requests
        self.sink_slot = sink_page * page_size  # where every padding row writes
        self.sizes = graph_batch_sizes(max_num_seqs)
        # page-table room per row: the choices of an n > 1 request list their shared
        # prompt pages each, so rows can name more pages than the cache has
        self.max_pages_per_seq = max_pages_per_seq
        self.graphs: dict[int, _Graph] = {}

    def size_for(self, num_seqs: int) -> int | None:
        """The captured bucket a decode step of num_seqs runs in, if any."""
        return next((s for s in self.sizes if s >= num_seqs and s in self.graphs), None)

    def capture(self) -> None:
        """Captures every bucket, largest first, into one memory pool (the smaller
        graphs reuse the largest one's memory)."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size, pool)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.2f s",
            self.sizes,
            time.perf_counter() - started,
        )

    def _padded(
        self, seq_lens: list[int], block_tables: list[list[int]], size: int, slots: torch.Tensor
    ) -> AttentionMetadata:
        """These decodes and size - len(seq_lens) padding rows, on the sink page."""
        pad = size - len(seq_lens)
        return AttentionMetadata(
            query_start_loc=list(range(size + 1)),
            seq_lens=seq_lens + [1] * pad,
            block_tables=block_tables + [[self.sink_page]] * pad,
            slot_mapping=slots,
            num_prefills=0,
            page_size=self.page_size,
        )

    def _capture(self, size: int, pool: Any) -> _Graph:  # pool: graph_pool_handle()'s
        device = self.attention.device
        attention = self.attention.for_graph(size, size * self.max_pages_per_seq)
        slots = torch.full((size,), self.sink_slot, device=device)
        attention.plan(self._padded([], [], size, slots))  # all padding
        embeds = torch.zeros(size, self.hidden_size, dtype=self.dtype, device=device)
        cos = torch.ones(size, self.head_dim, dtype=self.dtype, device=device)
        sin = torch.zeros(size, self.head_dim, dtype=self.dtype, device=device)
        # a run on a side stream first, as torch.cuda.graph asks: lazily built
        # state (cuBLAS handles, kernels) must exist before capture
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.forward(embeds, cos, sin, attention)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(embeds, cos, sin, attention)
        return _Graph(graph, attention, embeds, cos, sin, slots, logits)

    def replay(
        self,
        size: int,
        meta: AttentionMetadata,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only step (meta.num_prefills == 0)."""
        g = self.graphs[size]
        n = meta.num_seqs
        g.embeds[:n].copy_(embeds)
        g.cos[:n].copy_(cos)
        g.sin[:n].copy_(sin)
        g.slots[:n].copy_(meta.slot_mapping)
        g.slots[n:].fill_(self.sink_slot)
        g.attention.plan(self._padded(meta.seq_lens, meta.block_tables, size, g.slots))
        g.graph.replay()
        return g.logits[:n]
