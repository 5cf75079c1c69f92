"""Request: one generation's state through the engine."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xgrammar as xgr

from services.model.mrope import mrope_positions
from services.model.spec import ModelSpec
from services.wire.messages import ImageGrid

# Below this temperature sampling is greedy (as in vLLM): dividing the logits by
# it would overflow to inf and leave no distribution to draw from.
SAMPLING_EPS = 1e-5


class RequestStatus(enum.IntEnum):
    """Ordered by lifecycle: everything from FINISHED_STOPPED on is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Logits processors (OpenAI / vLLM semantics; services/language/engine/sampler.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # Structured output (services/language/engine/grammar.py).
    json_schema: str = ""
    json_object: bool = False
    n: int = 1  # choices: the prompt is prefilled once, its KV pages shared by all

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias {token}: {bias} must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_processors(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )

    @property
    def token_ids(self) -> list[int]:
        """Every token id these parameters name (to check against the vocabulary)."""
        return [*self.stop_token_ids, *(token for token, _ in self.logit_bias)]


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    positions: torch.Tensor  # [3, num_prompt_tokens] M-RoPE positions of the prompt
    mrope_delta: int = 0  # decode position = sequence index + delta
    image_embeds: torch.Tensor | None = None  # [num_image_tokens, hidden], in prompt order
    image_positions: torch.Tensor | None = None  # [num_image_tokens] prompt indices
    # Qwen3-VL: [num_image_tokens, levels * hidden], added after the first decoder layers.
    deepstack: torch.Tensor | None = None
    # Monolithic serving only: pixels the engine's own vision tower still has to encode.
    pixel_values: torch.Tensor | None = None  # [num_patches, patch_dim]
    image_grids: tuple[ImageGrid, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # KV pages
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    grammar: Any = None  # xgrammar.CompiledGrammar of a guided request
    matcher: Any = None  # its xgrammar.GrammarMatcher: the grammar's state after the tokens so far
    # Choice `index` of an n > 1 request; choice 0 carries the choices it has not
    # forked yet (they start from its prefilled prompt: Request.fork).
    index: int = 0
    forks: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)
        if self.grammar is not None:
            self.matcher = xgr.GrammarMatcher(self.grammar)

    def choice(self, index: int) -> Request:
        """Choice `index` of this request: the same prompt and images, its own
        state, and with a seed its own generator (seed + index, as in vLLM)."""
        seed = self.sampling.seed
        sampling = replace(self.sampling, seed=None if seed is None else (seed + index) % 2**64)
        return Request(
            self.request_id,
            self.prompt_token_ids,
            sampling,
            self.positions,
            self.mrope_delta,
            self.image_embeds,
            self.image_positions,
            self.deepstack,
            image_grids=self.image_grids,
            arrival_time=self.arrival_time,
            grammar=self.grammar,
            index=index,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = self.num_prompt_tokens
        head = self.prompt_token_ids[start : min(end, prompt)]
        tail = self.output_token_ids[max(start, prompt) - prompt : max(end, prompt) - prompt]
        return head + tail


def new_request(
    request_id: str,
    token_ids: list[int],
    sampling: SamplingParams,
    spec: ModelSpec,
    grids: Sequence[ImageGrid] = (),
    image_embeds: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    grammar: Any = None,
    deepstack: torch.Tensor | None = None,
) -> Request:
    """A request with its M-RoPE positions and image placeholder positions computed
    (the placeholder tokens, merge size and video time scale are the model's).

    Images and videos (`grids` in prompt order; "image" below means either) come
    either encoded (image_embeds, and with deepstack its features) or, for an
    engine with its own vision tower, as pixel_values it encodes before the
    request runs."""
    image_token_id = spec.image_token_id
    # without videos, the video pad is a token like any other
    video_token_id = spec.video_token_id if any(g.is_video for g in grids) else None
    positions, delta = mrope_positions(
        token_ids,
        image_token_id,
        grids,
        spec.vision.spatial_merge_size,
        video_token_id,
        spec.vision.tokens_per_second,
    )
    image_positions = None
    if grids:
        pads = [image_token_id] if video_token_id is None else [image_token_id, video_token_id]
        image_positions = torch.isin(torch.tensor(token_ids), torch.tensor(pads))
        image_positions = image_positions.nonzero().flatten()
        if pixel_values is None and (
            image_embeds is None or image_embeds.shape[0] != image_positions.numel()
        ):
            raise ValueError(
                f"{image_positions.numel()} image placeholders but "
                f"{0 if image_embeds is None else image_embeds.shape[0]} image embeddings"
            )
        if deepstack is not None and deepstack.shape[0] != image_positions.numel():
            raise ValueError(
                f"{image_positions.numel()} image placeholders but deepstack features "
                f"for {deepstack.shape[0]} tokens"
            )
    return Request(
        request_id,
        list(token_ids),
        sampling,
        positions,
        delta,
        image_embeds,
        image_positions,
        deepstack,
        pixel_values=pixel_values,
        image_grids=tuple(grids),
        grammar=grammar,
    )
