"""The stored responses (`store`, the default): each Response as GET returns it,
its input items, and its turn of the conversation as chat messages; a turn
that continues another (`previous_response_id`) holds on to it, so that a
conversation's history is kept, and counted, once however many turns share it.

In memory, bounded by bytes and by age. One response takes at most MAX_SHARE of
the bytes. Past the bound, what goes is chosen by size and age together
(GreedyDual-Size: each response's priority is the store's clock when it was
stored plus the bytes bound over its size; the lowest goes, and the clock moves
up to it): a burst of large responses gives way among itself before a small
conversation stored earlier does, and what is old goes in the end whatever its
size. A response that went stays readable by the turns that continue it (its
bytes stay counted) until they go too.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any

from services.gateway.responses.convert import Messages

MAX_SHARE = 0.5  # of the store's bytes, for one response's own


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    turn: Messages  # this turn's input and output, as chat messages (no instructions)
    input_items: list[dict[str, Any]]  # this turn's input, as its input_items list them
    previous: Stored | None  # the turn it continues
    expires: float
    size: int  # this turn's own bytes
    priority: float = 0.0
    holders: int = 1  # the store, and each stored turn that continues this one

    @property
    def conversation(self) -> Messages:
        """Every turn's messages, the first turn's first."""
        turns: list[Messages] = []
        stored: Stored | None = self
        while stored is not None:
            turns.append(stored.turn)
            stored = stored.previous
        return [message for turn in reversed(turns) for message in turn]


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0  # of every turn kept: stored, or continued by one that is
        self._clock = 0.0
        self._stored: dict[str, Stored] = {}  # oldest first
        # (priority, when stored, id) of each, lowest first; an entry whose response
        # went or was stored anew is stale, skipped when it comes up
        self._queue: list[tuple[float, int, str]] = []
        self._puts = 0

    def __len__(self) -> int:
        return len(self._stored)

    def put(
        self,
        response: dict[str, Any],
        turn: Messages,
        input_items: list[dict[str, Any]] | None = None,
        previous: Stored | None = None,
    ) -> bool:
        """Stores a response, the turn it adds to `previous`'s conversation and its
        input items; False where that alone is over its share of the store."""
        items = input_items or []
        size = _size(response) + _size(turn) + _size(items)
        if size > self.max_bytes * MAX_SHARE:
            return False
        self._drop(response["id"])
        self._hold(previous)
        now = time.monotonic()
        priority = self._clock + self.max_bytes / max(size, 1)
        stored = Stored(response, turn, items, previous, now + self.ttl_s, size, priority)
        self._stored[response["id"]] = stored
        self._puts += 1
        heapq.heappush(self._queue, (priority, self._puts, response["id"]))
        if len(self._queue) > 2 * len(self._stored) + 64:  # mostly stale: only the live
            self._queue = [e for e in self._queue if self._live(e)]
            heapq.heapify(self._queue)
        self.bytes += size
        self._expire(now)
        while self.bytes > self.max_bytes and self._stored:
            self._evict_lowest()
        return True

    def _evict_lowest(self) -> None:
        """The response of the lowest priority goes; the clock moves up to it."""
        while True:
            entry = heapq.heappop(self._queue)
            if self._live(entry):
                self._clock = entry[0]
                self._drop(entry[2])
                return

    def _live(self, entry: tuple[float, int, str]) -> bool:
        stored = self._stored.get(entry[2])
        return stored is not None and stored.priority == entry[0]

    def get(self, response_id: str) -> Stored | None:
        self._expire(time.monotonic())
        return self._stored.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._drop(response_id)

    def _expire(self, now: float) -> None:
        while self._stored:
            oldest = next(iter(self._stored))
            if self._stored[oldest].expires > now:
                return
            self._drop(oldest)

    def _drop(self, response_id: str) -> bool:
        stored = self._stored.pop(response_id, None)
        if stored is not None:
            self._release(stored)
        return stored is not None

    def _hold(self, stored: Stored | None) -> None:
        """One more holder of the turn: one that had none (it went while this
        response was written) is counted again, and holds its own."""
        while stored is not None:
            stored.holders += 1
            if stored.holders > 1:
                return
            self.bytes += stored.size
            stored = stored.previous

    def _release(self, stored: Stored | None) -> None:
        """One holder of the turn lets go; the last one frees its bytes, and lets
        go of the turn it continued."""
        while stored is not None:
            stored.holders -= 1
            if stored.holders:
                return
            self.bytes -= stored.size
            stored = stored.previous


def _size(value: Any) -> int:
    """About the bytes a value holds: its strings' lengths (a conversation's are
    mostly its images' data URLs), without serializing it on the event loop."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return 8
