"""The engine against Hugging Face generate(), token for token."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from services.language.engine.pacing import MARGIN, URGENT, Pacing
from services.language.engine.request import Request, SamplingParams
from services.loadgen.synthetic import random_image
from tests.language.engine_fixtures import (
    check_batch,
    make_engine,
    make_request,
    run_to_completion,
    text,
    tokens,
)
from tests.reference import chat, hf_greedy

MIXED = [
    (0, "Hello there", 8),
    (1, "Describe this image.", 13),
    (0, "Tell me a long story about the sea, the boats and the fish in it.", 30),
    (3, "Compare the three pictures.", 23),
    (0, "Count to ten", 5),
    (1, "What color is it?", 40),
    (2, "Which one is brighter?", 17),
    (0, "a", 1),
]


def _case(i: int) -> tuple[list[dict[str, object]], list[object], int]:
    num_images, prompt, max_tokens = MIXED[i]
    images = [
        random_image(120 + 40 * j + 10 * i, 100 + 30 * j, seed=10 * i + j)
        for j in range(num_images)
    ]
    return chat(prompt, num_images), images, max_tokens


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path) -> list[list[int]]:
    return [hf_greedy(tiny_checkpoint, *_case(i)) for i in range(len(MIXED))]


def _requests(checkpoint: Path, indices: list[int]) -> list[object]:
    return [
        make_request(checkpoint, f"r{i}", messages, images, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
        for i in indices
        for messages, images, n in [_case(i)]
    ]


@pytest.mark.parametrize("index", [0, 1, 3], ids=["text", "one-image", "three-images"])
def test_single_requests_equal_hf(
    tiny_checkpoint: Path, expected: list[list[int]], index: int
) -> None:
    engine = make_engine(tiny_checkpoint)
    out = run_to_completion(engine, _requests(tiny_checkpoint, [index]))  # type: ignore[arg-type]
    assert tokens(out[f"r{index}"]) == expected[index]


@pytest.mark.parametrize(
    ("kv_bytes", "max_model_len", "budget", "preempts"),
    [
        (64 << 20, 1024, 2048, False),  # roomy: one batch
        (64 << 20, 1024, 48, False),  # chunked prefill, 48 tokens a step
        (16384 * 12, 192, 40, True),  # 12 pages of 16 tokens: preemption
    ],
    ids=["batch", "chunked-prefill", "preemption"],
)
@pytest.mark.parametrize(
    ("linear", "attention", "ops"),
    [("cpu", "cpu", "cpu"), ("onednn", "cpu", "cpu"), ("torch", "torch", "torch")],
    ids=["cpu", "onednn", "torch"],
)
def test_batch_of_eight_mixed_requests_equals_hf(
    tiny_checkpoint: Path,
    expected: list[list[int]],
    kv_bytes: int,
    max_model_len: int,
    budget: int,
    preempts: bool,
    linear: str,
    attention: str,
    ops: str,
) -> None:
    """With the CPU defaults (EPD's linear kernel for few rows, the compiled
    paged decode attention, the fused norms and rotary embedding), with oneDNN's
    packed projections instead, and with torch alone (F.linear, gathered pages
    and SDPA, torch's norms and rotary embedding)."""
    engine = make_engine(
        tiny_checkpoint,
        kv_bytes,
        max_model_len,
        max_num_batched_tokens=budget,
        linear=linear,
        attention=attention,
        ops=ops,
    )
    check_batch(engine, _requests(tiny_checkpoint, list(range(8))), expected, preempts)  # type: ignore[arg-type]


def test_warm_up_leaves_nothing_behind_and_changes_no_output(
    tiny_checkpoint: Path, expected: list[list[int]]
) -> None:
    """What servers run before they say serving: prefill-only, mixed and
    decode-only steps, then an engine as fresh as a cold one."""
    engine = make_engine(tiny_checkpoint)
    steps: list[tuple[int, int]] = []  # (prefills, decodes) of each step
    execute = engine.runner.execute

    def counting(batch: Any) -> Any:
        prefills = sum(1 for s in batch if s.is_prefill)
        steps.append((prefills, len(batch) - prefills))
        return execute(batch)

    engine.runner.execute = counting  # type: ignore[method-assign]
    engine.warm_up()
    assert (1, 0) in steps and (1, 1) in steps and (0, 1) in steps
    assert not engine.has_work() and not engine.requests and not engine.detokenizers
    assert engine.blocks.num_used_pages == 0
    out = run_to_completion(engine, _requests(tiny_checkpoint, [1]))  # type: ignore[arg-type]
    assert tokens(out["r1"]) == expected[1]


def test_text_equals_hf_decode(tiny_checkpoint: Path, expected: list[list[int]]) -> None:
    from services.model.tokenizer import load_tokenizer

    engine = make_engine(tiny_checkpoint)
    out = run_to_completion(engine, _requests(tiny_checkpoint, [2, 5]))  # type: ignore[arg-type]
    tokenizer = load_tokenizer(tiny_checkpoint)
    for i in (2, 5):
        assert text(out[f"r{i}"]) == tokenizer.decode(expected[i], skip_special_tokens=True)


def _sampled(checkpoint: Path, companions: int, seed: int) -> list[int]:
    engine = make_engine(checkpoint)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=24, seed=seed)
    subject = make_request(checkpoint, "subject", chat("Write a poem about cats."), [], params)
    others = [
        make_request(
            checkpoint,
            f"o{i}",
            chat(f"Other request {i} " * (i + 1)),
            [],
            SamplingParams(temperature=1.0, max_tokens=10 + i, seed=100 + i),
        )
        for i in range(companions)
    ]
    return tokens(run_to_completion(engine, [*others, subject])["subject"])


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(
    tiny_checkpoint: Path,
) -> None:
    alone = _sampled(tiny_checkpoint, 0, seed=7)
    assert alone == _sampled(tiny_checkpoint, 0, seed=7)
    assert alone == _sampled(tiny_checkpoint, 5, seed=7)
    assert alone != _sampled(tiny_checkpoint, 0, seed=8)


