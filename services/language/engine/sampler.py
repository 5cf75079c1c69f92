"""Sampler: the grammar mask of guided requests and logits processors
(logit_bias, min_tokens, repetition / frequency / presence penalties), then
greedy or temperature, top-k, top-p; logprobs of the raw distribution.

A request with a seed draws from its own generator, so its samples do not
depend on which other requests share the batch. A request whose sampling
fails (non-finite logits, a distribution torch refuses) gets a SamplingError
in its place; the other requests of the batch are sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.language.engine.grammar import mask_logits
from services.language.engine.request import Request, SamplingParams


@dataclass(frozen=True, slots=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


class SamplingError(RuntimeError):
    """One request could not be sampled; it ends with this error, the batch goes on."""


def apply_processors(
    row: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    stop_ids: set[int],
) -> None:
    """One request's logits [vocab], in place, in vLLM's order: logit_bias and
    min_tokens, then the penalties. `stop_ids`: the ids min_tokens holds back
    (EOS unless ignored, and the request's stop_token_ids). Every tensor made
    here is made on the row's device."""
    device = row.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        bias = torch.tensor(biases, dtype=row.dtype, device=device)
        row.index_add_(0, torch.tensor(ids, device=device), bias)
    if len(output_ids) < params.min_tokens and stop_ids:
        row[torch.tensor(sorted(stop_ids), device=device)] = float("-inf")
    if params.repetition_penalty != 1.0:  # HF's RepetitionPenaltyLogitsProcessor
        seen = torch.tensor(sorted(set(prompt_ids + output_ids)), device=device)
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        out = torch.tensor(output_ids, device=device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] after temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p  # keeps the token that crosses top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


class Sampler:
    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = set(eos_token_ids)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        eos = set() if params.ignore_eos else self.eos_token_ids
        return eos | set(params.stop_token_ids)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sample | SamplingError]:
        """logits [N, vocab] float32, one row per request; a Sample or a SamplingError each."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(r.sampling.logprobs for r in requests)
            else None
        )
        logits, failed = self._processed(logits, requests)
        greedy = logits.argmax(dim=-1).tolist()
        samples: list[Sample | SamplingError] = []
        for i, request in enumerate(requests):
            if i in failed:
                samples.append(failed[i])
                continue
            if not finite[i]:
                samples.append(SamplingError("the model produced non-finite logits"))
                continue
            try:
                samples.append(self._one(logits[i], greedy[i], request, logprobs, i))
            except RuntimeError as exc:  # torch refuses the distribution
                samples.append(SamplingError(f"sampling failed: {exc}"))
        return samples

    def _processed(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[torch.Tensor, dict[int, SamplingError]]:
        """A copy of the logits with the grammar masks and each request's
        processors applied (logprobs stay those of the model), and the requests
        whose mask or processors failed: they fail alone."""
        processed = [i for i, r in enumerate(requests) if r.sampling.has_processors]
        guided = [i for i, r in enumerate(requests) if r.matcher is not None]
        if not processed and not guided:
            return logits, {}
        logits, failed = logits.clone(), {}
        try:
            mask_logits(logits, requests)
        except (RuntimeError, ValueError) as exc:
            failed = {i: SamplingError(f"the grammar mask failed: {exc}") for i in guided}
        for i in processed:
            r = requests[i]
            try:
                apply_processors(
                    logits[i],
                    r.sampling,
                    r.prompt_token_ids,
                    r.output_token_ids,
                    self._stop_ids(r.sampling),
                )
            except (RuntimeError, IndexError, ValueError) as exc:
                failed[i] = SamplingError(f"the logits processors failed: {exc}")
        return logits, failed

    @staticmethod
    def _one(
        row: torch.Tensor, greedy: int, request: Request, logprobs: torch.Tensor | None, i: int
    ) -> Sample:
        params = request.sampling
        if params.is_greedy:
            token = greedy
        else:
            probs = _filtered_probs(row, params)
            generator = request.generator  # the draw happens where it lives (the CPU)
            where = probs if generator is None else probs.to(generator.device)
            token = int(torch.multinomial(where, 1, generator=generator))
        if logprobs is None or not params.logprobs:
            return Sample(token)
        top: list[tuple[int, float]] = []
        if params.top_logprobs:
            values, ids = torch.topk(logprobs[i], params.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return Sample(token, float(logprobs[i, token]), top)
