"""Pacing: how the engine's loop shares the cores while requests of this instance
await their embeddings from a vision tower that computes on the same cores. Its
steps take fewer threads then, and a step that would only decode waits a while
after the last one ended, so that the tower has the cores in between."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.language.engine.config import EngineConfig
from services.language.engine.scheduler import Scheduled


class Pacing:
    def __init__(self, config: EngineConfig) -> None:
        self.interval_s = config.decode_interval_while_encoding_ms / 1000
        self.threads_while_encoding = config.threads_while_encoding
        self.threads = torch.get_num_threads()
        self.decode_threads = min(config.decode_threads or self.threads, self.threads)
        # set by the loop's host while requests await their embeddings
        self.encoding = False
        self.last_step = 0.0  # when the last step ended (time.monotonic)
        self.held_since: float | None = None  # when the step now due was first held

    def delay(self, prefill_work: bool) -> float:
        """Seconds to hold the next step: while requests await their embeddings, a
        step that would only decode (no `prefill_work`) waits
        EngineConfig.decode_interval_while_encoding_ms after the last one ended: a
        vision tower on these cores gets that long however long a step takes."""
        if not (self.interval_s and self.encoding) or prefill_work:
            return 0.0
        now = time.monotonic()
        delay = max(0.0, self.last_step + self.interval_s - now)
        if delay and self.held_since is None:
            self.held_since = now
        return delay

    def take_held(self) -> float:
        """Seconds the step that runs now was held (0.0: it was not)."""
        held, self.held_since = self.held_since, None
        return 0.0 if held is None else time.monotonic() - held

    def set_threads(self, batch: Sequence[Scheduled] = ()) -> None:
        """The step's OpenMP threads: all, or EngineConfig.decode_threads for a
        batch that only decodes, and at most threads_while_encoding while the
        vision side computes for us. torch.set_num_threads holds for the calling
        thread, which is the one that steps."""
        decodes = bool(batch) and sum(s.num_tokens for s in batch) == len(batch)
        threads = self.decode_threads if decodes else self.threads
        if self.encoding and self.threads_while_encoding:
            threads = min(threads, self.threads_while_encoding)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
