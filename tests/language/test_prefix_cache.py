"""The prefix cache: prompts that begin with the same tokens share their KV
pages, images and earlier answers included, and every output still equals HF
generate(); pages come back, a cached page no one holds gives way when memory is
wanted, two pictures never share a page, an image without a content hash ends
what is shared."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from services.language.engine.engine import LLMEngine
from services.language.engine.kv_cache import KVBlockManager, KVCacheConfig, _prefix_hashes
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request, RequestStatus, new_request
from services.loadgen.synthetic import random_image
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
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


def test_pages_from_an_image_without_a_content_hash_on_are_not_shared(
    tiny_checkpoint: Path,
) -> None:
    """The same text before images the caller gave no hash: the text's pages are
    shared, the images' are not (the same placeholder tokens may stand for other
    pictures)."""
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


def test_the_cacheable_prefix_stops_before_an_unhashed_image_and_the_last_token() -> None:
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


def test_a_page_is_known_by_a_sha256_chain_that_the_salt_starts() -> None:
    """Each page's key is SHA-256 over the previous page's key and its tokens (not
    CPython's 64-bit hash(), which a caller who sets token ids could collide
    with); a request's cache salt starts the chain, so no page of it equals a
    page of the same tokens under another salt, or none."""
    tokens = list(range(48))

    def request(salt: str) -> Request:
        return Request("r", tokens, GREEDY, torch.zeros(3, 48, dtype=torch.long), cache_salt=salt)

    previous = b""
    expected = []
    for start in (0, 16):
        previous = hashlib.sha256(previous + repr(tokens[start : start + 16]).encode()).digest()
        expected.append(previous)
    assert _prefix_hashes(request(""), 16) == expected
    salted = [_prefix_hashes(request(salt), 16) for salt in ("a", "b")]
    assert all(len(h) == 2 and len(h[0]) == 32 for h in salted)
    assert not set(salted[0]) & set(salted[1]) and not set(salted[0]) & set(expected)


def test_requests_under_other_salts_share_no_page(tiny_checkpoint: Path) -> None:
    """One prompt under salt "a", again under "a" (its pages come from the cache),
    then under "b" and with no salt (computed anew); every answer is HF's."""
    engine = make_engine(tiny_checkpoint)
    chat = _chat(QUESTIONS[0])
    expected = hf_greedy(tiny_checkpoint, chat, (), 8)
    for i, (salt, hit) in enumerate((("a", False), ("a", True), ("b", False), ("", False))):
        request = make_request(tiny_checkpoint, f"s{i}", chat, [], GREEDY)
        request.cache_salt = salt
        out = run_to_completion(engine, [request])
        assert tokens(out[f"s{i}"]) == expected
        assert (out[f"s{i}"][-1].num_cached_tokens > 0) == hit, salt
    assert engine.blocks.num_used_pages == 0


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


def test_a_page_of_an_image_is_known_by_the_image_not_its_placeholders() -> None:
    """Pages over an image hash its content key and each token's place in it:
    another picture of the same size (the same placeholder tokens) is another
    page, the same picture behind the same tokens the same page."""

    def request(key: str) -> Request:
        return Request(
            "r",
            [7] * 8 + [1] * 16 + [9] * 16,
            GREEDY,
            torch.zeros(3, 40, dtype=torch.long),
            media_positions=torch.arange(8, 24),
            media_keys=(key,),
            media_sizes=(16,),
        )

    first, same, other = request("aa"), request("aa"), request("bb")
    assert len(_prefix_hashes(first, 8)) == 4
    assert _prefix_hashes(first, 8) == _prefix_hashes(same, 8)
    assert _prefix_hashes(other, 8)[0] == _prefix_hashes(first, 8)[0]  # the text before
    assert not set(_prefix_hashes(other, 8)[1:]) & set(_prefix_hashes(first, 8))


