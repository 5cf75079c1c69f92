"""ModelRunner: one batched forward for a scheduled step.

Builds the flat token batch (prefills first, then decodes), splices image
embeddings at the placeholder positions, computes M-RoPE positions (from the
prompt's precomputed 3-D positions; sequence index + delta past the prompt),
runs the model (a decode-only step on CUDA from a captured graph,
cuda_graphs.py; on a CPU in one compiled call where it can, cpu_decode.py)
and returns the logits of the requests that sample this step.
"""

from __future__ import annotations

import contextlib

import torch

from services.language.engine.cuda_graphs import DecodeGraphs
from services.language.engine.kv_cache import KVCache
from services.language.engine.request import Request
from services.language.engine.scheduler import Scheduled
from services.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    FlashInferAttention,
)
from services.layers.build import Network, autotuning
from services.layers.cpu_decode import CompiledDecode
from services.layers.language_model import Deepstack, MRotaryEmbedding


def _positions(request: Request, start: int, end: int) -> torch.Tensor | range:
    """Positions of tokens [start, end) of a request: [3, end - start], or, past
    the prompt (every decode), the range of the one position all three axes share
    there (a step's ranges become one tensor in `_stacked`, not one each)."""
    prompt = request.num_prompt_tokens
    if start >= prompt:
        return range(start + request.mrope_delta, end + request.mrope_delta)
    part = request.positions[:, start : min(end, prompt)]
    if end <= prompt:
        return part
    return _stacked([part, range(prompt + request.mrope_delta, end + request.mrope_delta)])


def _stacked(parts: list[torch.Tensor | range]) -> torch.Tensor:
    """[3, T]: the step's requests' positions side by side."""
    if all(isinstance(p, range) for p in parts):
        return torch.tensor([i for p in parts for i in p]).expand(3, -1)
    tensors = [p if isinstance(p, torch.Tensor) else torch.tensor(p).expand(3, -1) for p in parts]
    return torch.cat(tensors, dim=1)


class ModelRunner:
    def __init__(
        self, network: Network, kv_cache: KVCache, device: torch.device, decode_layers: str
    ) -> None:
        """`decode_layers`: EngineConfig's choice of how a decode-only step runs."""
        self.model = network.model
        self.kv_cache = kv_cache
        self.attention = network.attention
        self.device = device
        self.dtype = network.dtype
        self.rotary = MRotaryEmbedding(network.model.spec, device)
        self.page_size = kv_cache.config.page_size
        self.graphs: DecodeGraphs | None = None
        self.decode: CompiledDecode | None = network.compiled_decode(
            decode_layers, kv_cache.layers, self.page_size
        )

    def use_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Decode steps from CUDA graphs once `graphs.capture()` has run (FlashInfer
        attention; the KV cache's sink page, past the block manager's, pads them)."""
        assert isinstance(self.attention, FlashInferAttention)
        spec = self.model.spec
        self.graphs = DecodeGraphs(
            self._forward,
            self.attention,
            spec.hidden_size,
            spec.head_dim,
            self.dtype,
            self.page_size,
            sink_page=self.kv_cache.config.num_pages,
            max_num_seqs=max_num_seqs,
            max_pages_per_seq=-(-max_model_len // self.page_size),
        )

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def tuning(self) -> contextlib.AbstractContextManager[None]:
        """Around the warm-up: FlashInfer's fused MoE shapes are autotuned there."""
        return autotuning(self.model)

    def _forward(
        self,
        embeds: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Logits of every row (what a decode graph captures)."""
        return self.model.lm_head(self.model(embeds, cos, sin, self.kv_cache.layers, attention))

    @staticmethod
    def order(batch: list[Scheduled]) -> list[Scheduled]:
        """Prefills first, then decodes: the attention backends split there."""
        return [s for s in batch if s.is_prefill] + [s for s in batch if not s.is_prefill]

    def _metadata(self, batch: list[Scheduled]) -> AttentionMetadata:
        starts, lens, tables, slots = [0], [], [], []
        for s in batch:
            r = s.request
            begin, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            starts.append(starts[-1] + s.num_tokens)
            lens.append(end)
            tables.append(r.block_table)
            slots += [
                r.block_table[i // self.page_size] * self.page_size + i % self.page_size
                for i in range(begin, end)
            ]
        return AttentionMetadata(
            query_start_loc=starts,
            seq_lens=lens,
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_prefills=sum(1 for s in batch if s.is_prefill),
            page_size=self.page_size,
        )

    def _embeds(
        self, batch: list[Scheduled]
    ) -> tuple[torch.Tensor, torch.Tensor, Deepstack | None]:
        """Input embeddings [T, hidden], positions [3, T] and the deepstack features
        of the image tokens this step computes (chunked prefill may split an image)."""
        ids: list[int] = []
        positions: list[torch.Tensor | range] = []
        # flat offsets and embeddings of the image tokens this step computes, per
        # request; with deepstack, their offsets and features
        offsets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        deep_offsets: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        for s in batch:
            r = s.request
            begin, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            if (
                r.media_positions is not None
                and r.media_embeds is not None
                and begin < r.num_prompt_tokens
            ):
                lo = int(torch.searchsorted(r.media_positions, begin))
                hi = int(torch.searchsorted(r.media_positions, end))
                if hi > lo:
                    offsets.append(r.media_positions[lo:hi] + (len(ids) - begin))
                    values.append(r.media_embeds[lo:hi])
                    if r.deepstack is not None:
                        deep_offsets.append(offsets[-1])
                        features.append(r.deepstack[lo:hi])
            ids += r.token_ids(begin, end)
            positions.append(_positions(r, begin, end))
        embeds = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))
        if offsets:
            flat = torch.cat(offsets).to(self.device)
            embeds[flat] = torch.cat(values).to(self.device, embeds.dtype)
        deepstack = None
        if features:
            deep = torch.cat(features).to(self.device, embeds.dtype)
            deepstack = Deepstack(
                torch.cat(deep_offsets).to(self.device), deep.unflatten(1, (-1, embeds.shape[1]))
            )
        return embeds, _stacked(positions).to(self.device), deepstack

    @torch.inference_mode()
    def execute(self, batch: list[Scheduled]) -> torch.Tensor:
        """Runs an order()ed batch; logits [sampling requests, vocab] in batch order."""
        meta = self._metadata(batch)
        embeds, positions, deepstack = self._embeds(batch)
        cos, sin = self.rotary(positions, embeds.dtype)
        last = [meta.query_start_loc[i + 1] - 1 for i, s in enumerate(batch) if s.samples]
        # A captured decode takes no deepstack features: a one-token prefill chunk
        # that holds an image token (Qwen3-VL) runs eagerly.
        if self.graphs is not None and not meta.num_prefills and deepstack is None:
            size = self.graphs.size_for(meta.num_seqs)
            if size is not None:
                return self.graphs.replay(size, meta, embeds, cos, sin)[last].float()
        self.attention.plan(meta)
        if (
            self.decode is not None
            and not meta.num_prefills
            and deepstack is None
            and self.decode.takes(meta.num_seqs)
        ):
            hidden = self.decode(embeds, cos, sin, meta.slot_mapping)
        else:
            hidden = self.model(embeds, cos, sin, self.kv_cache.layers, self.attention, deepstack)
        return self.model.lm_head(hidden[last]).float()
