"""Prefill while the images arrive, in the engine: a request admitted before its
embeddings computes its tokens up to the first one whose embedding is missing,
and ends with the KV and the tokens of a request that came with all of them."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.language.engine.engine import LLMEngine
from services.language.engine.outputs import RequestOutput
from services.language.engine.pacing import Pacing
from services.language.engine.request import Request, SamplingParams, new_request
from services.language.engine.scheduler import Scheduled
from services.loadgen.synthetic import random_image
from services.model.spec import load_spec
from tests.language.engine_fixtures import make_engine, make_request, tokens
from tests.reference import chat, hf_greedy

# (images, prompt, max_tokens): text alone, one image, three images
CASES = [(0, "Count to ten", 6), (1, "Describe this image.", 8), (3, "Compare them.", 8)]


def _case(i: int) -> tuple[list[dict[str, object]], list[object], int]:
    num_images, prompt, max_tokens = CASES[i]
    images = [random_image(90 + 30 * j, 80 + 20 * j, seed=7 * i + j) for j in range(num_images)]
    return chat(prompt, num_images), images, max_tokens


@pytest.fixture(scope="module")
def whole(tiny_checkpoint: Path) -> list[Request]:
    """Each case's request with every embedding in it (what a streamed one must equal)."""
    return [
        make_request(tiny_checkpoint, f"r{i}", messages, images, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
        for i in range(len(CASES))
        for messages, images, n in [_case(i)]
    ]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path) -> list[list[int]]:
    return [hf_greedy(tiny_checkpoint, *_case(i)) for i in range(len(CASES))]


def anew(request: Request, spec_dir: Path, streamed: bool = True) -> Request:
    """The same request, as new: streamed, without its embeddings (they come
    with add_media), or with every one."""
    return new_request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        load_spec(spec_dir),
        request.media_grids,
        None if streamed else request.media_embeds,
        streamed=streamed,
    )


def guarded(engine: LLMEngine) -> list[tuple[str, int, int]]:
    """Checks, at every step, that no scheduled token is a media token whose
    embedding has not arrived; returns the (request, begin, end) ranges computed."""
    ranges: list[tuple[str, int, int]] = []
    execute = engine.runner.execute

    def checked(batch: list[Scheduled]) -> torch.Tensor:
        for s in batch:
            r = s.request
            begin, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            if r.num_media_ready is not None:
                assert r.media_positions is not None
                inside = (r.media_positions >= begin) & (r.media_positions < end)
                ranks = inside.nonzero().flatten()
                assert not ranks.numel() or int(ranks.max()) < r.num_media_ready, (
                    f"{r.request_id}: tokens [{begin}, {end}) include media token "
                    f"{int(ranks.max())}, only {r.num_media_ready} arrived"
                )
            ranges.append((r.request_id, begin, end))
        return execute(batch)

    engine.runner.execute = checked  # type: ignore[method-assign]
    return ranges


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    budget=st.sampled_from([7, 16, 64, 2048]),
    splits=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    delays=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    order=st.permutations([0, 1, 2]),
)
def test_no_token_is_computed_before_its_embedding_and_the_result_is_the_whole_requests(
    tiny_checkpoint: Path,
    whole: list[Request],
    expected: list[list[int]],
    budget: int,
    splits: list[int],
    delays: list[int],
    order: list[int],
) -> None:
    """Random chunk budgets, part sizes and arrival steps: every request's tokens
    equal HF's, no media token ran before its embedding, pages balance."""
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=budget, cuda_graphs=False)
    ranges = guarded(engine)
    # each request's media, cut into parts of the drawn sizes, each due some steps on
    pending: list[tuple[int, str, int, torch.Tensor]] = []  # (due step, id, start, embeds)
    step_of = 0
    for n, i in enumerate(order):
        request = anew(whole[i], tiny_checkpoint)
        engine.add_request(request)
        embeds = whole[i].media_embeds
        start, cut = 0, 0
        while embeds is not None and start < embeds.shape[0]:
            size = splits[cut % len(splits)]
            step_of += delays[(n + cut) % len(delays)]
            pending.append((step_of, request.request_id, start, embeds[start : start + size]))
            start += size
            cut += 1
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_work() or pending:
        while pending and pending[0][0] <= step:
            _, request_id, start, part = pending.pop(0)
            assert engine.add_media(request_id, start, part) == []
        for output in engine.step()[0]:
            outputs.setdefault(output.request_id, []).append(output)
        step += 1
    for i in range(len(CASES)):
        assert tokens(outputs[f"r{i}"]) == expected[i], f"request {i}"
    assert any(begin for _, begin, _ in ranges)  # prompts went in more than one piece
    engine.blocks.allocator.check_integrity()
    assert engine.blocks.num_used_pages == 0


