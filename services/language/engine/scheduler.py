"""Scheduler: continuous batching with a token budget and recompute preemption.

Each step, running requests come first (a decode is one token, an unfinished
prefill continues in chunks), then waiting ones are admitted in arrival order
while the token budget, the sequence limit and free KV pages allow; an
admitted request first takes the cached pages its tokens begin with. When a
running request cannot get pages, the newest running request is preempted:
its pages are freed and it goes back to the front of the queue to be
recomputed later. Admission checks that every request fits the cache alone,
so the oldest one always makes progress: no deadlock however small the pool.

Pinned pages keep that promise. A request whose images the prefix cache holds
takes its cached pages as it arrives (`pin`) and keeps them while it waits,
preempted or not: it was never sent those images' embeddings. A pin is given
up as it is made (the images are then sent after all) unless, for every live
request r, the pages pinned by the others plus all that r may need fit the
pool. Pins only shrink once made, so every pinned request fits beside the
others' pins to its end. A request that arrived after them and does not is
not admitted until they are let go (the pinned ones go first); while it
waits, no new pin is made (the check counts it).

A request whose images stream in (Request.num_media_ready) computes its
tokens up to the first one whose embedding has not arrived, and is passed
over, pages kept, while it waits for the next; the others go on. Such a
chunk, one that stops at a missing image, rides along with other prefill
work, or runs when nothing decodes: alone beside decodes it would turn a
decode-only step (on CPU one compiled call) into a slower mixed one for
every running request.

An n > 1 request holds n of the max_num_seqs seats from its admission on: its
other choices join the running batch when its prompt is prefilled.

A request that cannot be recomputed (a decode instance's, whose images were
encoded and prefilled elsewhere) is not preempted but ended: it goes to
`lost`, for the engine to fail.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from services.language.engine.kv_cache import KVBlockManager
from services.language.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # new tokens computed this step
    samples: bool  # the step reaches the end of the known tokens: a new token follows

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> Scheduled:
        reaches_end = request.num_computed_tokens + num_tokens == request.num_tokens
        return cls(request, num_tokens, reaches_end)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens > 1


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: KVBlockManager, max_model_len: int) -> None:
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lost: list[Request] = []  # ended where they would have been preempted
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether a step would compute anything (else the engine waits for news)."""
        return any(r.num_schedulable_tokens for r in (*self.running, *self.waiting))

    def pin(self, request: Request) -> int:
        """A just added request takes its cached pages now and keeps them
        (KVBlockManager.pin_prefix), where the bound above allows; the media
        tokens they cover, which it is then never sent (0: the pin was given up)."""
        held = self.blocks.pin_prefix(request)
        request.num_media_ready = request.num_media_held = held
        if not held or not self._pins_fit():  # a pin of text alone waits for admission
            self.blocks.free(request)
            request.num_computed_tokens = request.num_cached_pages = 0
            request.num_media_ready = request.num_media_held = 0
        return request.num_media_held

    def _pins_fit(self) -> bool:
        """Whether each live request fits the pool beside the others' pins."""
        pinned = self._pinned_pages_total()
        return all(self._fits_beside_pins(r, pinned) for r in (*self.running, *self.waiting))

    def _fits_beside_pins(self, request: Request, pinned: int) -> bool:
        others = pinned - self._pinned_pages(request)
        return others + self._most_pages(request) <= self.blocks.num_pages

    def _pinned_pages_total(self) -> int:
        return sum(self._pinned_pages(r) for r in (*self.running, *self.waiting))

    def _pinned_pages(self, request: Request) -> int:
        """The pages a request keeps whatever the scheduler does to it."""
        if not request.num_media_held:
            return 0
        if request.status is RequestStatus.RUNNING:
            return self._held_pages(request)
        return len(request.block_table)

    def _most_pages(self, request: Request) -> int:
        """The most pages a request may hold: its prompt and every output token,
        each other choice its own outputs and a copy of the prompt's last page."""
        blocks = self.blocks.allocator
        total = self.max_model_len
        if request.sampling.max_tokens:  # 0: up to the context length
            total = min(total, request.num_prompt_tokens + request.sampling.max_tokens)
        outputs = total - request.num_prompt_tokens
        extra = len(request.forks) * (blocks.blocks_for(outputs) + 1)
        return blocks.blocks_for(total) + extra

    def _preempt(self, request: Request) -> None:
        if not request.recomputable:
            self.blocks.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self.lost.append(request)
            return
        # The pages of media it was never sent (pin_prefix) stay: it computes again after them.
        keep = self._held_pages(request)
        self.blocks.truncate(request, keep)
        request.num_computed_tokens = keep * self.blocks.page_size
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def has_prefill_work(self) -> bool:
        """Whether the next step would compute a prompt's tokens (not only decode):
        a chunk that stops at a missing image counts only where it would go
        (`_short_chunks_go`): beside decodes alone, it waits."""
        prompts = [
            r
            for r in (*self.running, *self.waiting)
            if r.num_computed_tokens < r.num_prompt_tokens and r.num_schedulable_tokens
        ]
        if any(not r.waits_for_media for r in prompts):
            return True
        return bool(prompts) and self._short_chunks_go()

    def _held_pages(self, request: Request) -> int:
        """The pages up to the last media token it was never sent (0: none)."""
        if not request.num_media_held:
            return 0
        assert request.media_positions is not None
        return int(request.media_positions[request.num_media_held - 1]) // self.blocks.page_size + 1

    def _short_chunks_go(self) -> bool:
        """Whether chunks that stop at a missing image go this step: nothing
        decodes, or other prefill work runs anyway."""
        if not any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            return True
        return any(
            r.num_schedulable_tokens > 1 and not r.waits_for_media
            for r in (*self.running, *self.waiting)
        )

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted = False
        # A walk over every request, taken once a step and only if one waits for media
        short_chunks = functools.cache(self._short_chunks_go)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_schedulable_tokens, budget)
            if not num_tokens or (request.waits_for_media and not short_chunks()):
                index += 1
                continue
            while not self.blocks.allocate_slots(request, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(Scheduled.of(request, num_tokens))
                budget -= num_tokens
                index += 1
                continue
            break  # the request itself was preempted: everything after it is too
        # Newly freed pages go to the preempted first, so nothing new is admitted
        # in a step that had to preempt.
        seats = sum(1 + len(r.forks) for r in self.running)
        pinned = self._pinned_pages_total()
        for request in list(self.waiting) if not preempted else []:
            if budget <= 0 or seats + 1 + len(request.forks) > self.config.max_num_seqs:
                break
            if request.waits_for_media and not short_chunks():
                continue
            if pinned and not self._fits_beside_pins(request, pinned):
                continue  # not while others hold their pins: they go first
            self.blocks.reuse_prefix(request)
            num_tokens = min(request.num_schedulable_tokens, budget)
            if not num_tokens:  # it waits for its first image: those behind it go first
                self._unadmit(request)
                continue
            if not self.blocks.allocate_slots(request, num_tokens):
                self._unadmit(request)  # until it fits
                break
            self.blocks.count_hit(request)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(Scheduled.of(request, num_tokens))
            budget -= num_tokens
            seats += 1 + len(request.forks)
        return scheduled

    def _unadmit(self, request: Request) -> None:
        """Gives back the cached pages a waiting request took (reuse_prefix), but
        those holding media it was never sent (pin_prefix)."""
        if request.num_media_held:
            return
        self.blocks.free(request)
        request.num_computed_tokens = 0

    def join(self, parent: Request, choice: Request, num_tokens: int) -> None:
        """Another choice of an n > 1 request joins the running batch in the step
        that finishes its prompt (`num_tokens` of it this step): it shares the
        prompt's pages and samples its first token from the same logits."""
        self.blocks.share(parent, choice)
        choice.num_computed_tokens = parent.num_computed_tokens + num_tokens
        choice.status = RequestStatus.RUNNING
        self.running.append(choice)

    def hold(self, request: Request) -> None:
        """Takes a running request out of the batch with its pages (PREFILLED)."""
        self.running.remove(request)
        request.status = RequestStatus.PREFILLED

    def take_lost(self) -> list[Request]:
        lost, self.lost = self.lost, []
        return lost

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Removes a request wherever it is and frees its pages."""
        assert status.is_finished
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.block_table:
            self.blocks.free(request)
        request.status = status
