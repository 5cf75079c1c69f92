"""The sampler: one request's failure stays its own; its logits processors
equal Hugging Face's (and OpenAI's definitions) on the same logits; the rows of
a batch are drawn at once, each from its own temperature, top-k and top-p."""

from __future__ import annotations

import re

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from services.language.engine import sampler as sampler_module
from services.language.engine.request import Request, SamplingParams
from services.language.engine.sampler import (
    Sample,
    Sampler,
    SamplingError,
    _filtered_probs,
    apply_processors,
)


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


def _draws(logits: torch.Tensor, params: list[SamplingParams], times: int) -> torch.Tensor:
    """[times, rows]: the tokens of `times` steps of one batch, a request per row."""
    requests = [_request(p) for p in params]
    steps = []
    for _ in range(times):
        samples = Sampler().sample(logits, requests)
        assert all(isinstance(s, Sample) for s in samples)
        steps.append([s.token_id for s in samples])  # type: ignore[union-attr]
    return torch.tensor(steps)


def test_a_batch_draws_each_row_from_its_own_distribution() -> None:
    """Rows of different temperatures, drawn together: each token's frequency is
    its softmax(logits / T) probability within four standard errors."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]] * 3)
    temperatures = [1.0, 0.5, 2.0]
    times = 4000
    drawn = _draws(logits, [SamplingParams(temperature=t) for t in temperatures], times)
    for row, t in enumerate(temperatures):
        expected = torch.softmax(logits[row] / t, dim=-1)
        seen = torch.bincount(drawn[:, row], minlength=5) / times
        error = (expected * (1 - expected) / times).sqrt()
        assert ((seen - expected).abs() <= 4 * error + 1e-9).all(), (t, seen, expected)


def test_top_k_and_top_p_keep_each_row_within_its_own_set() -> None:
    """A greedy row, a top-k row, a top-p row and one with both, in one batch:
    each draws only from its own set (top-p keeps the token crossing it), and
    every token of that set is drawn."""
    torch.manual_seed(1)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    logits = probs.log().repeat(4, 1)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),  # 0.4 + 0.25 < 0.7: the third is kept
        SamplingParams(
            temperature=1.0, top_k=3, top_p=0.7
        ),  # of the top 3: 0.4/0.8 + 0.25/0.8 > 0.7
    ]
    drawn = _draws(logits, params, 600)
    assert set(drawn[:, 0].tolist()) == {0}
    assert set(drawn[:, 1].tolist()) == {0, 1, 2}
    assert set(drawn[:, 2].tolist()) == {0, 1, 2}
    assert set(drawn[:, 3].tolist()) == {0, 1}


def test_top_p_sorts_the_whole_row_when_the_candidates_fall_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flat distribution whose nucleus is larger than the candidates looked at
    first: the row is sorted whole, and the nucleus is still exactly kept."""
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 4)
    torch.manual_seed(2)
    logits = torch.zeros(2, 20)
    logits[:, 10:] = -2.0  # ten likely tokens, ten unlikely
    drawn = _draws(logits, [SamplingParams(temperature=1.0, top_p=0.85)] * 2, 400)
    assert set(drawn.flatten().tolist()) == set(range(10))


def test_top_p_sorts_no_row_whose_nucleus_the_candidates_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peaked row with top-p beside one without: the nucleus is found among the
    candidates, and nothing sorts a whole row (a row without top-p needs none)."""
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 4)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a whole row was sorted")

    monkeypatch.setattr(torch, "sort", refuse)
    torch.manual_seed(4)
    logits = torch.full((2, 20), -1.0)  # probabilities 0.55, 0.20, 0.07, then 0.01 each
    logits[:, :3] = torch.tensor([3.0, 2.0, 1.0])
    drawn = _draws(
        logits, [SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0)], 200
    )
    assert set(drawn[:, 0].tolist()) == {0, 1}
    assert len(set(drawn[:, 1].tolist())) > 3  # the other row keeps its whole distribution


def test_a_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))

    def run(others: int) -> list[int]:
        subject = _request(seeded)
        batch = [_request(SamplingParams(temperature=0.8)) for _ in range(others)] + [subject]
        tokens = []
        for _ in range(20):
            rows = torch.cat([logits[:others], logits[-1:]])  # the subject's row last
            sample = Sampler().sample(rows, batch)[-1]
            assert isinstance(sample, Sample)
            tokens.append(sample.token_id)
        return tokens

    assert run(0) == run(5)
    assert len(set(run(0))) > 1


def test_a_row_left_with_no_token_fails_alone() -> None:
    """min_tokens holding back stop tokens that are the whole vocabulary leaves
    nothing to draw from: that request gets a SamplingError, the other its token."""
    nothing = _request(
        SamplingParams(temperature=1.0, stop_token_ids=tuple(range(8)), min_tokens=2)
    )
    fine = _request(SamplingParams(temperature=1.0))
    empty, drawn = Sampler().sample(torch.randn(2, 8), [nothing, fine])
    assert isinstance(empty, SamplingError) and "no token is left" in str(empty)
    assert isinstance(drawn, Sample)


def test_a_uniform_at_the_top_draws_the_last_token_with_mass() -> None:
    """Rounding can put a uniform at the row's total: it draws the last token
    that has probability, never a masked one after it."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert sampler_module._inverse_cdf(probs, torch.tensor([1.0, 1.0])) == [1, 2]
    assert sampler_module._inverse_cdf(probs, torch.tensor([0.0, 0.0])) == [0, 2]
    assert sampler_module._inverse_cdf(probs, torch.tensor([0.5, 0.99])) == [1, 2]


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