def test_text_before_the_first_image_is_prefilled_before_it_arrives(
    tiny_checkpoint: Path, whole: list[Request]
) -> None:
    """With no embedding yet, a step computes the prompt up to the image, then
    nothing more (the engine has no work) until the image comes."""
    engine = make_engine(tiny_checkpoint, cuda_graphs=False)
    request = anew(whole[1], tiny_checkpoint)
    engine.add_request(request)
    assert request.media_positions is not None
    first_image_token = int(request.media_positions[0])
    engine.step()
    assert request.num_computed_tokens == first_image_token
    assert not engine.has_work()
    assert whole[1].media_embeds is not None
    engine.add_media("r1", 0, whole[1].media_embeds)
    assert engine.has_work()
    engine.step()
    assert request.num_computed_tokens == request.num_prompt_tokens
    assert request.num_output_tokens == 1


def test_a_part_out_of_order_fails_its_request_alone(
    tiny_checkpoint: Path, whole: list[Request], expected: list[list[int]]
) -> None:
    engine = make_engine(tiny_checkpoint, cuda_graphs=False)
    bad = anew(whole[1], tiny_checkpoint)
    good = anew(whole[0], tiny_checkpoint, streamed=False)
    engine.add_request(bad)
    engine.add_request(good)
    outputs = engine.step()[0]
    assert whole[1].media_embeds is not None
    (failed,) = engine.add_media("r1", 5, whole[1].media_embeds[5:])
    assert failed.error is not None and "expected 0" in failed.error
    while engine.has_work():
        outputs += [o for o in engine.step()[0] if o.request_id == "r0"]
    assert tokens(outputs) == expected[0]
    assert engine.blocks.num_used_pages == 0


def test_a_waiting_request_without_its_first_image_lets_those_behind_it_in(
    tiny_checkpoint: Path, whole: list[Request], expected: list[list[int]]
) -> None:
    """A prompt that starts at its image waits outside the batch, holding no
    page; the text request behind it runs to its end meanwhile."""
    engine = make_engine(tiny_checkpoint, cuda_graphs=False)
    assert whole[1].media_positions is not None
    first = int(whole[1].media_positions[0])
    spec = load_spec(tiny_checkpoint)
    image_first = new_request(
        "image-first",
        whole[1].prompt_token_ids[first:],
        SamplingParams(max_tokens=2),
        spec,
        whole[1].media_grids,
        streamed=True,
    )
    engine.add_request(image_first)
    engine.add_request(anew(whole[0], tiny_checkpoint, streamed=False))
    outputs: list[RequestOutput] = []
    while engine.has_work():
        outputs += engine.step()[0]
    assert tokens([o for o in outputs if o.request_id == "r0"]) == expected[0]
    assert image_first.num_computed_tokens == 0 and not image_first.block_table
    assert engine.scheduler.waiting[0] is image_first
    assert whole[1].media_embeds is not None
    engine.add_media("image-first", 0, whole[1].media_embeds)
    while engine.has_work():
        outputs += engine.step()[0]
    assert outputs[-1].request_id == "image-first" and outputs[-1].finished
    assert engine.blocks.num_used_pages == 0


