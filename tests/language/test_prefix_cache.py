"""The prefix cache: prompts that begin with the same text share its KV pages,
and every output still equals HF generate(); pages come back, a cached page no
one holds gives way when memory is wanted, nothing past the first image is
shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.language.engine.kv_cache import KVBlockManager, KVCacheConfig, _prefix_hashes
from services.language.engine.request import Request
from services.loadgen.synthetic import random_image
from services.wire.request import SamplingParams
from tests.language.engine_fixtures import make_engine, make_request, run_to_completion, tokens
from tests.reference import hf_greedy

SYSTEM = "You are a careful assistant who answers in short sentences. " * 4
QUESTIONS = ["What is a cat?", "Name a colour.", "Count to three.", "Say hello."]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _chat(question: str, num_images: int = 0) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
    ]


def test_requests_with_one_system_prompt_share_its_pages(tiny_checkpoint: Path) -> None:
    """One after another: each after the first takes the system prompt's pages
    from the cache (computing only the rest) and answers as HF does."""
    engine = make_engine(tiny_checkpoint)
    for i, question in enumerate(QUESTIONS):
        request = make_request(tiny_checkpoint, f"q{i}", _chat(question), [], GREEDY)
        hits = engine.blocks.num_hit_tokens
        out = run_to_completion(engine, [request])
        expected = hf_greedy(tiny_checkpoint, _chat(question), (), 8)
        assert tokens(out[f"q{i}"]) == expected, question
        shared = engine.blocks.num_hit_tokens - hits
        assert (shared > 0) == (i > 0)
        assert shared % engine.blocks.page_size == 0 and shared < request.num_prompt_tokens
    assert engine.blocks.num_used_pages == 0  # held by nobody: idle in the cache
    assert engine.blocks.num_cached_pages > 0
    engine.blocks.allocator.check_integrity()


def test_a_batch_in_a_cache_that_holds_one_request_still_equals_hf(
    tiny_checkpoint: Path,
) -> None:
    """Together, in pages for one request: the others wait, then take the system
    prompt's pages from the cache; every answer is HF's, every page comes back."""
    requests = [
        make_request(tiny_checkpoint, f"b{i}", _chat(q), [], GREEDY)
        for i, q in enumerate(QUESTIONS)
    ]
    longest = max(r.num_prompt_tokens for r in requests) + 8
    kv_tokens = -(-longest // 16) * 16  # one request's worth: the rest wait or are preempted
    engine = make_engine(
        tiny_checkpoint,
        kv_cache_bytes=_bytes(tiny_checkpoint, kv_tokens),
        max_model_len=kv_tokens,
        max_num_batched_tokens=32,  # short chunks: several requests in flight
    )
    out = run_to_completion(engine, requests)
    for i, question in enumerate(QUESTIONS):
        assert tokens(out[f"b{i}"]) == hf_greedy(tiny_checkpoint, _chat(question), (), 8)
    assert engine.blocks.num_hit_tokens > 0
    assert engine.blocks.num_used_pages == 0
    engine.blocks.allocator.check_integrity()


def test_pages_from_the_first_image_on_are_not_shared(tiny_checkpoint: Path) -> None:
    """The same text before different images: the text's pages are shared, the
    images' are not (the same placeholder tokens stand for other pictures)."""
    engine = make_engine(tiny_checkpoint)
    for i in range(2):
        image = random_image(56, 56, seed=i)
        request = make_request(tiny_checkpoint, f"i{i}", _chat("What is it?", 1), [image], GREEDY)
        assert request.media_positions is not None
        first_media = int(request.media_positions[0])
        hits = engine.blocks.num_hit_tokens
        out = run_to_completion(engine, [request])
        assert engine.blocks.num_hit_tokens - hits <= first_media
        expected = hf_greedy(tiny_checkpoint, _chat("What is it?", 1), [image], 8)
        assert tokens(out[f"i{i}"]) == expected


def test_the_cacheable_prefix_stops_before_the_first_image_and_the_last_token() -> None:
    def request(num_tokens: int, media: list[int]) -> Request:
        positions = torch.tensor(media) if media else None
        return Request(
            "r",
            list(range(num_tokens)),
            GREEDY,
            torch.zeros(3, num_tokens, dtype=torch.long),
            media_positions=positions,
        )

    assert len(_prefix_hashes(request(64, []), 16)) == 3  # never the page of the last token
    assert len(_prefix_hashes(request(65, []), 16)) == 4
    assert len(_prefix_hashes(request(65, [40]), 16)) == 2
    assert len(_prefix_hashes(request(65, [0]), 16)) == 0
    first, second = _prefix_hashes(request(65, []), 16), _prefix_hashes(request(80, []), 16)
    assert first == second[:4]  # a page's hash covers every token before it
    other = request(65, [])
    other.prompt_token_ids[0] = 99
    assert not set(_prefix_hashes(other, 16)) & set(first)


def test_an_idle_cached_page_is_taken_only_when_the_free_list_is_empty() -> None:
    blocks = KVBlockManager(KVCacheConfig(num_pages=4, page_size=2))
    request = Request("r", [1, 2, 3, 4, 5], GREEDY, torch.zeros(3, 5, dtype=torch.long))
    blocks.reuse_prefix(request)
    assert blocks.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    blocks.cache_computed(request)
    blocks.free(request)
    assert blocks.num_cached_pages == 2 and blocks.num_used_pages == 0
    assert len(blocks.allocate_pages(2) or []) == 2
    assert blocks.num_cached_pages == 2  # the free list had two
    assert len(blocks.allocate_pages(2) or []) == 2
    assert blocks.num_cached_pages == 0  # now the idle ones went
    assert blocks.allocate_pages(1) is None
    blocks.allocator.check_integrity()


def _bytes(checkpoint: Path, num_tokens: int) -> int:
    from services.model.spec import load_spec

    text = load_spec(checkpoint).text
    return num_tokens * text.num_layers * 2 * text.num_kv_heads * text.head_dim * 4  # fp32