def _converse(
    engine: LLMEngine,
    checkpoint: Path,
    image: Image.Image,
    questions: list[str],
    max_tokens: int = 8,
) -> list[tuple[int, int]]:
    """A conversation about `image` on `engine`: each turn resends the history
    with the engine's earlier answers and must equal HF; the tokens (all, media)
    each turn took from the cache."""
    tokenizer = load_tokenizer(checkpoint)
    messages: list[dict[str, Any]] = []
    hits = []
    for turn, question in enumerate(questions):
        parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
        if turn == 0:
            parts.insert(0, {"type": "image"})
        messages.append({"role": "user", "content": parts})
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        key = media_key(image.tobytes())
        request = make_request(
            checkpoint, f"t{turn}", messages, [image], sampling, media_keys=[key]
        )
        before = engine.blocks.num_hit_tokens, engine.blocks.num_hit_media_tokens
        answer = tokens(run_to_completion(engine, [request])[f"t{turn}"])
        assert answer == hf_greedy(checkpoint, messages, [image], max_tokens), f"turn {turn}"
        hits.append(
            (
                engine.blocks.num_hit_tokens - before[0],
                engine.blocks.num_hit_media_tokens - before[1],
            )
        )
        text = tokenizer.decode(answer, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    engine.blocks.allocator.check_integrity()
    assert engine.blocks.num_used_pages == 0
    return hits


def _image_tokens(checkpoint: Path, image: Image.Image) -> int:
    request = make_request(
        checkpoint, "x", [{"role": "user", "content": [{"type": "image"}]}], [image], GREEDY
    )
    assert request.media_positions is not None
    return request.media_positions.numel()


QUESTIONS_ABOUT_IT = ["What is in this picture?", "What colour is it?", "And how big is it?"]


def test_a_conversation_about_an_image_prefills_only_each_turns_new_tokens(
    tiny_checkpoint: Path,
) -> None:
    """Turns 2 and 3 take the image's pages, and everything before it and up to
    the earlier turns' answers, from the cache; every answer is HF's."""
    engine = make_engine(tiny_checkpoint)
    image = random_image(112, 112, seed=3)
    hits = _converse(engine, tiny_checkpoint, image, QUESTIONS_ABOUT_IT)
    assert hits[0] == (0, 0)
    for total, media in hits[1:]:
        assert media == _image_tokens(tiny_checkpoint, image)
        assert total > media
    assert hits[2][0] > hits[1][0]  # turn 3 reuses turn 2's question and answer too


def test_a_deepstack_conversation_reuses_its_image(qwen3_checkpoint: Path) -> None:
    """Qwen3-VL: the cached pages of an image stand for its deepstack features too."""
    engine = make_engine(qwen3_checkpoint)
    image = random_image(112, 112, seed=5)
    hits = _converse(engine, qwen3_checkpoint, image, QUESTIONS_ABOUT_IT[:2])
    assert hits[1][1] == _image_tokens(qwen3_checkpoint, image)


def test_two_pictures_of_one_size_never_share_a_page(tiny_checkpoint: Path) -> None:
    """The same question about two pictures of one size, both hashed: only the
    text before them is shared, and each answer is its own picture's (HF's)."""
    engine = make_engine(tiny_checkpoint)
    for i in range(2):
        image = random_image(112, 112, seed=10 + i)
        chat = _chat("What is it?", 1)
        request = make_request(
            tiny_checkpoint, f"p{i}", chat, [image], GREEDY, media_keys=[media_key(image.tobytes())]
        )
        assert request.media_positions is not None
        before = engine.blocks.num_hit_tokens, engine.blocks.num_hit_media_tokens
        out = run_to_completion(engine, [request])
        assert engine.blocks.num_hit_media_tokens == before[1]
        assert engine.blocks.num_hit_tokens - before[0] <= int(request.media_positions[0])
        assert tokens(out[f"p{i}"]) == hf_greedy(tiny_checkpoint, chat, [image], 8)


def test_the_same_picture_after_other_tokens_is_computed_again(tiny_checkpoint: Path) -> None:
    """A picture's pages stand for it after the tokens before it: after others
    (here a caption in front of it) nothing of it is shared, and the answer is HF's."""
    engine = make_engine(tiny_checkpoint)
    image = random_image(112, 112, seed=7)
    key = [media_key(image.tobytes())]
    first = _chat("What is it?", 1)
    later = [
        first[0],
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, *first[1]["content"]]},
    ]
    run_to_completion(
        engine, [make_request(tiny_checkpoint, "a", first, [image], GREEDY, media_keys=key)]
    )
    before = engine.blocks.num_hit_media_tokens
    out = run_to_completion(
        engine, [make_request(tiny_checkpoint, "b", later, [image], GREEDY, media_keys=key)]
    )
    assert engine.blocks.num_hit_media_tokens == before
    assert tokens(out["b"]) == hf_greedy(tiny_checkpoint, later, [image], 8)


def test_a_request_s_output_pages_are_cached_once_full(tiny_checkpoint: Path) -> None:
    """A long answer's full pages are cached: a prompt that continues it (the next
    turn of a chat whose answer tokenizes the same) takes them, and generates
    what an engine without the cache does."""
    spec = load_spec(tiny_checkpoint)
    prompt = make_request(tiny_checkpoint, "x", _chat("Tell a story."), [], GREEDY).prompt_token_ids
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = make_engine(tiny_checkpoint)
    answer = tokens(run_to_completion(engine, [new_request("a", prompt, long, spec)])["a"])
    follow = [*prompt, *answer, *prompt[-4:]]
    before = engine.blocks.num_hit_tokens
    out = run_to_completion(engine, [new_request("b", follow, GREEDY, spec)])
    page = engine.blocks.page_size
    assert (
        engine.blocks.num_hit_tokens - before >= (len(prompt) + len(answer)) // page * page - page
    )
    uncached = make_engine(tiny_checkpoint, prefix_caching=False)
    expected = run_to_completion(uncached, [new_request("b", follow, GREEDY, spec)])
    assert tokens(out["b"]) == tokens(expected["b"])