@pytest.mark.parametrize("budget", [5, 2048])
def test_deepstack_features_follow_their_image_in_parts(
    qwen3_checkpoint: Path, budget: int
) -> None:
    """Qwen3-VL: each part brings its tokens' deepstack features with their
    embeddings; two images arriving in three parts give HF's tokens."""
    images = [random_image(96, 80, seed=5), random_image(120, 90, seed=6)]
    messages = chat("Compare them.", 2)
    whole_request = make_request(
        qwen3_checkpoint, "deep", messages, images, SamplingParams(max_tokens=8)
    )
    embeds, deepstack = whole_request.media_embeds, whole_request.deepstack
    assert embeds is not None and deepstack is not None
    engine = make_engine(qwen3_checkpoint, max_num_batched_tokens=budget, cuda_graphs=False)
    guarded(engine)
    request = anew(whole_request, qwen3_checkpoint)
    engine.add_request(request)
    cuts = [0, embeds.shape[0] // 3, embeds.shape[0] - 7, embeds.shape[0]]
    outputs: list[RequestOutput] = []
    for start, end in itertools.pairwise(cuts):
        for _ in range(3):
            outputs += engine.step()[0]
        engine.add_media("deep", start, embeds[start:end], deepstack[start:end])
    while engine.has_work():
        outputs += engine.step()[0]
    assert tokens(outputs) == hf_greedy(qwen3_checkpoint, messages, images, 8)
    assert engine.blocks.num_used_pages == 0


def test_a_chunk_that_stops_at_a_missing_image_rides_along_with_other_prefill_work(
    tiny_checkpoint: Path, whole: list[Request]
) -> None:
    """Beside a decode it waits (a decode-only step stays one), with another
    prompt's prefill it goes in the same step."""
    engine = make_engine(tiny_checkpoint, cuda_graphs=False)
    engine.add_request(anew(whole[0], tiny_checkpoint, streamed=False))
    engine.step()  # r0's prompt: it decodes from now on
    blocked = anew(whole[1], tiny_checkpoint)
    assert blocked.media_positions is not None
    engine.add_request(blocked)
    engine.step()
    assert blocked.num_computed_tokens == 0
    engine.add_request(anew(whole[2], tiny_checkpoint, streamed=False))
    engine.step()
    assert blocked.num_computed_tokens == int(blocked.media_positions[0])


def test_a_chunk_that_waits_for_its_image_does_not_count_as_prefill_work(
    tiny_checkpoint: Path, whole: list[Request]
) -> None:
    """While the vision side encodes, a decode-only step waits its interval. A
    streamed request's text before its missing first image does not cancel that
    wait: beside decodes alone, that chunk does not go either. The step says how
    long it was held (for the metric), and so does each request (for its trace)."""
    engine = make_engine(tiny_checkpoint, cuda_graphs=False)
    engine.pacing = Pacing(replace(engine.config, decode_interval_while_encoding_ms=200))
    engine.pacing.awaiting_since = time.monotonic()
    engine.add_request(anew(whole[0], tiny_checkpoint, streamed=False))
    engine.step()  # r0's prompt: it decodes from now on
    blocked = anew(whole[1], tiny_checkpoint)
    engine.add_request(blocked)
    assert blocked.num_schedulable_tokens > 0 and blocked.waits_for_media
    assert not engine.scheduler.has_prefill_work()
    assert engine.step_delay() > 0.1  # the decode waits: the tower has the cores
    time.sleep(0.05)
    _, stats = engine.step()  # held that long (the loop would hold it the full interval)
    (decoding,) = [r for r in engine.scheduler.running if r.request_id == "r0"]
    assert stats.held_s >= 0.05 and decoding.held_seconds == stats.held_s
    engine.abort_request("r0")
    assert engine.scheduler.has_prefill_work()  # nothing decodes: the chunk goes now
    assert engine.step_delay() == 0.0
