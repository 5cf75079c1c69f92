"""Receiver: the receiving side of each transfer (a language instance's
embeddings; in E/P/D also a decode instance's KV pages), as a pure state
machine. Events come in as method calls; each returns the actions for the
driver (receiver_driver.py) to take, in order. No I/O, no asyncio, an
injected clock: tests drive it through any interleaving.

    expect(hint)     -> Allocate(hint or default tokens)
    allocated        -> Prealloc (first part) / Resume (later ones)          WAITING_FOR_INPUT
    expect(hint, skip) -> the same for the tokens after `skip`, which the
                        Prealloc asks none of (the prefix cache holds their
                        KV); all skipped: a Prealloc with no blocks, and the
                        sender's TransferDone of nothing -> Succeed
    the meta         -> remember it (EmbeddingMeta: the grids; KvMeta: the prompt)
    gRPC chunk       -> count it into the current part                      TRANSFERRING
    TransferDone     -> Confirm: the part is in memory (NIXL: its notification);
                        a part may end short of its blocks (the sender had
                        no more ready: an encoder sends each image as it is encoded)
    arrived(sent < total)  -> Stage the part, Free its blocks, Allocate the rest
    arrived(sent == total) -> Succeed(meta)                                  SUCCESS
    take()           -> Stage the last part, Free its blocks
    PeerLost         -> its encoder is gone: keep what landed and the blocks given
                        for the rest, wait for the next encoder's meta (which
                        the broker pairs with the latest Prealloc or Resume:
                        that encoder writes from where the landed tokens end)
    Abort / timeout / release() -> Fail                                       FAILED

A request only ever holds one part's blocks, so a small pool slows large
requests down (more resumes) but never deadlocks them.

A receiver that `keeps_blocks` (a decode instance's, whose blocks are KV pages
the request goes on decoding in) stages nothing: each part's blocks are kept,
and `take` hands them all over (Keep), less those the last part did not need.

Blocks of a request that ends while an encoder may still be writing them
(it was given them, and the part's TransferDone has not come) are quarantined:
they are freed when the encoder says Released, when the part's TransferDone
comes after all, when the encoder is lost, or after `quarantine_s`, never while
a write can still land.

"Encoder" here is whoever sends: an encoder, or in E/P/D a prefill instance.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.transfer.layout import PoolLayout
from services.transfer.state import (
    PoolExhaustedError,
    TransferFailedError,
    TransferState,
)
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

# Receive blocks for a request whose images came without token hints.
DEFAULT_ALLOCATE_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class Send:
    message: Prealloc | Resume | Abort


@dataclass(frozen=True, slots=True)
class Allocate:
    """Blocks for up to num_tokens (at least one block), then `allocated`."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Free:
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stage:
    """Copy the first num_tokens of these blocks out: they are freed next."""

    request_id: str
    blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Confirm:
    """Make sure the part ending at sent_tokens is in memory, then `arrived`."""

    request_id: str
    transport: Transport
    encoder_id: str
    sent_tokens: int


@dataclass(frozen=True, slots=True)
class Keep:
    """Every block of a finished request, in token order, is the caller's now."""

    request_id: str
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Succeed:
    request_id: str
    meta: TransferMeta


@dataclass(frozen=True, slots=True)
class Fail:
    """The transfer ended without the embeddings."""

    request_id: str
    error: TransferFailedError


@dataclass(frozen=True, slots=True)
class Forget:
    """Drop what the data plane and the driver keep for the request (staged
    parts, notifications): it ended."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ForgetSender:
    """Drop what the data plane keeps of the request's sender (notifications):
    its encoder changed. The parts that landed stay."""

    request_id: str


Action = Send | Allocate | Free | Stage | Keep | Confirm | Succeed | Fail | Forget | ForgetSender


@dataclass(slots=True)
class Inbound:
    request_id: str
    updated: float
    state: TransferState = TransferState.BOOTSTRAPPING
    blocks: list[int] = field(default_factory=list)  # the current part's
    part_start: int = 0  # tokens that arrived before the current part
    allocated_tokens: int = 0
    received_in_part: int = 0  # gRPC chunks written into the current part
    meta: TransferMeta | None = None
    kept: list[int] = field(default_factory=list)  # earlier parts' blocks (keeps_blocks)
    num_parts: int = 0
    num_failovers: int = 0
    confirming: bool = False  # a TransferDone is being confirmed
    skip: int = 0  # tokens from the first that are not wanted (part_start starts there)

    @property
    def part_tokens(self) -> int:
        """Tokens the current part carries."""
        assert self.meta is not None
        return min(self.meta.total_tokens - self.part_start, self.allocated_tokens)

    @property
    def encoder_id(self) -> str:
        """The sender's id (an encoder's, or in E/P/D a prefill instance's)."""
        return self.meta.sender_id if self.meta is not None else ""