def _bytes(checkpoint: Path, num_tokens: int) -> int:
    from services.model.spec import load_spec

    text = load_spec(checkpoint).text
    return num_tokens * text.num_layers * 2 * text.num_kv_heads * text.head_dim * 4  # fp32


def test_a_turn_that_pins_its_prefix_is_sent_only_the_images_its_cache_lacks(
    tiny_checkpoint: Path,
) -> None:
    """Added with pin_prefix, a request takes its cached pages at once and is told
    the media tokens they cover: none for turn 1; for turn 2, which resends turn
    1's picture and adds another, all of the first picture's. Each is given only
    the embeddings after those (from there on), holds its pages while it waits,
    and answers as HF does."""
    engine = make_engine(tiny_checkpoint)
    first, second = random_image(112, 112, seed=3), random_image(84, 112, seed=4)
    keys = [media_key(image.tobytes()) for image in (first, second)]
    turn_1 = _chat("What is in this picture? Say it in a few words, please.", 1)
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    expect_held = (0, _image_tokens(tiny_checkpoint, first))
    for turn, (chat, images, held) in enumerate(
        [(turn_1, [first], expect_held[0]), (turn_2, [first, second], expect_held[1])]
    ):
        whole = make_request(tiny_checkpoint, f"t{turn}", chat, images, GREEDY, media_keys=keys)
        assert whole.media_embeds is not None
        request = pinned_request(whole, tiny_checkpoint)
        (told,) = engine.add_request(request)
        assert told.num_media_held == held and not told.token_ids and not told.finished
        assert bool(request.block_table) == bool(held)  # pinned while it waits
        assert engine.add_media(f"t{turn}", held, whole.media_embeds[held:]) == []
        out = run_to_completion(engine, [])
        assert tokens(out[f"t{turn}"]) == hf_greedy(tiny_checkpoint, chat, images, 8), turn
    assert engine.blocks.num_used_pages == 0
    engine.blocks.allocator.check_integrity()


def test_a_preempted_turn_keeps_the_pages_of_the_image_it_was_never_sent(
    tiny_checkpoint: Path,
) -> None:
    """Pages run out while a turn whose image came from the cache runs beside a
    longer request: preempted, it keeps the pages up to that image (it has no
    embeddings to compute them again) and recomputes what follows; both answers
    are HF's and every page comes back."""
    image = random_image(112, 112, seed=3)
    key = [media_key(image.tobytes())]
    turn_1 = _chat("What is in this picture? Say it in a few words, please.", 1)
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which colour is it?"}]},
    ]
    other = [  # a system prompt of its own: it shares no page with the turn
        {"role": "system", "content": [{"type": "text", "text": "You tell stories."}]},
        {"role": "user", "content": [{"type": "text", "text": "About a lighthouse keeper."}]},
    ]
    first = make_request(tiny_checkpoint, "t1", turn_1, [image], GREEDY, media_keys=key)
    whole = make_request(tiny_checkpoint, "t2", turn_2, [image], GREEDY, media_keys=key)
    longer = SamplingParams(max_tokens=40, ignore_eos=True)
    long = make_request(tiny_checkpoint, "long", other, [], longer)
    # the smallest pool that lets the turn pin turn 1's pages (the bound leaves
    # the long request room for all it may need), too small for both at once
    pages = first.num_prompt_tokens // 16 + -(-(long.num_prompt_tokens + 40) // 16)
    assert pages * 16 < whole.num_prompt_tokens + 8 + long.num_prompt_tokens + 40
    engine = make_engine(
        tiny_checkpoint,
        kv_cache_bytes=_bytes(tiny_checkpoint, pages * 16),
        max_model_len=pages * 16,
        max_num_batched_tokens=32,
    )
    run_to_completion(engine, [first])
    engine.add_request(long)
    request = pinned_request(whole, tiny_checkpoint)
    (told,) = engine.add_request(request)
    assert told.num_media_held == _image_tokens(tiny_checkpoint, image)
    assert request.media_positions is not None
    held_pages = int(request.media_positions[told.num_media_held - 1]) // 16 + 1
    out: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for output in engine.step()[0]:
            out.setdefault(output.request_id, []).append(output)
        if request.status is RequestStatus.PREEMPTED:  # waiting, with its image's pages
            assert len(request.block_table) == held_pages
            assert request.num_computed_tokens == held_pages * 16
    assert request.num_preemptions > 0  # the turn itself was preempted
    assert tokens(out["t2"]) == hf_greedy(tiny_checkpoint, turn_2, [image], 8)
    assert tokens(out["long"]) == hf_greedy(tiny_checkpoint, other, [], 40)
    assert engine.blocks.num_used_pages == 0
    engine.blocks.allocator.check_integrity()
