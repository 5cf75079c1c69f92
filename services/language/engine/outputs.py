"""What the engine gives back: each request's outputs, each step's figures and
its load; the errors that end a request. A token's logprobs and a prefilled
choice's first token are the wire's own types (services/wire/), which the
language service passes on as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.language.engine.sampler import Sample
from services.wire.messages import FirstToken
from services.wire.request import FinishReason, TokenLogprob, TopLogprob


class RequestFailedError(RuntimeError):
    """The engine ended this one request with an error (the others go on)."""


class EngineLostError(RequestFailedError):
    """The engine's process died: what it ran is lost; another instance may serve it."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A hold_kv request's choice after its first token: the pages holding its
    prompt's KV (kept until `release`) and that token."""

    pages: tuple[int, ...]
    first: FirstToken


def first_token(sample: Sample, generator: torch.Generator | None) -> FirstToken:
    """A choice's first token, and its generator's state after it (a seeded choice
    goes on where it was on the instance that decodes it)."""
    state = b"" if generator is None else generator.get_state().numpy().tobytes()
    top_ids = tuple(t for t, _ in sample.top)
    return FirstToken(
        sample.token_id, sample.logprob, top_ids, tuple(lp for _, lp in sample.top), state
    )


def sample_of(first: FirstToken) -> Sample:
    """The sample a first token was."""
    return Sample(
        first.token_id, first.logprob, list(zip(first.top_ids, first.top_logprobs, strict=True))
    )


def token_logprob(sample: Sample, text: Callable[[int], str]) -> TokenLogprob:
    """A sampled token's logprob and its top alternatives', with the text of each."""
    assert sample.logprob is not None
    top = tuple(TopLogprob(t, text(t), lp) for t, lp in sample.top)
    return TokenLogprob(sample.token_id, text(sample.token_id), sample.logprob, top)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # set on the last output of a request that failed
    index: int = 0  # the choice, for n > 1
    num_cached_tokens: int = 0  # of the prompt's, taken from the prefix cache
    prefilled: Prefilled | None = None  # the last output of a hold_kv request's choice
    # the answer to a request that pins its prefix, as it is added: the media
    # tokens its cached pages cover (no token yet)
    num_media_held: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.prefilled is not None


@dataclass(frozen=True, slots=True)
class StepStats:
    num_tokens: int  # tokens computed this step
    num_generated: int
    ttfts: list[float]  # seconds, for requests that got their first token this step
    tpots: list[float]  # seconds per output token, for requests that finished this step
    num_cached_tokens: int = 0  # tokens admitted from the prefix cache this step
    num_cached_media_tokens: int = 0  # of those, images' and videos'
    threads: int = 0  # the OpenMP threads it ran on
    held_s: float = 0.0  # how long it was held while the vision side encoded (Pacing)
    pacing_unmet: bool = False  # it wanted a hold the TPOT target left no time for


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine holds, as of its last step or inbox drain: published by
    the engine thread as one immutable value, so any thread reads it whole."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_shared: int = 0
