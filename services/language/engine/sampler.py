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
    here is made on the row's device. Token ids are checked against the row on
    the host: on a GPU an index past it is a device-side assert, which ends
    every request of the process, not an IndexError that ends this one."""
    device, vocab = row.device, row.shape[-1]
    if any(not 0 <= t < vocab for t in (*stop_ids, *(t for t, _ in params.logit_bias))):
        raise IndexError(f"a token id in logit_bias or the stop tokens is outside [0, {vocab})")
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


# Top-p looks for each row's nucleus among this many of its most probable tokens
# first, and sorts the whole row only where they do not cover it (a sort of a
# 150k vocabulary costs ~6 ms a row on a CPU; a top-k of 1024, a fraction of it).
NUCLEUS_CANDIDATES = 1024


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [rows, vocab], unnormalized, after each row's temperature,
    top-k and top-p, all rows at once (no op here mixes rows: a row's numbers do
    not depend on the others)."""
    device = logits.device
    temperature = torch.tensor([[p.temperature] for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature
    ks = [min(p.top_k, logits.shape[-1]) for p in params]
    if any(ks):
        values = torch.topk(logits, max(ks), dim=-1).values
        kth = values.gather(-1, torch.tensor([[max(k, 1) - 1] for k in ks], device=device))
        cut = torch.tensor([[k > 0] for k in ks], device=device)
        logits = logits.masked_fill(cut & (logits < kth), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([[p.top_p] for p in params], dtype=probs.dtype, device=device)
        # beyond a row's top-k there is no mass left to look for its nucleus in
        candidates = max(k or NUCLEUS_CANDIDATES for k in ks)
        probs = torch.where(top_p < 1.0, _nucleus(probs, top_p, candidates), probs)
    return probs


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Each row's most probable tokens up to the one whose cumulative probability
    crosses top_p (that one kept), the rest zeroed; looked for among the
    `candidates` most probable first."""
    vocab = probs.shape[-1]
    values, order = torch.topk(probs, min(candidates, vocab), dim=-1)
    cumulative = torch.cumsum(values, dim=-1)
    covered = (cumulative[:, -1:] > top_p) | (top_p >= 1.0)  # a row at 1.0 keeps its probs
    if values.shape[-1] < vocab and not bool(covered.all()):
        values, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(values, dim=-1)
    kept = values.masked_fill(cumulative - values > top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """A token per row of `probs` (unnormalized), drawn with one uniform in [0, 1)
    per row: the first token whose cumulative probability passes it (as FlashInfer
    samples, the running sum in float32). A token of probability 0 is never drawn."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:].contiguous()
    targets = uniforms.to(cdf.device, cdf.dtype).unsqueeze(-1) * total
    # a uniform that rounds up to the total lands on the last token with mass
    last = torch.searchsorted(cdf, total)
    tokens = torch.minimum(torch.searchsorted(cdf, targets, right=True), last)
    return tokens.squeeze(-1).tolist()


class Sampler:
    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = set(eos_token_ids)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        eos = set() if params.ignore_eos else self.eos_token_ids
        return eos | set(params.stop_token_ids)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sample | SamplingError]:
        """logits [N, vocab] float32, one row per request; a Sample or a SamplingError each."""
        # a NaN or an infinity anywhere in a row shows in its max or its min
        finite = (
            torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
        ).tolist()
        logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(r.sampling.logprobs for r in requests)
            else None
        )
        logits, failed = self._processed(logits, requests)
        skip = set(failed) | {i for i, ok in enumerate(finite) if not ok}
        tokens = _argmax(logits, [i for i, r in enumerate(requests) if r.sampling.is_greedy])
        tokens.update(_draw(logits, requests, skip))
        samples: list[Sample | SamplingError] = []
        for i, request in enumerate(requests):
            if i in failed:
                samples.append(failed[i])
            elif not finite[i]:
                samples.append(SamplingError("the model produced non-finite logits"))
            elif isinstance(token := tokens[i], SamplingError):
                samples.append(token)
            else:
                samples.append(_with_logprobs(token, request.sampling, logprobs, i))
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


def _argmax(logits: torch.Tensor, rows: list[int]) -> dict[int, int | SamplingError]:
    """The greedy rows' tokens (none computed for rows that sample)."""
    if not rows:
        return {}
    chosen = logits if len(rows) == logits.shape[0] else logits[rows]
    return dict(zip(rows, chosen.argmax(dim=-1).tolist(), strict=True))


def _draw(
    logits: torch.Tensor, requests: list[Request], skip: set[int]
) -> dict[int, int | SamplingError]:
    """The tokens of the rows that sample rather than take the argmax, all drawn at
    once: a seeded row's uniform comes from its own generator (so its tokens do not
    depend on the batch), the others' from torch's. A row whose filters leave no
    valid distribution gets a SamplingError; the others are drawn."""
    rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy and i not in skip]
    if not rows:
        return {}
    chosen = logits if len(rows) == len(requests) else logits[rows]
    probs = _filtered_probs(chosen, [requests[i].sampling for i in rows])
    mass = probs.sum(dim=-1)
    valid = (torch.isfinite(mass) & (mass > 0)).tolist()
    uniforms = torch.rand(len(rows))
    for j, i in enumerate(rows):
        generator = requests[i].generator
        if generator is not None:  # drawn where it lives (the CPU)
            uniforms[j] = torch.rand(1, generator=generator, device=generator.device).item()
    tokens = _inverse_cdf(probs, uniforms)
    return {
        i: token if ok else SamplingError("sampling failed: no token is left to draw from")
        for i, token, ok in zip(rows, tokens, valid, strict=True)
    }


def _with_logprobs(
    token: int, params: SamplingParams, logprobs: torch.Tensor | None, i: int
) -> Sample:
    if logprobs is None or not params.logprobs:
        return Sample(token)
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        values, ids = torch.topk(logprobs[i], params.top_logprobs)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Sample(token, float(logprobs[i, token]), top)
