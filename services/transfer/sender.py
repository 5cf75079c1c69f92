"""Sender: the sending side of each transfer (an encoder's embeddings; in
E/P/D also a prefill instance's KV pages), as a pure state machine. Events
come in as method calls; each returns the actions for the driver
(sender_driver.py) to take, in order. No I/O, no asyncio, an injected clock:
tests drive it through any interleaving.

    start(meta)                -> send the meta (EmbeddingMeta, KvMeta)    WAITING_FOR_INPUT
    Prealloc                   -> Preallocated(skip): the caller hears which
                                  tokens are not wanted (the receiver's prefix
                                  cache holds their KV); sending starts after them
                                  (all skipped: TransferDone of nothing, Succeed)
    Prealloc / Resume(blocks)  -> Write min(ready, allocated) tokens       TRANSFERRING
                                  (none ready yet: keep the blocks until `ready`)
    written                    -> send TransferDone(sent, total)
        sent == total          -> Succeed, Free the send buffer            SUCCESS
        otherwise              -> wait for the next Resume                 WAITING_FOR_INPUT
    Abort / PeerLost / timeout / write error / abort() -> Fail             FAILED

A transfer may start before all its data is in the send buffer (an encoder
sends each image as soon as it is encoded): `ready` says how many tokens,
from the first, are there; a part ends where they do, and the receiver uses
it while the rest is still being made.

A transfer that fails while its write is in flight is ended at once (its
caller hears), but its send buffer is freed, and the language side told
`Released` (it was given blocks), only when that write is over: the write
still reads the buffer, and may still land in the receiver's blocks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.transfer.state import TransferState
from services.wire.messages import (
    Abort,
    PeerLost,
    Prealloc,
    Released,
    Resume,
    TransferDone,
    TransferMeta,
)
from services.wire.transport import TRANSFER_TIMEOUT_S, Transport


class Failure(enum.Enum):
    """Why a transfer failed, which tells the caller what to do about it."""

    ABORTED = "aborted"  # the receiver or the broker gave up on it: nothing to retry here
    TIMED_OUT = "timed out"  # no preallocation or resume in time
    WRITE_FAILED = "write failed"
    UNAVAILABLE = "unavailable"  # this sender cannot finish it (broker gone, shutting down)


@dataclass(frozen=True, slots=True)
class Send:
    message: TransferMeta | TransferDone | Abort | Released


@dataclass(frozen=True, slots=True)
class Write:
    """Write `count` tokens from token `start` of the request's send buffer into
    the receiver's blocks `dst_blocks`, then `written` (or `write_failed`)."""

    request_id: str
    transport: Transport
    start: int
    count: int
    dst_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Free:
    """The request's send buffer: no write reads it any more."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Preallocated:
    """The first preallocation came: tokens before `skip_tokens` are not wanted."""

    request_id: str
    skip_tokens: int


@dataclass(frozen=True, slots=True)
class Succeed:
    request_id: str


@dataclass(frozen=True, slots=True)
class Fail:
    request_id: str
    failure: Failure
    reason: str


Action = Send | Write | Free | Preallocated | Succeed | Fail


@dataclass(slots=True)
class Outbound:
    request_id: str
    peer_id: str
    transport: Transport
    total_tokens: int
    updated: float
    state: TransferState = TransferState.WAITING_FOR_INPUT
    sent_tokens: int = 0  # from the first, those skipped included
    skipped_tokens: int = 0  # not wanted by the receiver: never written
    had_blocks: bool = False  # the language side gave blocks: a write may land in them
    writing: int = 0  # tokens of the write in flight (0: none)
    ready_tokens: int = 0  # tokens in the send buffer, from the first
    parked: tuple[tuple[int, ...], int] | None = None  # blocks given before data was ready


class Sender:
    def __init__(
        self, timeout_s: float = TRANSFER_TIMEOUT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self.transfers: dict[str, Outbound] = {}
        # Ended while a write was in flight: freed when it is over.
        self.closing: dict[str, Outbound] = {}

    # -- the caller's events -------------------------------------------------

    def start(self, meta: TransferMeta, ready_tokens: int | None = None) -> list[Action]:
        """Announces a request's data, of which `ready_tokens` (default: all) are
        already where the writes read them."""
        request_id = meta.request_id
        if request_id in self.transfers or request_id in self.closing:
            raise ValueError(f"request {request_id!r} is already being sent")
        ready = meta.total_tokens if ready_tokens is None else ready_tokens
        self.transfers[request_id] = Outbound(
            request_id,
            meta.target_id,
            meta.transport,
            meta.total_tokens,
            self._clock(),
            ready_tokens=ready,
        )
        return [Send(meta)]

    def ready(self, request_id: str, tokens: int) -> list[Action]:
        """The first `tokens` of the request's data are in the send buffer; blocks
        given before they were get written now."""
        outbound = self.transfers.get(request_id)
        if outbound is None:
            return []
        outbound.ready_tokens = max(outbound.ready_tokens, min(tokens, outbound.total_tokens))
        if outbound.parked is None or outbound.ready_tokens <= outbound.sent_tokens:
            return []
        (blocks, allocated), outbound.parked = outbound.parked, None
        return [self._write(outbound, blocks, allocated)]

    def abort(self, request_id: str, reason: str) -> list[Action]:
        return self._fail(request_id, Failure.ABORTED, reason, notify=True)

    def withdraw(self, request_id: str, reason: str) -> list[Action]:
        """This sender cannot make the rest of the data. Nothing has landed yet:
        it lets go without a word, and the receiver, still waiting, can be given
        another sender (the broker's failover); else the transfer is aborted."""
        outbound = self.transfers.get(request_id)
        if outbound is None:
            return []
        if outbound.sent_tokens > outbound.skipped_tokens or outbound.writing:
            return self.abort(request_id, reason)
        return self._fail(request_id, Failure.UNAVAILABLE, reason, notify=False)

    def written(self, request_id: str) -> list[Action]:
        """The write in flight is in the receiver's memory."""
        outbound = self._writer(request_id)
        if outbound is None:
            return []
        count, outbound.writing = outbound.writing, 0
        if request_id in self.closing:  # ended while writing: now it can let go
            return self._let_go(self.closing.pop(request_id))
        outbound.sent_tokens += count
        outbound.updated = self._clock()
        done = TransferDone(
            request_id, outbound.sent_tokens, outbound.total_tokens, outbound.transport
        )
        if outbound.sent_tokens < outbound.total_tokens:
            outbound.state = TransferState.WAITING_FOR_INPUT
            return [Send(done)]
        return [Send(done), *self._end(outbound, TransferState.SUCCESS)]

    def switch_transport(self, request_id: str, transport: Transport) -> None:
        """The part in flight and the rest go over `transport` (a fallback after
        a failed write; TransferDone names it, so the receiver confirms it so)."""
        outbound = self.transfers.get(request_id)
        if outbound is not None:
            outbound.transport = transport

    def write_failed(self, request_id: str, reason: str) -> list[Action]:
        outbound = self._writer(request_id)
        if outbound is None:
            return []
        outbound.writing = 0
        if request_id in self.closing:
            return self._let_go(self.closing.pop(request_id))
        return self._fail(request_id, Failure.WRITE_FAILED, reason, notify=True)

    def broker_unavailable(self, request_id: str) -> list[Action]:
        """A message of the request could not be sent: it cannot finish."""
        return self._fail(request_id, Failure.UNAVAILABLE, "broker unavailable", notify=False)

    # -- the broker's messages -------------------------------------------------

    def on_prealloc(self, prealloc: Prealloc) -> list[Action]:
        request_id = prealloc.request_id
        if request_id not in self.transfers and request_id not in self.closing:
            # Ended before its first blocks came: they will never be written,
            # and the language side need not hold them in quarantine.
            return [Send(Released(request_id))]
        skipped = self._skip(request_id, prealloc.skip_tokens)
        outbound = self.transfers.get(request_id)
        if outbound is None:  # ended: everything skipped, or a bad skip
            return skipped
        return skipped + self._part(
            request_id, prealloc.block_ids, prealloc.allocated_tokens, outbound.sent_tokens
        )

    def _skip(self, request_id: str, skip: int) -> list[Action]:
        """The receiver wants none of the first `skip` tokens: sending starts
        after them; if that is all of them, the transfer is done without a write."""
        outbound = self.transfers.get(request_id)
        if outbound is None or outbound.state is not TransferState.WAITING_FOR_INPUT:
            return []
        if outbound.sent_tokens or skip > outbound.total_tokens:
            reason = f"bad preallocation: skip {skip} of {outbound.total_tokens} tokens"
            return self._fail(request_id, Failure.ABORTED, reason, notify=True)
        outbound.sent_tokens = outbound.skipped_tokens = skip
        actions: list[Action] = [Preallocated(request_id, skip)]
        if skip < outbound.total_tokens:
            return actions
        done = TransferDone(request_id, skip, skip, outbound.transport)
        return [*actions, Send(done), *self._end(outbound, TransferState.SUCCESS)]

    def on_resume(self, resume: Resume) -> list[Action]:
        return self._part(
            resume.request_id, resume.block_ids, resume.allocated_tokens, resume.sent_tokens
        )

    def on_abort(self, abort: Abort) -> list[Action]:
        request_id = abort.request_id
        if request_id not in self.transfers and request_id not in self.closing:
            # Finished (its last write landed) or never begun: nothing will be
            # written into the receiver's blocks, which it may free at once.
            return [Send(Released(request_id))]
        return self._fail(request_id, Failure.ABORTED, abort.reason or "aborted", notify=False)

    def on_peer_lost(self, lost: PeerLost) -> list[Action]:
        """A language instance is gone: its transfers (and those named) fail."""
        ended = set(lost.request_ids) | {
            r for r, o in self.transfers.items() if o.peer_id == lost.instance_id
        }
        reason = f"language instance {lost.instance_id} was lost"
        actions: list[Action] = []
        for request_id in sorted(ended):
            actions += self._fail(request_id, Failure.ABORTED, reason, notify=False)
        return actions

    # -- time, the broker stream, shutdown --------------------------------------

    def tick(self) -> list[Action]:
        """Fails transfers with no progress for timeout_s."""
        now = self._clock()
        actions: list[Action] = []
        for outbound in list(self.transfers.values()):
            if (
                outbound.state is TransferState.WAITING_FOR_INPUT
                and now - outbound.updated > self.timeout_s
            ):
                reason = f"no preallocation or resume within {self.timeout_s:.0f}s"
                actions += self._fail(outbound.request_id, Failure.TIMED_OUT, reason, notify=True)
        return actions

    def detached(self) -> list[Action]:
        """The broker stream broke: nothing in flight can complete."""
        actions: list[Action] = []
        for request_id in list(self.transfers):
            reason = "broker connection lost"
            actions += self._fail(request_id, Failure.UNAVAILABLE, reason, notify=False)
        return actions

    def close(self) -> list[Action]:
        actions: list[Action] = []
        for request_id in list(self.transfers):
            reason = "the sender is shutting down"
            actions += self._fail(request_id, Failure.UNAVAILABLE, reason, notify=True)
        return actions

    # -- internals -------------------------------------------------------------

    def _writer(self, request_id: str) -> Outbound | None:
        outbound = self.transfers.get(request_id) or self.closing.get(request_id)
        return outbound if outbound is not None and outbound.writing else None

    def _part(
        self, request_id: str, blocks: Sequence[int], allocated: int, sent: int
    ) -> list[Action]:
        outbound = self.transfers.get(request_id)
        if outbound is None or outbound.state is not TransferState.WAITING_FOR_INPUT:
            return []  # ended, or a duplicate of the part being written
        outbound.had_blocks = True
        if sent != outbound.sent_tokens or allocated <= 0 or not blocks:
            reason = (
                f"bad part: resume at {sent} with {allocated} tokens, {outbound.sent_tokens} sent"
            )
            return self._fail(request_id, Failure.ABORTED, reason, notify=True)
        outbound.state = TransferState.TRANSFERRING
        outbound.updated = self._clock()
        if outbound.ready_tokens <= outbound.sent_tokens:  # written when `ready` says
            outbound.parked = (tuple(blocks), allocated)
            return []
        return [self._write(outbound, tuple(blocks), allocated)]

    def _write(self, outbound: Outbound, blocks: tuple[int, ...], allocated: int) -> Write:
        outbound.writing = min(outbound.ready_tokens - outbound.sent_tokens, allocated)
        return Write(
            outbound.request_id, outbound.transport, outbound.sent_tokens, outbound.writing, blocks
        )

    def _fail(self, request_id: str, failure: Failure, reason: str, notify: bool) -> list[Action]:
        outbound = self.transfers.get(request_id)
        if outbound is None:
            return []
        actions: list[Action] = [Send(Abort(request_id, reason))] if notify else []
        return actions + self._end(
            outbound, TransferState.FAILED, Fail(request_id, failure, reason)
        )

    def _end(
        self, outbound: Outbound, state: TransferState, fail: Fail | None = None
    ) -> list[Action]:
        """The caller hears now; the buffer waits for a write in flight."""
        del self.transfers[outbound.request_id]
        outbound.state = state
        actions: list[Action] = [fail if fail is not None else Succeed(outbound.request_id)]
        if outbound.writing:
            self.closing[outbound.request_id] = outbound
            return actions
        return actions + self._let_go(outbound)

    def _let_go(self, outbound: Outbound) -> list[Action]:
        released = outbound.state is TransferState.FAILED and outbound.had_blocks
        return [
            *([Send(Released(outbound.request_id))] if released else []),
            Free(outbound.request_id),
        ]
