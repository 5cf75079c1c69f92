"""n > 1: the prompt prefilled once, its KV pages shared by the choices (copy
on write), each choice its own generator; greedy choices equal HF generate()."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import xgrammar

from services.language.engine.engine import LLMEngine
from services.language.engine.kv_cache import KVBlockManager, KVCache, KVCacheConfig
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request, SamplingParams
from services.loadgen.synthetic import random_image
from services.model.spec import load_spec
from tests.language.engine_fixtures import (
    make_engine,
    make_request,
    run_to_completion,
    text,
    tokens,
)
from tests.reference import chat, hf_greedy

PROMPT = "Describe this image in detail, please."


def _by_choice(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    choices: dict[int, list[RequestOutput]] = {}
    for output in outputs:
        choices.setdefault(output.index, []).append(output)
    return choices


def _image_request(checkpoint: Path, request_id: str, sampling: SamplingParams) -> Request:
    image = random_image(160, 120, seed=5)
    return make_request(checkpoint, request_id, chat(PROMPT, 1), [image], sampling)


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path) -> list[int]:
    return hf_greedy(tiny_checkpoint, chat(PROMPT, 1), [random_image(160, 120, seed=5)], 20)


def _check_clean(engine: LLMEngine) -> None:
    engine.blocks.allocator.check_integrity()
    assert engine.blocks.num_used_pages == 0
    assert engine.blocks.num_shared_pages == 0
    assert not engine.requests and not engine.detokenizers


def test_greedy_choices_equal_hf_and_share_the_prompt_pages(
    tiny_checkpoint: Path, expected: list[int]
) -> None:
    engine = make_engine(tiny_checkpoint)
    request = _image_request(tiny_checkpoint, "g", SamplingParams(max_tokens=20, n=3))
    prompt_pages = -(-request.num_prompt_tokens // engine.blocks.page_size)
    engine.add_request(request)
    outputs: list[RequestOutput] = []
    step_outputs, _ = engine.step()  # the prefill: choice 0 forks 1 and 2
    outputs += step_outputs
    assert sorted(o.index for o in step_outputs) == [0, 1, 2]
    # Every prompt page but the last, partly filled one, is held once for all three.
    full_pages = request.num_prompt_tokens // engine.blocks.page_size
    assert full_pages >= 1
    assert engine.blocks.num_shared_pages == prompt_pages
    assert engine.blocks.num_used_pages == prompt_pages
    step_outputs, _ = engine.step()  # each choice writes its first token: copy on write
    outputs += step_outputs
    assert engine.blocks.num_shared_pages == full_pages
    assert engine.blocks.num_used_pages == full_pages + 3 * (prompt_pages - full_pages)
    while engine.has_work():
        outputs += engine.step()[0]
    choices = _by_choice(outputs)
    assert sorted(choices) == [0, 1, 2]
    for index, choice in choices.items():
        assert tokens(choice) == expected, f"choice {index}"
        assert choice[-1].finished and sum(o.finished for o in choice) == 1
    _check_clean(engine)


@pytest.mark.parametrize(
    ("kv_bytes", "max_model_len", "budget"),
    [(64 << 20, 1024, 24), (16384 * 10, 160, 2048)],
    ids=["chunked-prefill", "preemption"],
)
def test_greedy_choices_equal_hf_through_chunks_and_preemption(
    tiny_checkpoint: Path, expected: list[int], kv_bytes: int, max_model_len: int, budget: int
) -> None:
    """Forks at the last chunk of a chunked prefill; under a pool too small for
    all choices, preempted choices recompute on their own pages."""
    engine = make_engine(tiny_checkpoint, kv_bytes, max_model_len, max_num_batched_tokens=budget)
    requests = [
        _image_request(tiny_checkpoint, "a", SamplingParams(max_tokens=20, n=3)),
        _image_request(tiny_checkpoint, "b", SamplingParams(max_tokens=20, n=2)),
    ]
    out = run_to_completion(engine, requests)
    for request_id, n in (("a", 3), ("b", 2)):
        choices = _by_choice(out[request_id])
        assert sorted(choices) == list(range(n))
        for index, choice in choices.items():
            assert tokens(choice) == expected, f"{request_id} choice {index}"
    if kv_bytes < 1 << 20:
        assert engine.scheduler.num_preemptions > 0
    _check_clean(engine)


def _sampled(checkpoint: Path, seed: int, n: int) -> dict[int, list[int]]:
    engine = make_engine(checkpoint)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, n=n, ignore_eos=True)
    request = make_request(checkpoint, "s", chat("Write a poem about cats."), [], params)
    choices = _by_choice(run_to_completion(engine, [request])["s"])
    _check_clean(engine)
    return {index: tokens(choice) for index, choice in choices.items()}


def test_seeded_choices_are_reproducible_and_each_its_own(tiny_checkpoint: Path) -> None:
    """Choice i draws from seed + i: it equals the single request with that seed."""
    three = _sampled(tiny_checkpoint, seed=11, n=3)
    assert three == _sampled(tiny_checkpoint, seed=11, n=3)
    assert len({tuple(choice) for choice in three.values()}) == 3
    for index in range(3):
        assert three[index] == _sampled(tiny_checkpoint, seed=11 + index, n=1)[0]


def test_every_choice_follows_the_grammar(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=80, json_object=True)
    request = make_request(tiny_checkpoint, "j", chat("A JSON object, please."), [], params)
    request.grammar = asyncio.run(engine.grammars.compile(params))
    request.matcher = xgrammar.GrammarMatcher(request.grammar)
    choices = _by_choice(run_to_completion(engine, [request])["j"])
    assert len({text(choice) for choice in choices.values()}) == 3
    for choice in choices.values():
        if choice[-1].finish_reason == "stop":
            assert isinstance(json.loads(text(choice), strict=False), dict)
        else:  # the budget ran out first
            assert text(choice).startswith("{")
    _check_clean(engine)


def test_abort_ends_every_choice(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    request = _image_request(tiny_checkpoint, "x", SamplingParams(max_tokens=50, n=4))
    engine.add_request(request)
    engine.step()
    engine.step()
    finals = engine.abort_request("x")
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" for o in finals)
    _check_clean(engine)


def test_abort_before_the_fork_ends_every_choice(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=8)  # a long prefill
    engine.add_request(_image_request(tiny_checkpoint, "x", SamplingParams(max_tokens=5, n=3)))
    engine.step()
    finals = engine.abort_request("x")
    assert sorted(o.index for o in finals) == [0, 1, 2]
    _check_clean(engine)


def test_one_failed_choice_fails_the_request_and_frees_every_page(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_checkpoint)
    request = _image_request(tiny_checkpoint, "f", SamplingParams(max_tokens=20, n=3))
    execute = engine.runner.execute

    def poisoned(batch: list) -> torch.Tensor:  # type: ignore[type-arg]
        logits = execute(batch).clone()
        if request.num_output_tokens == 3:
            logits[0] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    out = run_to_completion(engine, [request])
    errors = [o for o in out["f"] if o.error is not None]
    assert len(errors) == 1 and errors[0].error == "the model produced non-finite logits"
    _check_clean(engine)


def test_n_beyond_the_batch_seats_is_refused(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, max_num_seqs=4)
    with pytest.raises(ValueError, match="n \\(5\\) exceeds the 4 sequences"):
        engine.checks.check_sampling(SamplingParams(n=5))


def test_seats_count_every_choice(tiny_checkpoint: Path) -> None:
    """max_num_seqs=4: an n=3 request and an n=2 one never run together."""
    engine = make_engine(tiny_checkpoint, max_num_seqs=4)
    for request_id, n in (("a", 3), ("b", 2)):
        params = SamplingParams(max_tokens=6, n=n, ignore_eos=True)
        engine.add_request(make_request(tiny_checkpoint, request_id, chat("Hi"), [], params))
    while engine.has_work():
        engine.step()
        assert len(engine.scheduler.running) <= 4
        ids = {r.request_id for r in engine.scheduler.running}
        assert ids != {"a", "b"}
    _check_clean(engine)


def test_copy_on_write_copies_the_page_in_every_layer(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    config = KVCacheConfig(num_pages=8, page_size=4)
    cache = KVCache(spec.text, config, torch.device("cpu"))
    blocks = KVBlockManager(config)
    parent = Request("p", list(range(6)), SamplingParams(), torch.zeros(3, 6))
    assert blocks.allocate_slots(parent, 6)  # pages for tokens 0-3 and 4-5
    for half in (t for layer in cache.layers for t in layer):
        half[parent.block_table] = torch.randn_like(half[parent.block_table])
    parent.num_computed_tokens = 6
    child = parent.choice(1)
    blocks.share(parent, child)
    child.num_computed_tokens = 6
    assert blocks.num_used_pages == 2 and blocks.num_shared_pages == 2
    assert blocks.allocate_slots(child, 1)  # token 6 lands in the shared second page
    first, second = parent.block_table
    assert child.block_table[0] == first and child.block_table[1] != second
    assert blocks.take_copies() == [(second, child.block_table[1])]
    cache.copy_pages([(second, child.block_table[1])])
    for half in (t for layer in cache.layers for t in layer):
        assert torch.equal(half[child.block_table[1]], half[second])
    assert blocks.allocate_slots(parent, 1)  # the parent alone holds its page now: no copy
    assert parent.block_table == [first, second] and not blocks.take_copies()
    blocks.free(child)
    assert blocks.num_used_pages == 2 and blocks.num_shared_pages == 0
    blocks.free(parent)
    assert blocks.num_used_pages == 0
    blocks.allocator.check_integrity()