@dataclass(slots=True)
class Quarantined:
    """Blocks an encoder may still write into, kept out of the pool."""

    blocks: list[int]
    encoder_id: str  # "" when the request ended before its meta named the encoder
    until: float


class Receiver:
    def __init__(
        self,
        layout: PoolLayout,
        default_allocate_tokens: int = DEFAULT_ALLOCATE_TOKENS,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        quarantine_s: float = 15.0,
        polled: frozenset[Transport] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
        keeps_blocks: bool = False,
    ) -> None:
        self.layout = layout
        self.keeps_blocks = keeps_blocks
        self.default_allocate_tokens = default_allocate_tokens
        self.timeout_s = timeout_s
        self.quarantine_s = quarantine_s
        self.polled = polled  # transports whose arrivals the driver polls for
        self._clock = clock
        self.transfers: dict[str, Inbound] = {}
        self.quarantine: dict[str, Quarantined] = {}
        # Requests whose data comes over a polled transport: read by the driver's
        # progress thread (len() only: never iterated there).
        self.polling: set[str] = set()

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(q.blocks) for q in self.quarantine.values())

    # -- the caller's events -------------------------------------------------

    def expect(self, request_id: str, hint_tokens: int, skip_tokens: int = 0) -> list[Action]:
        """A request whose embeddings an encoder will send: preallocate for them,
        but for the first `skip_tokens`, which are not wanted."""
        if request_id in self.transfers:
            raise ValueError(f"request {request_id!r} is already receiving")
        now = self._clock()
        inbound = Inbound(request_id, now, part_start=skip_tokens, skip=skip_tokens)
        self.transfers[request_id] = inbound
        if hint_tokens and skip_tokens >= hint_tokens:  # not one token wanted: no blocks
            inbound.state = TransferState.WAITING_FOR_INPUT
            return [Send(Prealloc(request_id, (), 0, skip_tokens=skip_tokens))]
        want = hint_tokens - skip_tokens if hint_tokens > 0 else self.default_allocate_tokens
        return [Allocate(request_id, want)]

    def allocated(self, request_id: str, blocks: list[int]) -> list[Action]:
        inbound = self.transfers.get(request_id)
        if inbound is None or inbound.state.is_finished:  # ended while waiting
            return [Free(tuple(blocks))]
        inbound.blocks = list(blocks)
        inbound.allocated_tokens = len(blocks) * self.layout.block_size
        inbound.received_in_part = 0
        inbound.state = TransferState.WAITING_FOR_INPUT
        inbound.updated = self._clock()
        if inbound.part_start == inbound.skip:
            prealloc = Prealloc(
                request_id, tuple(blocks), inbound.allocated_tokens, skip_tokens=inbound.skip
            )
            return [Send(prealloc)]
        resume = Resume(request_id, tuple(blocks), inbound.part_start, inbound.allocated_tokens)
        return [Send(resume)]

    def allocation_failed(self, request_id: str, reason: str) -> list[Action]:
        return self._end(request_id, PoolExhaustedError(reason), notify=True)

    def chunk_target(
        self, request_id: str, start_token: int, num_tokens: int, encoder_id: str
    ) -> tuple[list[int], int]:
        """Where a gRPC chunk of the current part goes: the blocks and the offset;
        TransferFailedError or ValueError when it has no place here."""
        inbound = self.transfers.get(request_id)
        if inbound is None or inbound.state.is_finished or not inbound.blocks:
            raise TransferFailedError(f"request {request_id!r} is not receiving")
        if inbound.meta is not None and inbound.encoder_id != encoder_id:
            raise TransferFailedError(
                f"request {request_id!r} is sent by {inbound.encoder_id}, not {encoder_id}"
            )
        offset = start_token - inbound.part_start
        if offset < 0 or offset + num_tokens > inbound.allocated_tokens:
            raise ValueError(
                f"tokens [{start_token}, {start_token + num_tokens}) are outside the current part "
                f"[{inbound.part_start}, {inbound.part_start + inbound.allocated_tokens})"
            )
        return inbound.blocks, offset

    def chunk_written(self, request_id: str, num_tokens: int) -> None:
        inbound = self.transfers[request_id]
        inbound.received_in_part += num_tokens
        inbound.state = TransferState.TRANSFERRING
        inbound.updated = self._clock()

    def take(self, request_id: str) -> list[Action]:
        """A finished request leaves: its last part is staged and its blocks freed."""
        inbound = self.transfers.pop(request_id)
        assert inbound.state is TransferState.SUCCESS and inbound.meta is not None
        count = inbound.meta.total_tokens - inbound.part_start
        blocks = tuple(inbound.blocks)
        if not count:  # every token was skipped
            return [Free(blocks)] if blocks else []
        if not self.keeps_blocks:
            return [Stage(request_id, blocks, count), Free(blocks)]
        need = -(-count // self.layout.block_size)
        unused = [Free(blocks[need:])] if blocks[need:] else []
        return [Keep(request_id, (*inbound.kept, *blocks[:need])), *unused]

    def release(self, request_id: str, reason: str) -> list[Action]:
        """The request ends here, whatever its state (the encoder is told)."""
        return self._end(request_id, TransferFailedError(reason), notify=True)

    def arrived(self, request_id: str, sent_tokens: int) -> list[Action]:
        """The part ending at sent_tokens is in memory."""
        inbound = self.transfers.get(request_id)
        if inbound is None or not inbound.confirming:
            return []  # ended while it was being confirmed
        inbound.confirming = False
        assert inbound.meta is not None
        inbound.num_parts += 1
        inbound.updated = self._clock()
        if sent_tokens >= inbound.meta.total_tokens:
            self.polling.discard(request_id)
            inbound.state = TransferState.SUCCESS
            return [Succeed(request_id, inbound.meta)]
        count = sent_tokens - inbound.part_start
        blocks, inbound.blocks = tuple(inbound.blocks), []
        inbound.part_start = sent_tokens
        inbound.state = TransferState.TRANSFERRING  # between parts: waiting for blocks
        remaining = inbound.meta.total_tokens - sent_tokens
        if self.keeps_blocks:  # every block of the part is full: the next part starts a block
            inbound.kept += blocks
            return [Allocate(request_id, remaining)]
        return [Stage(request_id, blocks, count), Free(blocks), Allocate(request_id, remaining)]

    def arrival_failed(self, request_id: str, reason: str) -> list[Action]:
        inbound = self.transfers.get(request_id)
        if inbound is None or not inbound.confirming:
            return []
        return self.release(request_id, reason)

    def broker_unavailable(self, request_id: str) -> list[Action]:
        """A Prealloc or Resume could not be sent."""
        return self._end(request_id, TransferFailedError("broker unavailable"), notify=False)

    # -- the broker's messages -------------------------------------------------

    def on_meta(self, meta: TransferMeta) -> list[Action]:
        inbound = self.transfers.get(meta.request_id)
        if inbound is None:
            reason = "the language instance does not know this request"
            return [Send(Abort(meta.request_id, reason))]
        layout = self.layout
        if (meta.planes, meta.dtype) != (layout.planes, layout.dtype):
            announced = ", ".join(map(str, meta.planes))
            return self.release(
                meta.request_id,
                f"embeddings {announced} x {meta.dtype} do not match the pool {layout.describe()}",
            )
        if meta.total_tokens <= 0:
            return self.release(meta.request_id, "metadata announces no tokens")
        if meta.total_tokens < inbound.skip:
            return self.release(
                meta.request_id,
                f"metadata announces {meta.total_tokens} tokens, fewer than the {inbound.skip} "
                "this instance holds",
            )
        if inbound.meta is not None and meta.total_tokens != inbound.meta.total_tokens:
            return self.release(  # another encoder after a failover: the same tokens
                meta.request_id,
                f"metadata announces {meta.total_tokens} tokens, the lost encoder's "
                f"{inbound.meta.total_tokens}",
            )
        inbound.meta = meta
        inbound.updated = self._clock()
        if meta.transport in self.polled:
            self.polling.add(meta.request_id)
        return []

    def on_done(self, done: TransferDone) -> list[Action]:
        inbound = self.transfers.get(done.request_id)
        if inbound is None:  # it ended as its part was being written: that write has landed
            return self._unquarantine(done.request_id)
        if inbound.meta is None or inbound.state.is_finished or inbound.confirming:
            return self.release(done.request_id, "a part finished that was not being sent")
        if inbound.skip == done.sent_tokens == inbound.meta.total_tokens == done.total_tokens:
            inbound.state = TransferState.SUCCESS  # all skipped: nothing was written
            self.polling.discard(done.request_id)
            return [Succeed(done.request_id, inbound.meta)]
        end = inbound.part_start + inbound.part_tokens
        if (
            not inbound.part_start < done.sent_tokens <= end
            or done.total_tokens != inbound.meta.total_tokens
        ):
            return self.release(
                done.request_id,
                f"part ends at {done.sent_tokens}/{done.total_tokens}, expected "
                f"({inbound.part_start}, {end}]",
            )
        sent_in_part = done.sent_tokens - inbound.part_start
        if self.keeps_blocks and sent_in_part != inbound.part_tokens:
            return self.release(done.request_id, "a KV part ended short of its pages")
        if done.transport is Transport.GRPC and inbound.received_in_part != sent_in_part:
            return self.release(
                done.request_id,
                f"{inbound.received_in_part} of {sent_in_part} tokens arrived over gRPC",
            )
        inbound.confirming = True
        inbound.updated = self._clock()
        return [Confirm(done.request_id, done.transport, inbound.encoder_id, done.sent_tokens)]

    def on_abort(self, abort: Abort) -> list[Action]:
        return self._end(abort.request_id, TransferFailedError(abort.reason), notify=False)

    def on_released(self, released: Released) -> list[Action]:
        return self._unquarantine(released.request_id)

    def on_peer_lost(self, lost: PeerLost) -> list[Action]:
        actions: list[Action] = []
        for request_id in lost.request_ids:
            actions += self._rewind(request_id, lost.instance_id)
        for request_id, held in list(self.quarantine.items()):
            if held.encoder_id == lost.instance_id:  # it is gone: no write can land
                actions += self._unquarantine(request_id)
        return actions

    # -- time, the broker stream, shutdown --------------------------------------

    def tick(self) -> list[Action]:
        now = self._clock()
        actions: list[Action] = []
        for request_id, held in list(self.quarantine.items()):
            if now > held.until:
                actions += self._unquarantine(request_id)
        for inbound in list(self.transfers.values()):
            if not inbound.state.is_finished and now - inbound.updated > self.timeout_s:
                reason = (
                    f"embeddings did not arrive within {self.timeout_s:.0f}s "
                    f"({inbound.state.name.lower()})"
                )
                actions += self.release(inbound.request_id, reason)
        return actions

    def detached(self) -> list[Action]:
        """The broker stream broke: nothing in flight can complete."""
        actions: list[Action] = []
        for inbound in list(self.transfers.values()):
            if not inbound.state.is_finished:
                error = TransferFailedError("broker connection lost")
                actions += self._end(inbound.request_id, error, notify=False)
        return actions

    def close(self) -> list[Action]:
        actions: list[Action] = []
        for request_id in list(self.transfers):
            actions += self.release(request_id, "language instance shutting down")
        for request_id in list(self.quarantine):
            actions += self._unquarantine(request_id)
        return actions

    # -- internals -------------------------------------------------------------

    def _end(self, request_id: str, error: TransferFailedError, notify: bool) -> list[Action]:
        inbound = self.transfers.pop(request_id, None)
        if inbound is None:
            return []
        actions: list[Action] = []
        if not inbound.state.is_finished:
            if notify:  # preallocated or not: the sender may already hold its part for it
                actions.append(Send(Abort(request_id, str(error))))
            actions.append(Fail(request_id, error))
        actions.append(Forget(request_id))
        self.polling.discard(request_id)
        # Its encoder was given the blocks and has not said the part is written.
        writable = not inbound.confirming and inbound.state in (
            TransferState.WAITING_FOR_INPUT,
            TransferState.TRANSFERRING,
        )
        inbound.state = TransferState.FAILED
        if inbound.kept:  # confirmed parts: nothing writes into them any more
            actions.append(Free(tuple(inbound.kept)))
            inbound.kept = []
        blocks, inbound.blocks = inbound.blocks, []
        if writable and blocks:  # an encoder was given them: a write may still land
            held = self.quarantine.setdefault(
                request_id,
                Quarantined([], inbound.encoder_id, self._clock() + self.quarantine_s),
            )
            held.blocks += blocks
        elif blocks:
            actions.append(Free(tuple(blocks)))
        return actions

    def _unquarantine(self, request_id: str) -> list[Action]:
        held = self.quarantine.pop(request_id, None)
        return [Free(tuple(held.blocks))] if held is not None else []

    def _rewind(self, request_id: str, encoder_id: str) -> list[Action]:
        """The request's encoder is gone: keep the parts that landed and the
        blocks given for the next one (written again from their first token),
        wait for the next encoder's meta. Nothing landed: its meta is forgotten
        too. A part being confirmed ends the request (it may not be whole)."""
        inbound = self.transfers.get(request_id)
        if inbound is None or inbound.state.is_finished:
            return []
        if inbound.confirming:
            return self.release(request_id, f"encoder {encoder_id} was lost mid-confirmation")
        landed = inbound.part_start > inbound.skip
        if not landed:
            inbound.meta = None  # the next encoder's grids may differ: nothing is kept
        inbound.received_in_part = 0
        inbound.num_failovers += 1
        if inbound.blocks:  # else between parts: the next part's blocks are on their way
            inbound.state = TransferState.WAITING_FOR_INPUT
        inbound.updated = self._clock()
        self.polling.discard(request_id)
        return [ForgetSender(request_id) if landed else Forget(request_id)]
