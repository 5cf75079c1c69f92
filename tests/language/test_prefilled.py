"""A request prefilled by one engine (hold_kv) and decoded by another from its
KV pages (add_prefilled) generates what one engine alone does, token for token;
both engines' pages come back."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from services.language.engine.engine import LLMEngine
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request, SamplingParams, prefilled_request
from services.model.spec import load_spec
from tests.language.engine_fixtures import make_engine, make_request, run_to_completion, tokens


def chat(text: str, images: int = 0) -> list[dict]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def hand_off(
    prefill: LLMEngine, decode: LLMEngine, request: Request
) -> dict[int, list[RequestOutput]]:
    """Prefills on one engine, copies the pages' KV over, decodes on the other."""
    request.hold_kv = True
    prefill.add_request(request)
    held: list[RequestOutput] = []
    while prefill.has_work():
        held += prefill.step()[0]
    assert all(o.prefilled is not None for o in held) and len(held) == request.sampling.n
    prompt = request.num_prompt_tokens
    source = held[0].prefilled
    assert source is not None
    planes = prefill.runner.kv_cache.pool.read(source.pages, 0, prompt)
    pages = decode.blocks.allocator.allocate(prompt)
    assert pages is not None
    decode.runner.kv_cache.pool.write(pages, 0, planes)
    prefill.release(request.request_id)
    assert prefill.blocks.num_used_pages == 0
    twin = prefilled_request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        decode.spec,
        request.mrope_delta,
        pages,
    )
    firsts = [o.prefilled.first for o in sorted(held, key=lambda o: o.index) if o.prefilled]
    outputs = decode.add_prefilled(twin, firsts)
    while decode.has_work():
        outputs += decode.step()[0]
    assert decode.blocks.num_used_pages == 0
    decode.blocks.allocator.check_integrity()
    by_choice: dict[int, list[RequestOutput]] = {}
    for output in outputs:
        by_choice.setdefault(output.index, []).append(output)
    return by_choice


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    return make_engine(tiny_checkpoint), make_engine(tiny_checkpoint), make_engine(tiny_checkpoint)


@pytest.mark.parametrize("images", [0, 1, 2])
def test_greedy_hand_off_equals_one_engine(
    tiny_checkpoint: Path, engines: tuple[LLMEngine, LLMEngine, LLMEngine], images: int
) -> None:
    alone, prefill, decode = engines
    pictures = [Image.new("RGB", (56 + 28 * i, 84), (40 * i, 90, 200)) for i in range(images)]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)

    def request(request_id: str) -> Request:
        return make_request(
            tiny_checkpoint, request_id, chat("Describe", images), pictures, sampling
        )

    expected = run_to_completion(alone, [request("a")])["a"]
    got = hand_off(prefill, decode, request("b"))[0]
    assert tokens(got) == tokens(expected)
    assert "".join(o.text for o in got) == "".join(o.text for o in expected)
    assert [lp.logprob for o in got for lp in o.logprobs] == pytest.approx(
        [lp.logprob for o in expected for lp in o.logprobs]
    )
    assert got[-1].finish_reason == expected[-1].finish_reason


def test_seeded_choices_go_on_where_the_prefill_left_them(
    tiny_checkpoint: Path, engines: tuple[LLMEngine, LLMEngine, LLMEngine]
) -> None:
    alone, prefill, decode = engines
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    expected = run_to_completion(
        alone, [make_request(tiny_checkpoint, "a", chat("Hi"), [], sampling)]
    )
    got = hand_off(prefill, decode, make_request(tiny_checkpoint, "b", chat("Hi"), [], sampling))
    for index in range(3):
        want = [o for o in expected["a"] if o.index == index]
        assert tokens(got[index]) == tokens(want), f"choice {index}"


def test_a_first_token_that_stops_ends_the_request_on_the_decode_side(
    tiny_checkpoint: Path, engines: tuple[LLMEngine, LLMEngine, LLMEngine]
) -> None:
    _, prefill, decode = engines
    sampling = SamplingParams(max_tokens=1)
    got = hand_off(prefill, decode, make_request(tiny_checkpoint, "c", chat("Hi"), [], sampling))
    assert len(tokens(got[0])) == 1 and got[0][-1].finish_reason == "length"


def test_an_engine_that_can_admit_nothing_waits_for_news(tiny_checkpoint: Path) -> None:
    """A prefill instance's held pages fill its cache: the next request cannot be
    admitted, and after one step that computes nothing the engine says it has no
    work (its loop sleeps instead of stepping empty batches) until the pages are
    released; then the request runs to its end."""
    text = load_spec(tiny_checkpoint).text
    token_bytes = text.num_layers * 2 * text.num_kv_heads * text.head_dim * 4
    engine = make_engine(tiny_checkpoint, kv_cache_bytes=64 * token_bytes, max_model_len=64)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    held = make_request(tiny_checkpoint, "held", chat("Count to ten " * 3), [], sampling)
    held.hold_kv = True
    engine.add_request(held)
    while engine.has_work():
        engine.step()
    assert len(held.block_table) * 16 > 64 - held.num_prompt_tokens
    waiting = make_request(tiny_checkpoint, "next", chat("Name five colours " * 3), [], sampling)
    engine.add_request(waiting)
    assert engine.has_work()
    outputs, stats = engine.step()
    assert not outputs and stats.num_tokens == 0
    assert not engine.has_work() and engine.scheduler.waiting
    engine.release("held")
    assert engine.has_work()
    finished = run_to_completion(engine, [])
    assert finished["next"][-1].finish_reason is not None
    assert engine.blocks.num_used_pages == 0
