"""Request: one generation's state through the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from services.model.mrope import mrope_positions
from services.model.spec import ModelSpec
from services.wire.messages import MediaGrid
from services.wire.request import FinishReason, SamplingParams

if TYPE_CHECKING:
    from services.language.engine.kv_cache import PrefixPages


class RequestStatus(enum.IntEnum):
    """Ordered by lifecycle: everything from FINISHED_STOPPED on is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    # Done here, its pages kept: a prefill instance's request after its first
    # token, until its KV pages have gone to the decode instance.
    PREFILLED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        }.get(self)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    positions: torch.Tensor  # [3, num_prompt_tokens] M-RoPE positions of the prompt
    mrope_delta: int = 0  # decode position = sequence index + delta
    # The images' and videos' embeddings, in prompt order: [num_media_tokens, hidden]
    media_embeds: torch.Tensor | None = None
    media_positions: torch.Tensor | None = None  # [num_media_tokens] prompt indices
    # Qwen3-VL: [num_media_tokens, levels * hidden], added after the first decoder layers.
    deepstack: torch.Tensor | None = None
    # Monolithic serving only: pixels the engine's own vision tower still has to encode.
    pixel_values: torch.Tensor | None = None  # [num_patches, patch_dim]
    media_grids: tuple[MediaGrid, ...] = ()
    # Each image's and video's content hash ("": none) and its number of tokens, in
    # prompt order: the prefix cache knows their tokens' KV by them.
    media_keys: tuple[str, ...] = ()
    media_sizes: tuple[int, ...] = ()
    # Media streamed in while the request runs (the frontend's prefill while the
    # images arrive): how many media tokens, in prompt order, have their
    # embeddings (add_media); None: all of them came with the request.
    num_media_ready: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # KV pages
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # the start of its first step
    first_token_time: float | None = None
    num_prefill_steps: int = 0  # steps that computed prompt tokens (chunks)
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    held_seconds: float = 0.0  # its steps' waits while the vision side encoded (Pacing)
    grammar: Any = None  # xgrammar.CompiledGrammar of a guided request
    matcher: Any = None  # its xgrammar.GrammarMatcher: the grammar's state after the tokens so far
    # Choice `index` of an n > 1 request; choice 0 carries the choices it has not
    # forked yet (they start from its prefilled prompt: Request.fork).
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    # E/P/D. On a prefill instance: stop after the first token and keep the pages
    # (RequestStatus.PREFILLED). On a decode instance, a request whose KV came from
    # one: with images or videos it cannot be recomputed (no embeddings here).
    hold_kv: bool = False
    recomputable: bool = True
    # Streamed media the prefix cache may hold (the broker routed this chat here
    # before): the request takes its cached pages when it is added, not when it
    # is admitted, and keeps them; the media tokens they cover are never sent
    # (num_media_held), so without those pages it cannot be recomputed.
    pin_prefix: bool = False
    num_media_held: int = 0
    cache_salt: str = ""  # the client's cache scope: it enters the first page's digest
    # The prefix cache's (kv_cache.py): the prompt's tokens as it knows them, the
    # hash of each full page of those it may share so far, and how many of the
    # request's pages are in the cache.
    cache_tokens: list[object] | None = None
    prefix_hashes: list[bytes] = field(default_factory=list)
    num_cached_pages: int = 0
    num_cached_tokens: int = 0  # of the prompt's, taken from the cache when admitted
    # Pages of its prefix another instance computed (prefix_moves.py): the engine
    # adopts them into its prefix cache as it adds the request.
    moved_prefix: PrefixPages | None = None

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
            self.media_embeds,
            self.media_positions,
            self.deepstack,
            media_grids=self.media_grids,
            media_keys=self.media_keys,
            media_sizes=self.media_sizes,
            num_media_ready=self.num_media_ready,
            arrival_time=self.arrival_time,
            grammar=self.grammar,
            index=index,
            hold_kv=self.hold_kv,
            recomputable=self.recomputable,
            cache_salt=self.cache_salt,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_media_tokens(self) -> int:
        return 0 if self.media_positions is None else self.media_positions.numel()

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

    @property
    def num_ready_tokens(self) -> int:
        """How far the request can be computed now: every known token, or while
        its media stream in, up to the first uncomputed media token whose
        embedding has not arrived (a prefix-cache hit may have covered some)."""
        if self.num_media_ready is None:
            return self.num_tokens
        assert self.media_positions is not None
        first_uncomputed = int(torch.searchsorted(self.media_positions, self.num_computed_tokens))
        missing = max(self.num_media_ready, first_uncomputed)
        if missing >= self.media_positions.numel():
            return self.num_tokens
        return int(self.media_positions[missing])

    @property
    def waits_for_media(self) -> bool:
        """Its computation stops, for now, at a media token whose embedding is missing."""
        return self.num_ready_tokens < self.num_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        return max(0, self.num_ready_tokens - self.num_computed_tokens)

    def add_media(self, start: int, embeds: torch.Tensor, deepstack: torch.Tensor | None) -> None:
        """The embeddings (and deepstack features) of media tokens [start, start
        + len) in prompt order, streamed in: they follow those already here.
        ValueError for a part that does not."""
        assert self.media_positions is not None
        total = self.media_positions.numel()
        if self.num_media_ready is None or start != self.num_media_ready:
            raise ValueError(f"media tokens from {start} arrived, expected {self.num_media_ready}")
        end = start + embeds.shape[0]
        if end > total:
            raise ValueError(f"media tokens [{start}, {end}) exceed the prompt's {total}")
        if deepstack is not None and deepstack.shape[0] != embeds.shape[0]:
            raise ValueError(
                f"deepstack features for {deepstack.shape[0]} of {embeds.shape[0]} media tokens"
            )
        if self.media_embeds is None:
            self.media_embeds = embeds.new_empty(total, embeds.shape[1])
        self.media_embeds[start:end] = embeds
        if deepstack is not None:
            if self.deepstack is None:
                self.deepstack = deepstack.new_empty(total, deepstack.shape[1])
            self.deepstack[start:end] = deepstack
        self.num_media_ready = end

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
    grids: Sequence[MediaGrid] = (),
    media_embeds: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    grammar: Any = None,
    deepstack: torch.Tensor | None = None,
    media_keys: Sequence[str] = (),
    streamed: bool = False,
    pin_prefix: bool = False,
    cache_salt: str = "",
) -> Request:
    """A request with its M-RoPE positions and image placeholder positions computed
    (the placeholder tokens, merge size and video time scale are the model's).

    Images and videos (`grids` in prompt order; "image" below means either) come
    either encoded (media_embeds, and with deepstack its features) or, for an
    engine with its own vision tower, as pixel_values it encodes before the
    request runs. `media_keys`: their content hashes, by which the prefix cache
    shares their tokens' KV (none, or "": not from that item on). `streamed`:
    the embeddings come later, part by part (Request.add_media), and the request
    computes what precedes the first one missing meanwhile; `pin_prefix`: it
    takes its cached pages as it is added (Request.pin_prefix); `cache_salt`: the
    client's cache scope, in its first page's digest."""
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
    pads = [image_token_id] if video_token_id is None else [image_token_id, video_token_id]
    media_positions = _positions_of(token_ids, pads) if grids else None
    if media_positions is not None and pixel_values is None and not streamed:
        _check_embeddings(media_positions.numel(), media_embeds, deepstack)
    return Request(
        request_id,
        list(token_ids),
        sampling,
        positions,
        delta,
        media_embeds,
        media_positions,
        deepstack,
        pixel_values=pixel_values,
        media_grids=tuple(grids),
        media_keys=tuple(media_keys),
        media_sizes=tuple(g.num_tokens(spec.vision.spatial_merge_size) for g in grids),
        num_media_ready=0 if streamed and grids else None,
        grammar=grammar,
        pin_prefix=pin_prefix and streamed and bool(grids),
        cache_salt=cache_salt,
    )


