"""The sampler: one request's failure stays its own; its logits processors
equal Hugging Face's (and OpenAI's definitions) on the same logits."""

from __future__ import annotations

import re

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from services.language.engine.request import Request, SamplingParams
from services.language.engine.sampler import Sample, Sampler, SamplingError, apply_processors


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


# Logits processors against Hugging Face's on the same logits: a prompt and some
# output so far, a vocabulary with positive and negative logits.
VOCAB = 50
PROMPT = [3, 7, 7, 11]
OUTPUT = [7, 20, 20, 20, 4]


def _logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def _processed(params: SamplingParams) -> torch.Tensor:
    """What the sampler does to one row, EOS 49."""
    row = _logits()
    stop_ids = Sampler({49})._stop_ids(params)
    apply_processors(row, params, PROMPT, OUTPUT, stop_ids)
    return row


def _hf(processor: object) -> torch.Tensor:
    input_ids = torch.tensor([PROMPT + OUTPUT])
    return processor(input_ids, _logits()[None].clone())[0]  # type: ignore[operator]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty: float) -> None:
    expected = _hf(RepetitionPenaltyLogitsProcessor(penalty))
    assert torch.equal(_processed(SamplingParams(repetition_penalty=penalty)), expected)


def test_logit_bias_matches_hf_sequence_bias() -> None:
    bias = {5: 10.0, 20: -100.0, 33: 0.5}
    expected = _hf(SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}))
    got = _processed(SamplingParams(logit_bias=tuple(bias.items())))
    assert torch.allclose(got, expected)


def test_min_tokens_matches_hf_min_new_tokens() -> None:
    """Below min_tokens EOS is masked (as HF's MinNewTokensLength) and so are the
    request's stop_token_ids (as vLLM); from min_tokens on nothing is."""
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, eos_token_id=49)
    expected = _hf(hf)
    assert torch.equal(_processed(SamplingParams(min_tokens=6, max_tokens=8)), expected)
    with_stop = _processed(SamplingParams(min_tokens=6, max_tokens=8, stop_token_ids=(2,)))
    assert with_stop[2] == float("-inf") and with_stop[49] == float("-inf")
    assert torch.equal(_processed(SamplingParams(min_tokens=5, max_tokens=8)), _logits())


def test_frequency_and_presence_penalties_follow_openai() -> None:
    """OpenAI's definition: logit - count * frequency - (count > 0) * presence, over
    the generated tokens only (HF has no such processor)."""
    got = _processed(SamplingParams(frequency_penalty=0.7, presence_penalty=-1.1))
    expected = _logits()
    for token in set(OUTPUT):
        count = OUTPUT.count(token)
        expected[token] -= count * 0.7 + (count > 0) * -1.1
    assert torch.allclose(got, expected)
    assert got[3] == expected[3] == _logits()[3]  # a prompt token is not penalised


def test_processors_change_sampling_but_not_the_logprobs() -> None:
    """Greedy picks from the processed logits; logprobs stay the model's."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    raw = torch.log_softmax(logits[0], dim=-1)
    params = SamplingParams(logit_bias=((1, -10.0),), logprobs=True)
    (sample,) = Sampler().sample(logits, [_request(params)])
    assert isinstance(sample, Sample) and sample.token_id == 3
    assert sample.logprob == pytest.approx(float(raw[3]))
    assert torch.equal(logits, torch.tensor([[0.0, 3.0, 1.0, 2.9]]))  # not modified in place


def test_bad_processor_parameters_are_refused() -> None:
    for fields, message in (
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
        ({"logit_bias": ((3, 101.0),)}, "must be in [-100, 100]"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**fields)  # type: ignore[arg-type]
