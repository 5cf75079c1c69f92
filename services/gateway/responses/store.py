"""The stored responses (`store`, the default): each Response as GET returns it,
and its conversation as chat messages, which `previous_response_id` continues.
In memory, bounded by bytes and by age; the oldest go first."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from services.gateway.responses.convert import Messages


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    conversation: Messages  # every turn's input and output (no instructions)
    expires: float
    size: int


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        self._stored: OrderedDict[str, Stored] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, response: dict[str, Any], conversation: Messages) -> bool:
        """Stores a response; False where it alone is over the size limit."""
        size = _size(response) + _size(conversation)
        if size > self.max_bytes:
            return False
        self._drop(response["id"])
        self._stored[response["id"]] = Stored(
            response, conversation, time.monotonic() + self.ttl_s, size
        )
        self.bytes += size
        now = time.monotonic()
        while self._stored and (
            self.bytes > self.max_bytes or next(iter(self._stored.values())).expires <= now
        ):
            self._drop(next(iter(self._stored)))
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._stored.get(response_id)
        if stored is not None and stored.expires <= time.monotonic():
            self._drop(response_id)
            return None
        return stored

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        stored = self._stored.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None


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