def _positions_of(token_ids: list[int], pads: list[int]) -> torch.Tensor:
    """The prompt indices of the placeholder tokens, in order."""
    return torch.isin(torch.tensor(token_ids), torch.tensor(pads)).nonzero().flatten()


def _check_embeddings(
    placeholders: int, embeds: torch.Tensor | None, deepstack: torch.Tensor | None
) -> None:
    """An embedding (and with deepstack its features) for every placeholder."""
    if embeds is None or embeds.shape[0] != placeholders:
        raise ValueError(
            f"{placeholders} image placeholders but "
            f"{0 if embeds is None else embeds.shape[0]} image embeddings"
        )
    if deepstack is not None and deepstack.shape[0] != placeholders:
        raise ValueError(
            f"{placeholders} image placeholders but deepstack features "
            f"for {deepstack.shape[0]} tokens"
        )


def prefilled_request(
    request_id: str,
    token_ids: list[int],
    sampling: SamplingParams,
    spec: ModelSpec,
    mrope_delta: int,
    pages: Sequence[int],
    grammar: Any = None,
    cache_salt: str = "",
) -> Request:
    """A decode instance's request whose prompt a prefill instance computed: its
    KV is in `pages`, and decode positions follow from the prompt's M-RoPE delta.
    A text prompt can be recomputed here if it is preempted (its positions are
    the text's); one with images or videos cannot (their embeddings are not here)."""
    pads = {spec.image_token_id, spec.video_token_id}
    media = any(token in pads for token in token_ids)
    positions = torch.zeros(3, 0, dtype=torch.long)
    if not media:
        positions, _ = mrope_positions(token_ids, spec.image_token_id, (), 1)
    request = Request(
        request_id,
        list(token_ids),
        sampling,
        positions,
        mrope_delta,
        grammar=grammar,
        recomputable=not media,
        cache_salt=cache_salt,
    )
    request.block_table = list(pages)
    return request
