"""The sampler: one request's failure stays its own."""

from __future__ import annotations

import torch

from services.language.engine.request import Request, SamplingParams
from services.language.engine.sampler import Sample, Sampler, SamplingError


def _request(sampling: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], sampling, torch.zeros(3, 3, dtype=torch.long))


def test_a_non_finite_row_fails_only_its_request() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 1.0], [2.0, 0.0, float("inf")]])
    greedy = _request(SamplingParams())
    samples = Sampler().sample(logits, [greedy, greedy, greedy])
    assert samples[0] == Sample(1)
    assert isinstance(samples[1], SamplingError)
    assert isinstance(samples[2], SamplingError)
    assert "non-finite logits" in str(samples[1])


def test_a_tiny_temperature_samples_greedily() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    samples = Sampler().sample(logits, [_request(SamplingParams(temperature=1e-40, seed=1))])
    assert samples == [Sample(1)]
