"""Pacing: how the engine's loop shares the cores while requests of this instance
await their embeddings from a vision tower that computes on the same cores. Its
steps take fewer threads then, and a step that would only decode waits a while
after the last one ended, so that the tower has the cores in between.

How long: a fixed interval where one is given; else what the running requests'
TPOT target leaves. The target counts as the SLO counts it, a mean over a
request's tokens since its first: its next token is due MARGIN x target x the
tokens it has after its first (the rest of the target is for the prefill chunks
that join some steps, and jitter). A decode step may wait until the earliest
running request's next token is due less a decode step's measured time. A
request whose tokens came faster than that has banked the difference, which the
tower then gets at once (a tower and a decode each on one core were no faster
than one after the other on both). Medium demo, 2 AVX2 cores, an image request
arriving 2 s into another's decode: its TTFT 4.6 s when every step waited only
its own share (MARGIN x target less a step), 3.5 s with the bank; the running
one's TPOT 75 ms either way. One wait is at most the TTFT target (a reader of a
running request waits no longer between two tokens than a new one for its
first; without a TTFT target, a step's own share). A faster machine or a
smaller batch gives the tower more, a slower one less, and none where a decode
step alone takes longer than the requests have banked, which the engine then
counts (`unmet`): the first tokens and the TPOT target cannot both be kept
there.

When: with a TTFT target too, only as the oldest request awaiting its
embeddings needs it. Before EASY of the target has passed since it came, decode
steps run back to back (the running requests' tokens come as fast as they
can); from then on the wait grows with its age, to the whole of what the TPOT
target leaves at URGENT of the target. Where embeddings have lately taken
longer to arrive than its age (a tower slow for the target: a bigger model, a
slower class), that time counts instead, so the waits come from the start.
A request whose first token is far from late costs the running ones little;
one near late gets what the TPOT target can spare. Without a TTFT target every
wait is whole. The threads drop to threads_while_encoding whenever requests
await, urgent or not: a step on all of them beside the tower is slower for both
(measured: decode steps back to back on both cores beside the tower doubled
TPOT p50, and the first tokens came later too)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.language.engine.config import EngineConfig
from services.language.engine.request import Request
from services.language.engine.scheduler import Scheduled

MARGIN = 0.8  # of the TPOT target a decode step and its wait may take
EASY = 0.25  # of the TTFT target: a younger oldest awaiting request gets no wait
URGENT = 0.5  # of the TTFT target: an older one gets the whole wait
SMOOTHING = 0.25  # the weight of the newest decode step in the measured time


class Pacing:
    def __init__(self, config: EngineConfig) -> None:
        self.interval_s = config.decode_interval_while_encoding_ms / 1000  # fixed, if given
        self.tpot_s = config.tpot_slo_ms / 1000
        self.ttft_s = config.ttft_slo_ms / 1000
        self.decode_step_s = 0.0  # a decode-only step's time, smoothed
        self.threads_while_encoding = config.threads_while_encoding
        self.threads = torch.get_num_threads()
        self.decode_threads = min(config.decode_threads or self.threads, self.threads)
        # set by the loop's host: when the oldest request now awaiting its
        # embeddings came (time.monotonic; None: none awaits them)
        self.awaiting_since: float | None = None
        self.media_wait_s = 0.0  # how long embeddings have taken to arrive lately
        self.last_step = 0.0  # when the last step ended (time.monotonic)
        self.held_since: float | None = None  # when the step now due was first held
        self.unmet = False  # the step now due had no time to give the tower (take_unmet)

    @property
    def encoding(self) -> bool:
        """Whether requests of this instance await their embeddings."""
        return self.awaiting_since is not None

    def urgency(self, now: float) -> float:
        """How much of the wait the oldest awaiting request needs, 0.0 to 1.0:
        by when its embeddings may come against the TTFT target (EASY to URGENT
        of it): its age, or the recent media wait where that is longer (a tower
        slow for this target needs the waits from the start); 1.0 without a
        target or with a fixed interval, 0.0 where none awaits."""
        if self.awaiting_since is None:
            return 0.0
        if not self.ttft_s or self.interval_s:  # a fixed interval is always whole
            return 1.0
        due = max(now - self.awaiting_since, self.media_wait_s) / self.ttft_s
        return min(1.0, max(0.0, (due - EASY) / (URGENT - EASY)))

    def interval(self, running: Sequence[Request]) -> float:
        """How long a decode-only step may wait after the last step ended while
        requests await their embeddings: the fixed interval, else until the
        earliest of the `running` requests' next tokens is due (MARGIN x the
        TPOT target a token since its first) less a decode step, at most the
        TTFT target; MARGIN x the target less a step where none has a first
        token or there is no TTFT target (0.0: back to back)."""
        if self.interval_s or not self.tpot_s:
            return self.interval_s
        pace = MARGIN * self.tpot_s
        share = max(0.0, pace - self.decode_step_s)
        due = min(
            (
                r.first_token_time + pace * r.num_output_tokens
                for r in running
                if r.first_token_time is not None
            ),
            default=None,
        )
        if due is None or not self.ttft_s:
            return share
        return min(self.ttft_s, max(0.0, due - self.decode_step_s - self.last_step))

    def delay(self, prefill_work: bool, running: Sequence[Request]) -> float:
        """Seconds to hold the next step: while requests await their embeddings, a
        step that would only decode (no `prefill_work`) waits as much of
        `interval()` after the last one ended as the oldest of them needs
        (`urgency`): a vision tower on these cores gets that long however long a
        step takes."""
        now = time.monotonic()
        urgency = self.urgency(now)
        if not urgency or prefill_work:
            return 0.0
        interval = urgency * self.interval(running)
        if not interval:
            self.unmet = bool(self.tpot_s)
            return 0.0
        delay = max(0.0, self.last_step + interval - now)
        if delay and self.held_since is None:
            self.held_since = now
        return delay

    def ended(self, seconds: float, batch: Sequence[Scheduled]) -> None:
        """A step took `seconds` (from its batch to its outputs): a decode-only
        step's time joins the measured one."""
        self.last_step = time.monotonic()
        if batch and _decodes(batch):
            known = self.decode_step_s
            self.decode_step_s = seconds if not known else known + SMOOTHING * (seconds - known)

    def take_unmet(self) -> bool:
        """Whether the step that runs now wanted a wait the TPOT target left no time for."""
        unmet, self.unmet = self.unmet, False
        return unmet

    def take_held(self) -> float:
        """Seconds the step that runs now was held (0.0: it was not)."""
        held, self.held_since = self.held_since, None
        return 0.0 if held is None else time.monotonic() - held

    def set_threads(self, batch: Sequence[Scheduled] = ()) -> None:
        """The step's OpenMP threads: all, or EngineConfig.decode_threads for a
        batch that only decodes, and at most threads_while_encoding while the
        vision side computes for us. torch.set_num_threads holds for the calling
        thread, which is the one that steps."""
        threads = self.decode_threads if batch and _decodes(batch) else self.threads
        if self.encoding and self.threads_while_encoding:
            threads = min(threads, self.threads_while_encoding)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _decodes(batch: Sequence[Scheduled]) -> bool:
    """Whether a batch only decodes (a token a request)."""
    return sum(s.num_tokens for s in batch) == len(batch)
