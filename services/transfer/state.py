"""Per-request transfer state, kept by both sides (names from SGLang's KVPoll)."""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    BOOTSTRAPPING = 0  # known, nothing exchanged yet
    WAITING_FOR_INPUT = 1  # waiting for the other side (prealloc / resume / data)
    TRANSFERRING = 2  # a part is being written
    SUCCESS = 3
    FAILED = 4

    @property
    def is_finished(self) -> bool:
        return self >= TransferState.SUCCESS


class TransferFailedError(RuntimeError):
    """A transfer ended without the embeddings: abort, timeout or a lost peer."""


class PoolExhaustedError(TransferFailedError):
    """No receive blocks came free within the wait allowed: the instance is overloaded."""