def test_stop_strings_never_reach_the_output(
    tiny_checkpoint: Path, expected: list[list[int]]
) -> None:
    from services.model.tokenizer import load_tokenizer

    full = load_tokenizer(tiny_checkpoint).decode(expected[5], skip_special_tokens=True)
    stop = full[10:13]
    engine = make_engine(tiny_checkpoint)
    messages, images, _ = _case(5)
    request = make_request(
        tiny_checkpoint,
        "s",
        messages,
        images,
        SamplingParams(max_tokens=40, stop=(stop,)),  # type: ignore[arg-type]
    )
    out = run_to_completion(engine, [request])["s"]
    assert text(out) == full[: full.index(stop)]
    assert out[-1].finish_reason == "stop"


def test_stop_token_ids_and_max_tokens(tiny_checkpoint: Path, expected: list[list[int]]) -> None:
    engine = make_engine(tiny_checkpoint)
    messages, images, _ = _case(2)
    stop_id = expected[2][4]
    out = run_to_completion(
        engine,
        [
            make_request(
                tiny_checkpoint,
                "ids",
                messages,
                images,
                SamplingParams(max_tokens=30, stop_token_ids=(stop_id,)),
            ),  # type: ignore[arg-type]
            make_request(tiny_checkpoint, "len", messages, images, SamplingParams(max_tokens=3)),  # type: ignore[arg-type]
        ],
    )
    assert tokens(out["ids"]) == expected[2][: expected[2].index(stop_id) + 1]
    assert out["ids"][-1].finish_reason == "stop"
    assert tokens(out["len"]) == expected[2][:3]
    assert out["len"][-1].finish_reason == "length"


def test_context_length_is_enforced(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, max_model_len=64)
    request = make_request(
        tiny_checkpoint, "long", chat("word " * 80), [], SamplingParams(max_tokens=4)
    )
    with pytest.raises(ValueError, match="exceeds the context length of 64 tokens"):
        engine.add_request(request)


