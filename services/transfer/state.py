"""What both sides of a transfer share: its per-request state (names from SGLang's
KVPoll), its errors, and the part of their drivers that is alike."""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Protocol


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


def fail(future: asyncio.Future[Any], error: BaseException) -> None:
    """Fails `future`, its exception retrieved here: a driver's waiter may be gone,
    and asyncio would log an exception nobody retrieved."""
    future.set_exception(error)
    future.exception()


class _Machine(Protocol):
    def tick(self) -> list[Any]: ...

    def detached(self) -> list[Any]: ...


class MachineDriver:
    """What SenderDriver and ReceiverDriver do alike: the timer and a lost broker
    stream are events of their machine (a Sender, a Receiver), whose actions
    `_run` carries out."""

    machine: _Machine

    def _run(self, actions: list[Any]) -> None:
        raise NotImplementedError

    async def expire(self) -> None:
        self._run(self.machine.tick())

    async def detached(self) -> None:
        self._run(self.machine.detached())
