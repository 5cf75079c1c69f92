"""A conversation's KV pages move between engines: pages one engine computed,
exported by their digests and adopted by another, are that engine's cache hits
(bit-exact, never computed there) and the turn still answers as HF generate();
an export gives nothing below its minimum; a full cache adopts nothing and the
turn computes them; the move's cost model finds its crossover."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.language.engine.engine import LLMEngine
from services.language.engine.kv_cache import PrefixPages, kv_page_bytes, prefix_digests
from services.language.engine.outputs import StepStats
from services.language.prefix_moves import MoveCost
from services.loadgen.synthetic import random_image
from services.runtime.grpc_server import MAX_MESSAGE_BYTES
from services.wire.messages import media_key
from services.wire.request import SamplingParams
from tests.language.engine_fixtures import (
    make_engine,
    make_request,
    pinned_request,
    run_to_completion,
    tokens,
)
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
IMAGE = random_image(112, 112, seed=3)
KEYS = [media_key(IMAGE.tobytes())]
TURN_1: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "You answer briefly. " * 6}]},
    {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}],
    },
]


def _turn_2(answer: str) -> list[dict[str, Any]]:
    return [
        *TURN_1,
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": [{"type": "text", "text": "Which colour is it?"}]},
    ]


def _pages(engine: LLMEngine, moved: PrefixPages) -> list[torch.Tensor]:
    """The rows of the moved digests' pages in the engine's cache, per plane."""
    return list(engine.runner.kv_cache.read_pages(engine.blocks.leading_cached(moved.digests)))


def test_a_turn_on_another_engine_takes_the_moved_pages_and_answers_as_hf(
    tiny_checkpoint: Path,
) -> None:
    """Turn 1 runs on engine A. Turn 2 goes to engine B with the pages A exports
    for its prompt: B takes them as hits (the image's tokens among them, so it is
    sent no embedding for the image), holds them bit-exact, computes only what
    follows, and answers turn 2 as HF does."""
    holder, mover = make_engine(tiny_checkpoint), make_engine(tiny_checkpoint)
    first = make_request(tiny_checkpoint, "t1", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    answer = holder.tokenizer.decode(tokens(run_to_completion(holder, [first])["t1"]))
    chat = _turn_2(answer)
    whole = make_request(tiny_checkpoint, "t2", chat, [IMAGE], GREEDY, media_keys=KEYS)
    assert whole.media_embeds is not None and whole.media_positions is not None
    request = pinned_request(whole, tiny_checkpoint)
    digests = prefix_digests(request, holder.blocks.page_size)
    moved = holder.export_prefix(digests)
    assert 0 < moved.num_pages < len(digests)  # turn 1's pages, not turn 2's question
    page_bytes = kv_page_bytes(holder.spec.text, holder.blocks.page_size, holder.config.dtype)
    assert moved.nbytes == moved.num_pages * page_bytes

    request.moved_prefix = moved
    (told,) = mover.add_request(request)
    media = whole.media_positions.numel()
    assert told.num_media_held == media  # the image is never sent to B
    assert request.moved_prefix is None  # adopted, not kept on the request
    out = run_to_completion(mover, [])
    assert tokens(out["t2"]) == hf_greedy(tiny_checkpoint, chat, [IMAGE], 8)
    assert mover.blocks.num_hit_tokens == moved.num_pages * mover.blocks.page_size
    assert mover.blocks.num_hit_media_tokens == media
    for theirs, ours in zip(moved.planes, _pages(mover, moved), strict=True):
        assert torch.equal(theirs, ours)
    assert mover.blocks.num_used_pages == 0
    mover.blocks.allocator.check_integrity()


def test_a_mover_that_holds_the_system_prompt_fetches_only_the_rest(
    tiny_checkpoint: Path,
) -> None:
    """Engine B already served another chat with the same system prompt: it holds
    those pages, says so (an export without planes), and takes only the pages
    after them from A; the pages it held stay while it adopts the others (a
    cache with no free page evicts its idle ones), and turn 2 is HF's."""
    holder = make_engine(tiny_checkpoint)
    first = make_request(tiny_checkpoint, "t1", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    answer = holder.tokenizer.decode(tokens(run_to_completion(holder, [first])["t1"]))
    chat = _turn_2(answer)
    whole = make_request(tiny_checkpoint, "t2", chat, [IMAGE], GREEDY, media_keys=KEYS)
    assert whole.media_embeds is not None
    request = pinned_request(whole, tiny_checkpoint)
    digests = prefix_digests(request, holder.blocks.page_size)

    other = [TURN_1[0], {"role": "user", "content": [{"type": "text", "text": "Hello."}]}]
    mover = make_engine(tiny_checkpoint)
    run_to_completion(mover, [make_request(tiny_checkpoint, "o", other, [], GREEDY)])
    held = mover.export_prefix(digests, with_planes=False)
    assert held.num_pages and not held.planes  # the system prompt's pages
    moved = holder.export_prefix(digests[held.num_pages :])
    assert moved.num_pages and moved.digests[0] == digests[held.num_pages]
    # so few free pages that adopting takes every idle page but the system prompt's
    # (cached first, so the least recently used: what it would take first unkept)
    others = len(mover.blocks.idle) - held.num_pages
    assert 0 < others <= moved.num_pages
    hog = mover.blocks.allocate_pages(
        mover.blocks.allocator.num_free_blocks - moved.num_pages + others
    )
    assert hog is not None

    request.moved_prefix = moved
    (told,) = mover.add_request(request)
    assert told.num_media_held == whole.media_positions.numel()  # type: ignore[union-attr]
    mover.blocks.allocator.free(hog)  # room to compute the rest
    assert (
        mover.add_media("t2", told.num_media_held, whole.media_embeds[told.num_media_held :]) == []
    )
    out = run_to_completion(mover, [])
    assert tokens(out["t2"]) == hf_greedy(tiny_checkpoint, chat, [IMAGE], 8)
    assert request.num_cached_tokens == (held.num_pages + moved.num_pages) * 16


def test_an_export_below_its_minimum_gives_no_page(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    first = make_request(tiny_checkpoint, "t1", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    run_to_completion(engine, [first])
    digests = prefix_digests(first, engine.blocks.page_size)
    whole = engine.export_prefix(digests)
    assert whole.num_pages == len(digests)
    assert engine.export_prefix(digests, min_pages=len(digests) + 1).num_pages == 0
    assert (
        engine.export_prefix([b"\0" * 32, *digests]).num_pages == 0
    )  # a chain that starts elsewhere
    assert engine.blocks.num_used_pages == 0  # reading pages holds none


def test_an_export_beside_a_step_drops_a_page_taken_while_it_was_read(
    tiny_checkpoint: Path,
) -> None:
    """Exports run beside the engine's steps. A step that takes a cached page for
    other tokens while an export reads it (simulated: its digest dropped during
    the read) ends the export before that page: what was read whole is sent."""
    engine = make_engine(tiny_checkpoint)
    first = make_request(tiny_checkpoint, "t1", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    run_to_completion(engine, [first])
    digests = prefix_digests(first, engine.blocks.page_size)
    assert len(digests) > 3
    cache = engine.runner.kv_cache
    read = cache.read_pages

    def read_while_a_step_evicts(pages: list[int]) -> tuple[torch.Tensor, ...]:
        planes = read(pages)
        del engine.blocks.cached[engine.blocks.hash_of.pop(pages[2])]
        return planes

    cache.read_pages = read_while_a_step_evicts  # type: ignore[method-assign]
    moved = engine.export_prefix(digests)
    assert moved.digests == tuple(digests[:2])
    assert all(len(p) == 2 * engine.blocks.page_size for p in moved.planes)
    cache.read_pages = read  # type: ignore[method-assign]
    assert engine.export_prefix(digests, min_pages=3).num_pages == 0  # the chain breaks at 2


def test_a_full_cache_adopts_nothing_and_the_turn_computes_its_pages(
    tiny_checkpoint: Path,
) -> None:
    """Every page of B held by a running request: the moved pages find no room,
    and the turn computes them itself; its answer is still HF's."""
    holder = make_engine(tiny_checkpoint)
    first = make_request(tiny_checkpoint, "t1", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    run_to_completion(holder, [first])
    mover = make_engine(tiny_checkpoint)
    hog = mover.blocks.allocate_pages(mover.blocks.num_pages)
    assert hog is not None
    request = make_request(tiny_checkpoint, "t1b", TURN_1, [IMAGE], GREEDY, media_keys=KEYS)
    moved = holder.export_prefix(prefix_digests(request, holder.blocks.page_size))
    assert moved.num_pages
    mover.adopt_prefix(moved)
    assert mover.blocks.num_cached_pages == 0
    mover.blocks.allocator.free(hog)
    request.moved_prefix = None
    out = run_to_completion(mover, [request])
    assert tokens(out["t1b"]) == hf_greedy(tiny_checkpoint, TURN_1, [IMAGE], 8)
    assert mover.blocks.num_hit_tokens == 0


def test_the_cost_model_moves_pages_past_its_measured_crossover() -> None:
    """Fetching n pages costs a round trip plus their bytes; computing them, their
    tokens at the measured prefill rate. The crossover follows the measurements."""
    cost = MoveCost(page_size=16, page_bytes=16 * 1024, fetch_latency_s=0.002)
    cost.prefill_s_per_token = 1e-4
    cost.fetch_s_per_byte = 1e-9
    # a page: 1.6 ms to compute, 16 us to fetch plus the 2 ms round trip
    assert cost.min_pages() == 2  # 2 pages: 3.2 ms computed against 2.03 ms fetched
    for _ in range(50):  # prefill steps measure 10x faster tokens
        cost.on_step(StepStats(num_tokens=1000, num_generated=0, ttfts=[], tpots=[]), 0.01)
    assert abs(cost.prefill_s_per_token - 1e-5) < 1e-7
    assert cost.min_pages() == 14  # 0.16 ms saved a page: 13 pages save less than 2 ms
    cost.on_step(StepStats(num_tokens=4, num_generated=0, ttfts=[], tpots=[]), 5.0)
    assert abs(cost.prefill_s_per_token - 1e-5) < 1e-7  # a step under a page measures nothing
    cost.fetch_s_per_byte = 1e-6  # a slow link: a page's bytes cost more than computing it
    assert cost.min_pages() == 2**31
    # a fetch is one gRPC message: at most half of its limit
    assert cost.max_pages() * cost.page_bytes <= MAX_MESSAGE_BYTES // 2
    assert (cost.max_pages() + 1) * cost.page_bytes > MAX_MESSAGE_BYTES // 2