def test_processors_make_every_tensor_on_the_logits_device() -> None:
    """On PyTorch's meta device a tensor made on the CPU cannot meet the row (as
    it cannot a CUDA row): every processor at once, and none may."""
    row = torch.zeros(64, device="meta")
    params = SamplingParams(
        logit_bias=((3, 1.0), (9, -2.0)),
        min_tokens=5,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        max_tokens=10,
    )
    apply_processors(row, params, [1, 2, 3], [4, 4, 5], {7, 8})
    assert row.device.type == "meta"


def test_the_filters_make_every_tensor_on_the_logits_device() -> None:
    """Temperature and top-k of rows that differ, on the meta device (top-p reads a
    flag back to the host, which meta cannot give: the gpu test below covers it)."""
    params = [
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=2),
    ]
    assert _filtered_probs(torch.zeros(3, 64, device="meta"), params).device.type == "meta"


def test_the_grammar_mask_goes_to_the_logits_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar wants the bitmask where the logits are; it allocates it on the CPU."""
    from services.language.engine import grammar

    seen: list[tuple[torch.device, torch.device]] = []
    monkeypatch.setattr(
        grammar.xgr,
        "apply_token_bitmask_inplace",
        lambda logits, bitmask, indices: seen.append((logits.device, bitmask.device)),
    )

    class Matcher:
        def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
            pass

    request = _request(SamplingParams())
    request.matcher = Matcher()
    grammar.mask_logits(torch.zeros(1, 64, device="meta"), [request])
    assert seen == [(torch.device("meta"), torch.device("meta"))]


def test_a_request_whose_processors_fail_fails_alone() -> None:
    """A processor that raises (a token id past the vocabulary, which the engine
    refuses earlier) ends its own request; the batch is sampled."""
    bad = _request(SamplingParams(logit_bias=((10_000, 1.0),)))
    good = _request(SamplingParams(repetition_penalty=1.2))
    logits = torch.randn(2, 64)
    bad_out, good_out = Sampler().sample(logits, [bad, good])
    assert isinstance(bad_out, SamplingError) and "processors failed" in str(bad_out)
    assert isinstance(good_out, Sample)


@pytest.mark.parametrize(
    "params, stop_ids",
    [
        (SamplingParams(logit_bias=((3, 1.0), (64, 1.0))), set()),
        (SamplingParams(min_tokens=2), {7, 70}),
    ],
    ids=["bias-past-the-vocabulary", "stop-id-past-the-vocabulary"],
)
def test_token_ids_outside_the_row_fail_before_the_device_sees_them(
    params: SamplingParams, stop_ids: set[int]
) -> None:
    """On a GPU an index past the row is a device-side assert that ends every
    request of the process (seen on an H100); the ids are checked on the host.
    On the meta device, which checks no index either, the old code went on."""
    with pytest.raises(IndexError, match=r"outside \[0, 64\)"):
        apply_processors(torch.zeros(64, device="meta"), params, [1], [], stop_ids)


@pytest.mark.gpu
def test_a_batch_of_every_option_on_cuda_logits() -> None:
    """Written for a GPU, unverified here: seeded draws, every processor and
    logprobs on CUDA logits, and one bad request that fails alone."""
    params = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(logit_bias=((3, 5.0),), min_tokens=2, repetition_penalty=1.2, max_tokens=9),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.5, logprobs=True, top_logprobs=3),
        SamplingParams(logit_bias=((10_000, 1.0),)),  # past the vocabulary
    ]
    requests = [_request(p) for p in params]
    requests[2].output_token_ids = [4, 4, 6]
    out = Sampler({0}).sample(torch.randn(4, 64, device="cuda"), requests)
    assert all(isinstance(o, Sample) for o in out[:3])
    assert isinstance(out[3], SamplingError)
    assert isinstance(out[2], Sample) and len(out[2].top) == 3
