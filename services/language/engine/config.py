"""EngineConfig: what an engine is built with (its `auto` backends resolve in
services/layers/backends.py); RequestChecks: what a request must be to be taken."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.language.engine.request import Request
from services.language.engine.scheduler import SchedulerConfig
from services.layers.build import Backends
from services.model.spec import ModelSpec
from services.wire.request import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 * 1024 * 1024
    page_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # "torch", "cpu" (torch's, decodes in the compiled paged kernel; float32 or
    # bfloat16), "flashinfer", or "auto": FlashInfer on CUDA where it is installed,
    # "cpu" on a CPU in float32 or bfloat16 where the kernel builds, else torch
    attention: str = "auto"
    moe: str = "auto"  # MoE experts: "torch", "flashinfer", or "auto" (FlashInfer on CUDA)
    # projections: "torch", "cpu" (EPD's AVX2 kernel for few rows, float32), "avx512"
    # (EPD's float32 kernel on AVX-512, every call), "onednn" (packed), "amx" (EPD's
    # bfloat16 kernel on AMX for few rows, oneDNN above) or "avx512bf16" (on
    # AVX512-BF16, every call), or "auto": in float32 "avx512" where the CPU has
    # AVX-512, else "cpu" where the kernel builds (oneDNN where torch runs AVX-512
    # but EPD's kernels are built without); in bfloat16 "amx" where the CPU has
    # AMX, else "avx512bf16" where it has AVX512-BF16; else oneDNN where it packs
    # the dtype, else torch (services/layers/linear.py)
    linear: str = "auto"
    # RMSNorm and rotary embedding: "torch", "cpu" (compiled and fused, float32 or
    # bfloat16), or "auto" ("cpu" on a CPU where the kernels build, else torch)
    ops: str = "auto"
    # a decode-only step's decoder layers: "python" (layer by layer), "compiled" (in
    # one C call, cpu_decode.py: the projections on EPD's kernels, the fused operations and
    # the compiled paged attention, a dense model without q/k norms), or "auto"
    # ("compiled" where it runs)
    decode_layers: str = "auto"
    cuda_graphs: bool = True  # decode steps from CUDA graphs (CUDA with FlashInfer attention)
    prefix_caching: bool = True  # prompts share the KV pages of the text they begin with
    # OpenMP threads of a step while requests of this instance await their embeddings
    # (0: all of them). Where the vision tower runs on the same cores (`epd serve` on
    # one host), the two then split the cores instead of contending for all of them.
    threads_while_encoding: int = 0
    # While requests of this instance await their embeddings, a step that only
    # decodes waits this many ms after the last step ended (0: back to back): a
    # vision tower on the same cores has them in between, however long a step
    # takes, so first tokens come sooner and the running requests' tokens later.
    decode_interval_while_encoding_ms: int = 0
    # Or paced by a target: while requests await their embeddings, a step that only
    # decodes waits until the running requests' TPOT target (ms), kept on the mean
    # over each one's tokens, leaves no more than a decode step's measured time
    # (Pacing.interval). 0: no target; a decode interval, when given, overrides it.
    tpot_slo_ms: int = 0
    # And a TTFT target (ms): the waits come only as the oldest request awaiting
    # its embeddings needs them, by its age (or the recent media wait, if longer)
    # against the target (Pacing.urgency). 0: whenever requests await.
    ttft_slo_ms: int = 0
    # OpenMP threads of a step that only decodes (0: all). `epd serve` on a small
    # host may leave a core to the processes that stream the tokens: on the small
    # demo (2 cores) one thread decodes as fast there as two, which stall on every
    # parallel region when the front end takes a core (docs/performance.md's history)
    decode_threads: int = 0

    @property
    def backends(self) -> Backends:
        return Backends(self.attention, self.linear, self.ops, self.moe)


class RequestChecks:
    """What a request must be for an engine of this config and model to take it
    (ValueError otherwise). They read only the immutable config and spec, so a
    host calls them from its event loop before a request crosses to the engine."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config = config
        self.vocab_size = spec.text.vocab_size

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The request fits the context (and so the cache, alone)."""
        if num_prompt_tokens + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length of {self.config.max_model_len} tokens"
            )

    def check_sampling(self, params: SamplingParams) -> None:
        """The token ids the parameters name are in the vocabulary, and its choices
        fit a batch."""
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in params.token_ids):
            raise ValueError(f"token ids in logit_bias and stop_token_ids must be in [0, {vocab})")
        seats = self.config.scheduler.max_num_seqs
        if params.n > seats:
            raise ValueError(f"n ({params.n}) exceeds the {seats} sequences a batch holds")

    def check(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.sampling.max_tokens)
        self.check_sampling(request.sampling)
