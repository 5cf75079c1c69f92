"""The scheduler and the prefix cache, pure logic: conversations whose follow-ups
pin their images' cached pages, on pools from one request's size up. Every
request finishes, no step that could compute is empty, and every page comes back."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.language.engine.kv_cache import KVBlockManager, KVCacheConfig
from services.language.engine.request import Request, RequestStatus
from services.language.engine.scheduler import Scheduler, SchedulerConfig
from services.wire.request import SamplingParams

PAD = 100_000  # an image token's id in the prompt


@dataclass(frozen=True)
class Turn:
    tokens: list[int]
    media: list[tuple[str, int, int]]  # (key, first position, tokens)


def _request(request_id: str, turn: Turn, max_tokens: int) -> Request:
    """A streamed request: its media's embeddings come with add_media."""
    positions = [p for _, first, size in turn.media for p in range(first, first + size)]
    return Request(
        request_id,
        turn.tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        torch.zeros(3, len(turn.tokens), dtype=torch.long),
        media_positions=torch.tensor(positions, dtype=torch.long),
        media_keys=tuple(key for key, _, _ in turn.media),
        media_sizes=tuple(size for _, _, size in turn.media),
        num_media_ready=0,
    )


def _turn(words: list[int], images: list[tuple[str, int]], before: Turn | None = None) -> Turn:
    """`before`'s tokens (with its answer, appended by the caller), then `words`
    with the images (key, tokens) after them."""
    tokens = list(before.tokens) if before else []
    media = list(before.media) if before else []
    tokens += words
    for key, size in images:
        media.append((key, len(tokens), size))
        tokens += [PAD] * size
    return Turn([*tokens, 7, 8], media)


class Simulation:
    """The engine's step without a model: computed tokens advance, each sampled
    token is 1000 + its index, and a request stops at its max_tokens."""

    def __init__(self, num_pages: int, page_size: int, max_model_len: int, budget: int) -> None:
        self.blocks = KVBlockManager(KVCacheConfig(num_pages, page_size))
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
        self.scheduler = Scheduler(config, self.blocks, max_model_len)
        self.max_model_len = max_model_len
        self.live: list[Request] = []
        self.steps = 0

    def add(self, request: Request) -> int:
        """Adds a follow-up as the engine does: pinned; the media tokens it holds."""
        request.pin_prefix = True
        self.scheduler.add(request)
        self.live.append(request)
        return self.scheduler.pin(request)

    def deliver(self, request: Request) -> None:
        """Every embedding the request was not told it holds."""
        start = request.num_media_ready or 0
        rest = request.num_media_tokens - start
        if rest and not request.is_finished:
            request.add_media(start, torch.zeros(rest, 1), None)

    def step(self) -> int:
        """Tokens computed."""
        self.steps += 1
        batch = self.scheduler.schedule()
        for s in batch:
            request = s.request
            request.num_computed_tokens += s.num_tokens
            if s.is_prefill or request.num_computed_tokens % self.blocks.page_size == 0:
                self.blocks.cache_computed(request)
            if s.samples:
                request.output_token_ids.append(1000 + request.num_output_tokens)
                if (
                    request.num_output_tokens >= request.sampling.max_tokens
                    or request.num_tokens >= self.max_model_len
                ):
                    self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        return sum(s.num_tokens for s in batch)

    def run(self, arrivals: dict[int, list[Request]], limit: int) -> None:
        """Steps until every request is done, delivering media at their step; a
        step that computes nothing while every embedding is in, and preempts
        nothing, is a deadlock."""
        while self.scheduler.has_work() or any(arrivals.values()):
            assert self.steps < limit, "requests still unfinished"
            for request in arrivals.pop(self.steps, []):
                self.deliver(request)
            preemptions = self.scheduler.num_preemptions
            computed = self.step()
            waiting = any(r.waits_for_media for r in self.live if not r.is_finished)
            preempted = self.scheduler.num_preemptions > preemptions
            assert computed or waiting or preempted or arrivals, "a step computed nothing"

    def check_balanced(self) -> None:
        assert all(r.is_finished for r in self.live)
        assert self.blocks.num_used_pages == 0 and not self.blocks.refs
        self.blocks.allocator.check_integrity()