def test_logprobs(tiny_checkpoint: Path, expected: list[list[int]]) -> None:
    engine = make_engine(tiny_checkpoint)
    messages, images, _ = _case(0)
    request = make_request(
        tiny_checkpoint,
        "lp",
        messages,
        images,
        SamplingParams(max_tokens=5, logprobs=True, top_logprobs=3),  # type: ignore[arg-type]
    )
    outputs = run_to_completion(engine, [request])["lp"]
    logprobs = [lp for o in outputs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == expected[0][:5]
    for lp in logprobs:
        assert len(lp.top) == 3
        assert lp.top[0].token_id == lp.token_id  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0].logprob)
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(lp.top))


def test_abort_frees_the_pages(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    request = make_request(tiny_checkpoint, "x", chat("Hello"), [], SamplingParams(max_tokens=50))
    engine.add_request(request)
    engine.step()
    assert engine.blocks.num_used_pages > 0
    [final] = engine.abort_request("x")
    assert final.finish_reason == "abort"
    assert engine.blocks.num_used_pages == 0
    assert not engine.has_work()


def test_steps_run_on_fewer_threads_while_the_vision_side_encodes(tiny_checkpoint: Path) -> None:
    """threads_while_encoding: a step taken while `encoding` runs on that many
    OpenMP threads (set on the stepping thread, here this one), the next one after
    it back on all; the outputs do not change."""

    def request() -> Request:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        return make_request(tiny_checkpoint, "t", chat("Hello"), [], params)

    want = run_to_completion(make_engine(tiny_checkpoint), [request()])
    threads = torch.get_num_threads()
    engine = make_engine(tiny_checkpoint)
    engine.pacing = Pacing(dataclasses.replace(engine.config, threads_while_encoding=1))
    engine.add_request(request())
    try:
        engine.pacing.awaiting_since = time.monotonic()
        first, _ = engine.step()
        assert torch.get_num_threads() == 1
        engine.pacing.awaiting_since = None
        second, _ = engine.step()
        assert torch.get_num_threads() == threads
        engine.pacing.awaiting_since = time.monotonic()
        rest = run_to_completion(engine, [])
    finally:
        torch.set_num_threads(threads)
    assert tokens([*first, *second, *rest["t"]]) == tokens(want["t"])


def test_decode_steps_wait_their_interval_while_the_vision_side_encodes(
    tiny_checkpoint: Path,
) -> None:
    """decode_interval_while_encoding_ms: while `encoding`, a step that would only
    decode is held until the interval has passed since the last step ended (the
    tower gets that long however long the step took); a prompt to compute, or no
    encoding, holds nothing."""
    engine = make_engine(tiny_checkpoint)
    config = dataclasses.replace(engine.config, decode_interval_while_encoding_ms=200)
    engine.pacing = Pacing(config)
    execute = engine.runner.execute

    def slow_execute(batch: Any) -> torch.Tensor:  # a step of at least 100 ms
        time.sleep(0.1)
        return execute(batch)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(make_request(tiny_checkpoint, "a", chat("Hello"), [], params))
    engine.pacing.awaiting_since = time.monotonic()
    assert engine.step_delay() == 0.0  # its prompt is to compute
    engine.step()  # the prompt: a decode from now on
    assert 0.12 < engine.step_delay() <= 0.2  # counted from the step's end, not its start
    engine.pacing.awaiting_since = None
    assert engine.step_delay() == 0.0
    engine.pacing.awaiting_since = time.monotonic()
    engine.add_request(make_request(tiny_checkpoint, "b", chat("Hi"), [], params))
    assert engine.step_delay() == 0.0  # b's prompt goes at once
    time.sleep(0.2)
    engine.abort_request("b")
    assert engine.step_delay() == 0.0  # the interval has passed


def test_a_tpot_target_holds_decode_steps_as_long_as_the_running_requests_have_banked(
    tiny_checkpoint: Path,
) -> None:
    """tpot_slo_ms: while `encoding`, a decode-only step waits until the running
    request's next token is due (MARGIN x the target a token since its first)
    less a decode step's measured time: tokens that came faster bank the
    difference, and every token still keeps the target on the mean, as the SLO
    counts it. Where decode steps are slower than the pace, the bank drains; then
    the step waits nothing and says the target left the tower no time. (A target
    of 400 ms: a busy machine's ~30 ms steps may take several times that. A TTFT
    target of 10 s, whole from the start: one wait is at most that; without it, a
    step's own share.)"""
    target, ttft = 0.4, 10.0
    engine = make_engine(tiny_checkpoint)
    config = dataclasses.replace(engine.config, tpot_slo_ms=target * 1000, ttft_slo_ms=ttft * 1000)
    engine.pacing = Pacing(config)
    execute, pause = engine.runner.execute, [0.03]

    def slow_execute(batch: Any) -> torch.Tensor:
        time.sleep(pause[0])
        return execute(batch)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    engine.add_request(make_request(tiny_checkpoint, "a", chat("Hello"), [], params))
    engine.pacing.awaiting_since = time.monotonic() - URGENT * ttft  # urgent: whole waits
    for _ in range(3):  # the prompt, then decode steps of ~30 ms
        engine.step()
    (a,) = engine.scheduler.running
    assert a.first_token_time is not None and a.num_output_tokens == 3
    measured = engine.pacing.decode_step_s
    assert 0.03 <= measured < MARGIN * target
    due = a.first_token_time + MARGIN * target * a.num_output_tokens
    banked = due - measured - engine.pacing.last_step
    assert banked > MARGIN * target - measured  # more than one step's share: two came fast
    assert engine.pacing.interval(engine.scheduler.running) == pytest.approx(banked)
    assert banked - 0.05 < engine.step_delay() <= banked
    engine.pacing.ttft_s = 0.0  # no TTFT target: a step's own share
    assert engine.pacing.interval(engine.scheduler.running) == pytest.approx(
        MARGIN * target - measured
    )
    engine.pacing.ttft_s = ttft
    while a.num_output_tokens < 6:  # held that long, the mean keeps the target
        time.sleep(engine.step_delay())
        engine.step()
        assert time.monotonic() - a.first_token_time <= target * (a.num_output_tokens - 1)
    pause[0] = 2 * target  # decode steps now take more than the pace: the bank drains
    for _ in range(8):
        if not engine.step_delay():
            break
        time.sleep(engine.step_delay())
        engine.step()
    assert engine.step_delay() == 0.0
    _, stats = engine.step()
    assert stats.pacing_unmet and not stats.held_s
    engine.pacing.awaiting_since = None
    assert engine.step_delay() == 0.0
    _, stats = engine.step()
    assert not stats.pacing_unmet  # nothing awaits embeddings: nothing to give


def test_a_ttft_target_holds_decode_steps_only_as_the_oldest_awaiting_request_needs(
    tiny_checkpoint: Path,
) -> None:
    """ttft_slo_ms: while the oldest request awaiting its embeddings is younger
    than EASY x the target, decode steps run back to back; from then on they
    wait a growing share of what the TPOT target leaves, the whole of it from
    URGENT x the target. Where embeddings have lately taken longer to arrive
    than its age, that time counts instead. Their threads drop to
    threads_while_encoding at every age (all of them beside the tower slow both)."""
    tpot, ttft = 0.4, 4.0
    engine = make_engine(tiny_checkpoint)
    config = dataclasses.replace(
        engine.config, tpot_slo_ms=tpot * 1000, ttft_slo_ms=ttft * 1000, threads_while_encoding=1
    )
    engine.pacing = Pacing(config)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    engine.add_request(make_request(tiny_checkpoint, "a", chat("Hello"), [], params))
    threads = torch.get_num_threads()
    seen = []  # (the hold the step due wants, over the whole wait; the step's threads)
    try:
        for age in (0.0, 0.1, 0.375, 0.75):  # of the TTFT target, since the oldest came
            engine.pacing.awaiting_since = time.monotonic() - age * ttft
            engine.step()
            step_threads = torch.get_num_threads()
            now = time.monotonic()
            engine.pacing.awaiting_since = now - age * ttft  # as old as it was at the step
            whole = engine.pacing.interval(engine.scheduler.running)
            wants = engine.pacing.urgency(now) * whole
            seen.append((round(wants / whole, 1), step_threads))
            assert wants - 0.05 < engine.step_delay() <= wants
    finally:
        torch.set_num_threads(threads)
    assert whole > 0  # the tokens came faster than the pace: banked
    assert seen == [(0.0, 1), (0.0, 1), (0.5, 1), (1.0, 1)]
    now = time.monotonic()
    engine.pacing.awaiting_since = now
    assert engine.pacing.urgency(now) == 0.0
    engine.pacing.media_wait_s = 0.375 * ttft  # a tower slow for the target
    assert engine.pacing.urgency(now) == pytest.approx(0.5)


def test_decode_steps_run_on_the_decode_threads_and_prompts_on_all(
    tiny_checkpoint: Path,
) -> None:
    """EngineConfig.decode_threads: a step that only decodes runs on that many
    OpenMP threads, a step with a prompt in it on all of them (here 2); the
    outputs do not change."""

    def request(i: int) -> Request:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        return make_request(tiny_checkpoint, f"d{i}", chat("Hello " * (i + 1)), [], params)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = run_to_completion(make_engine(tiny_checkpoint), [request(0), request(1)])
        engine = make_engine(tiny_checkpoint, decode_threads=1)
        got: dict[str, list[Any]] = {}
        seen = []  # (the step has a prompt, its threads)
        for step in range(6):
            if step < 2:
                engine.add_request(request(step))  # the second joins a decode step
            outputs, stats = engine.step()
            seen.append((stats.num_tokens > stats.num_generated, torch.get_num_threads()))
            for output in outputs:
                got.setdefault(output.request_id, []).append(output)
        for request_id, outputs in run_to_completion(engine, []).items():
            got[request_id] += outputs
    finally:
        torch.set_num_threads(threads)
    assert seen == [(True, 2), (True, 2), (False, 1), (False, 1), (False, 1), (False, 1)]
    assert {r: tokens(o) for r, o in got.items()} == {r: tokens(o) for r, o in want.items()}


def test_step_stats_count_every_generated_token(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=16)  # chunked prefills too
    requests = [
        make_request(
            tiny_checkpoint,
            f"s{i}",
            chat("count " * (5 + 9 * i)),
            [],
            SamplingParams(max_tokens=7, ignore_eos=True),
        )
        for i in range(3)
    ]
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    for request in requests:
        engine.add_request(request)
    generated = computed = cached = 0
    while engine.has_work():
        _, stats = engine.step()
        generated += stats.num_generated
        computed += stats.num_tokens
        cached += stats.num_cached_tokens
    assert generated == 3 * 7
    # Every prompt token once (computed, or taken from the prefix cache), then
    # each output token but the last is fed back once.
    assert computed + cached == prompt_tokens + 3 * (7 - 1)
    assert cached == engine.blocks.num_hit_tokens
    assert engine.blocks.num_used_pages == 0


def test_a_request_that_cannot_be_sampled_fails_alone(
    tiny_checkpoint: Path, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Non-finite logits for one request end that request with an error at its
    third token; the batch around it goes on and stays equal to HF."""
    engine = make_engine(tiny_checkpoint)
    requests = _requests(tiny_checkpoint, [0, 1, 2])
    doomed = requests[1]
    execute = engine.runner.execute

    def poisoned(batch: list[Any]) -> torch.Tensor:
        logits = execute(batch).clone()
        sampling = [s.request for s in batch if s.samples]
        if doomed in sampling and doomed.num_output_tokens == 2:  # type: ignore[attr-defined]
            logits[sampling.index(doomed)] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    out = run_to_completion(engine, requests)  # type: ignore[arg-type]
    assert tokens(out["r0"]) == expected[0]
    assert tokens(out["r2"]) == expected[2]
    assert tokens(out["r1"]) == expected[1][:2]
    assert out["r1"][-1].error == "the model produced non-finite logits"
    assert out["r1"][-1].finish_reason == "abort"
    assert engine.blocks.num_used_pages == 0
    assert not engine.requests


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_temperatures_below_epsilon_are_greedy(
    tiny_checkpoint: Path, expected: list[list[int]], temperature: float
) -> None:
    engine = make_engine(tiny_checkpoint)
    messages, images, max_tokens = _case(0)
    request = make_request(
        tiny_checkpoint,
        "cold",
        messages,
        images,  # type: ignore[arg-type]
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=3),
    )
    assert tokens(run_to_completion(engine, [request])["cold"]) == expected[0]