def conversations(
    num_chats: int,
    image_tokens: int,
    words: int,
    num_pages: int,
    page_size: int,
    max_model_len: int,
    new_image: bool,
    order: list[int],
    delays: list[int],
    budget: int = 64,
) -> Simulation:
    """Each chat's first turn (an image, then words) alone, then every chat's
    follow-up together (in `order`), each asking for the rest of
    max_model_len, its new image (if any) `delays[i]` steps later."""
    sim = Simulation(num_pages, page_size, max_model_len, budget)
    firsts = []
    for chat in range(num_chats):
        words_of = [10 + chat] * words
        turn = _turn(words_of, [(f"image-{chat}", image_tokens)])
        first = _request(f"c{chat}-t1", turn, 4)
        sim.scheduler.add(first)
        sim.live.append(first)
        sim.deliver(first)
        sim.run({}, limit=10_000)
        firsts.append((turn, first))
    arrivals: dict[int, list[Request]] = {}
    for chat in order:
        turn, first = firsts[chat]
        answered = Turn(turn.tokens + first.output_token_ids, turn.media)
        images = [(f"image-{chat}-b", image_tokens)] if new_image else []
        follow = _turn([20 + chat] * 3, images, answered)
        request = _request(f"c{chat}-t2", follow, max_model_len - len(follow.tokens))
        sim.add(request)
        arrivals.setdefault(sim.steps + delays[chat], []).append(request)
    sim.run(arrivals, limit=sim.steps + 20 * max_model_len)
    return sim


def test_follow_ups_whose_pins_would_fill_the_pool_all_finish() -> None:
    """Three chats with a 256-token image each, a pool twice one request, the
    three follow-ups together, each asking for the rest of max_model_len: the
    pins alone would leave the oldest too little; the last one's is given up
    (its image is sent after all) and every request finishes."""
    max_model_len, page_size = 512, 16
    sim = conversations(
        num_chats=3,
        image_tokens=256,
        words=40,
        num_pages=2 * max_model_len // page_size,
        page_size=page_size,
        max_model_len=max_model_len,
        new_image=False,
        order=[0, 1, 2],
        delays=[0, 0, 0],
    )
    follow_ups = [r for r in sim.live if r.request_id.endswith("t2")]
    held = [r.num_media_held for r in follow_ups]
    assert held[0] > 0 and held[1] > 0 and held[2] == 0, held
    assert all(r.num_output_tokens == 512 - r.num_prompt_tokens for r in follow_ups)
    sim.check_balanced()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_chats=st.integers(1, 4),
    image_tokens=st.integers(4, 96),
    words=st.integers(1, 60),
    page_size=st.sampled_from([4, 8, 16]),
    extra_pages=st.integers(0, 40),
    new_image=st.booleans(),
    budget=st.sampled_from([16, 64, 256]),
    seed=st.integers(0, 2**16),
)
def test_every_follow_up_finishes_and_every_page_comes_back(
    num_chats: int,
    image_tokens: int,
    words: int,
    page_size: int,
    extra_pages: int,
    new_image: bool,
    budget: int,
    seed: int,
) -> None:
    """Random pools (one request's size and up), page sizes, chat lengths, token
    budgets, arrival orders and image delays: pins never stop the engine."""
    rng = random.Random(seed)
    max_model_len = 2 * (words + 2 * image_tokens + 16)
    order = rng.sample(range(num_chats), num_chats)
    delays = [rng.randrange(0, 30) for _ in range(num_chats)]
    num_pages = -(-max_model_len // page_size) + extra_pages
    sim = conversations(
        num_chats,
        image_tokens,
        words,
        num_pages,
        page_size,
        max_model_len,
        new_image,
        order,
        delays,
        budget,
    )
    sim.check_balanced()
