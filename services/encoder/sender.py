"""Sender: the encoder side of each embedding transfer.

    start()  -> EmbeddingMeta to the broker               WAITING_FOR_INPUT
    Prealloc / Resume(blocks) -> write min(remaining, allocated) tokens
                              -> TransferDone(sent, total)  TRANSFERRING
    sent == total             -> release the send buffer    SUCCESS
    Abort / PeerLost / timeout / write error -> release     FAILED

Each transfer's `done` future resolves when it ends, so Encode answers once
the embeddings have landed (or says why they did not). A failed transfer
that had been given receive blocks tells the language side `Released` once
no write of its own can land in them any more, and only then frees its send
buffer, which an in-flight write may still be reading.

The language instances it may send to are announced by the broker
(InstanceJoined); the transport per pair is the best one both offer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.broker.client import BrokerLink, BrokerUnavailableError
from services.encoder.send_buffer import Held, SendBuffer
from services.transfer.state import TransferState
from services.transfer.transports.base import Part, Writer
from services.wire.messages import (
    Abort,
    BrokerMessage,
    EmbeddingMeta,
    ImageGrid,
    InstanceJoined,
    PeerLost,
    Prealloc,
    Register,
    Released,
    Resume,
    TransferDone,
)
from services.wire.transport import Transport, choose_transport

logger = logging.getLogger(__name__)


class UnknownPeerError(LookupError):
    """The target language instance is not (or no longer) registered."""


class Failure(enum.Enum):
    """Why a transfer failed, which tells the caller what to do about it."""

    ABORTED = "aborted"  # the language side or the broker gave up on it: nothing to retry here
    TIMED_OUT = "timed out"  # no preallocation or resume in time
    WRITE_FAILED = "write failed"
    UNAVAILABLE = "unavailable"  # this encoder cannot finish it (broker gone, shutting down)


class TransferError(RuntimeError):
    def __init__(self, failure: Failure, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure


@dataclass(slots=True)
class Outbound:
    request_id: str
    peer: Register
    transport: Transport
    held: Held
    updated: float
    done: asyncio.Future[None]
    state: TransferState = TransferState.BOOTSTRAPPING
    sent_tokens: int = 0
    had_blocks: bool = False  # the language side gave blocks: a write may land in them
    write: asyncio.Task[None] | None = None
    cleanup: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def total_tokens(self) -> int:
        return self.held.num_tokens


class Sender:
    def __init__(
        self,
        buffer: SendBuffer,
        writers: Mapping[Transport, Writer],
        host_id: str,
        timeout_s: float = 30.0,
        on_finished: Callable[[str, TransferState], None] = lambda request_id, state: None,
    ) -> None:
        self.buffer = buffer
        self.writers = dict(writers)
        self.host_id = host_id
        self.timeout_s = timeout_s
        self.link: BrokerLink | None = None
        self.peers: dict[str, Register] = {}
        self._peer_joined = asyncio.Condition()
        self.transfers: dict[str, Outbound] = {}
        self._closing: set[asyncio.Task[None]] = set()  # cleanups of finished transfers
        self._on_finished = on_finished

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(self.writers)

    def transport_to(self, peer: Register) -> Transport | None:
        assert peer.pool is not None
        return choose_transport(self.transports, self.host_id, peer.pool.transports, peer.host_id)

    async def peer(self, instance_id: str, wait_s: float = 2.0) -> Register:
        """The language instance's registration; waits briefly for a just-joined one."""
        async with self._peer_joined:
            try:
                await asyncio.wait_for(
                    self._peer_joined.wait_for(lambda: instance_id in self.peers), wait_s
                )
            except TimeoutError:
                raise UnknownPeerError(
                    f"language instance {instance_id!r} is not registered with the broker"
                ) from None
        return self.peers[instance_id]

    def _send(self, message: EmbeddingMeta | TransferDone | Abort | Released) -> None:
        if self.link is None:
            raise BrokerUnavailableError("this encoder has no broker")
        self.link.send(message)

    def start(
        self, request_id: str, peer: Register, held: Held, grids: Sequence[ImageGrid]
    ) -> Outbound:
        """Announces the embeddings; the transfer's `done` resolves when it ends."""
        transport = self.transport_to(peer)
        if transport is None:
            raise UnknownPeerError(f"no transport in common with {peer.instance_id}")
        if request_id in self.transfers:
            raise ValueError(f"request {request_id!r} is already being sent")
        layout = self.buffer.pool.layout
        done = asyncio.get_running_loop().create_future()
        outbound = Outbound(request_id, peer, transport, held, time.monotonic(), done)
        self.transfers[request_id] = outbound
        try:
            self._send(
                EmbeddingMeta(
                    request_id=request_id,
                    language_instance_id=peer.instance_id,
                    total_tokens=held.num_tokens,
                    grids=tuple(grids),
                    hidden_size=layout.hidden_size,
                    dtype=layout.dtype,
                    deepstack_levels=layout.deepstack_levels,
                    transport=transport,
                )
            )
        except BrokerUnavailableError as exc:
            self._finish(outbound, TransferState.FAILED, str(exc), Failure.UNAVAILABLE, False)
            raise
        outbound.state = TransferState.WAITING_FOR_INPUT
        return outbound

    async def on_message(self, message: BrokerMessage) -> None:
        if isinstance(message, InstanceJoined):
            registration = message.instance.registration
            async with self._peer_joined:
                self.peers[registration.instance_id] = registration
                self._peer_joined.notify_all()
        elif isinstance(message, Prealloc):
            if message.request_id not in self.transfers:
                # Ended before its first blocks came: they will never be written,
                # and the language side need not hold them in quarantine.
                with contextlib.suppress(BrokerUnavailableError):
                    self._send(Released(message.request_id))
                return
            self._part(message.request_id, message.block_ids, message.allocated_tokens, 0)
        elif isinstance(message, Resume):
            self._part(
                message.request_id, message.block_ids, message.allocated_tokens, message.sent_tokens
            )
        elif isinstance(message, Abort):
            outbound = self.transfers.get(message.request_id)
            if outbound is not None:
                reason = message.reason or "aborted"
                self._finish(outbound, TransferState.FAILED, reason, Failure.ABORTED, False)
        elif isinstance(message, PeerLost):
            await self._peer_lost(message)

    async def _peer_lost(self, message: PeerLost) -> None:
        reason = f"language instance {message.instance_id} was lost"
        lost = set(message.request_ids)
        if self.peers.pop(message.instance_id, None) is not None:
            lost |= {
                r for r, t in self.transfers.items() if t.peer.instance_id == message.instance_id
            }
            for writer in self.writers.values():
                await writer.forget(message.instance_id)
        for request_id in lost:
            outbound = self.transfers.get(request_id)
            if outbound is not None:
                self._finish(outbound, TransferState.FAILED, reason, Failure.ABORTED, False)

    def _part(self, request_id: str, blocks: Sequence[int], allocated: int, sent: int) -> None:
        outbound = self.transfers.get(request_id)
        if outbound is None or outbound.state is not TransferState.WAITING_FOR_INPUT:
            return  # finished or aborted meanwhile; the broker hears about it elsewhere
        outbound.had_blocks = True
        if sent != outbound.sent_tokens or allocated <= 0 or not blocks:
            reason = (
                f"bad part: resume at {sent} with {allocated} tokens, {outbound.sent_tokens} sent"
            )
            self._finish(outbound, TransferState.FAILED, reason, Failure.ABORTED)
            return
        outbound.state = TransferState.TRANSFERRING
        outbound.updated = time.monotonic()
        outbound.write = asyncio.create_task(self._write(outbound, list(blocks), allocated))

    async def _write(self, outbound: Outbound, blocks: list[int], allocated: int) -> None:
        count = min(outbound.total_tokens - outbound.sent_tokens, allocated)
        part = Part(outbound.request_id, outbound.held.blocks, outbound.sent_tokens, count, blocks)
        try:
            await self.writers[outbound.transport].write(outbound.peer, self.buffer.pool, part)
        except Exception as exc:
            name = outbound.transport.name.lower()
            logger.warning("%s: %s write failed: %s", outbound.request_id, name, exc)
            reason = f"{name} write failed: {exc}"
            self._finish(outbound, TransferState.FAILED, reason, Failure.WRITE_FAILED)
            return
        if outbound.state is not TransferState.TRANSFERRING:
            return  # aborted while writing
        outbound.sent_tokens += count
        outbound.updated = time.monotonic()
        try:
            self._send(
                TransferDone(
                    outbound.request_id,
                    outbound.sent_tokens,
                    outbound.total_tokens,
                    outbound.transport,
                )
            )
        except BrokerUnavailableError as exc:
            self._finish(outbound, TransferState.FAILED, str(exc), Failure.UNAVAILABLE, False)
            return
        if outbound.sent_tokens >= outbound.total_tokens:
            self._finish(outbound, TransferState.SUCCESS, "")
        else:
            outbound.state = TransferState.WAITING_FOR_INPUT

    def _finish(
        self,
        outbound: Outbound,
        state: TransferState,
        reason: str,
        failure: Failure = Failure.ABORTED,
        notify: bool = True,
    ) -> None:
        """Ends a transfer now (its caller hears at once); what it holds is given back
        by a cleanup task once its in-flight write, if any, has finished."""
        if self.transfers.pop(outbound.request_id, None) is None:
            return
        outbound.state = state
        self._on_finished(outbound.request_id, state)
        if state is TransferState.SUCCESS:
            outbound.done.set_result(None)
        else:
            logger.info("%s: transfer failed: %s", outbound.request_id, reason)
            outbound.done.set_exception(TransferError(failure, reason))
            outbound.done.exception()  # retrieved here if nobody awaits it
            if notify:
                with contextlib.suppress(BrokerUnavailableError):
                    self._send(Abort(outbound.request_id, reason))
        outbound.cleanup = asyncio.create_task(self._cleanup(outbound))
        self._closing.add(outbound.cleanup)
        outbound.cleanup.add_done_callback(self._closing.discard)

    async def _cleanup(self, outbound: Outbound) -> None:
        write = outbound.write
        if write is not None and write is not asyncio.current_task():
            await asyncio.wait({write})  # bounded by the writer's own timeout
        if outbound.state is TransferState.FAILED and outbound.had_blocks:
            with contextlib.suppress(BrokerUnavailableError):
                self._send(Released(outbound.request_id))
        await self.buffer.release(outbound.request_id)

    def abort(self, request_id: str, reason: str) -> None:
        outbound = self.transfers.get(request_id)
        if outbound is not None:
            self._finish(outbound, TransferState.FAILED, reason, Failure.ABORTED)

    async def expire(self) -> None:
        """Fails transfers with no progress for timeout_s."""
        now = time.monotonic()
        for outbound in list(self.transfers.values()):
            if (
                outbound.state is TransferState.WAITING_FOR_INPUT
                and now - outbound.updated > self.timeout_s
            ):
                reason = f"no preallocation or resume within {self.timeout_s:.0f}s"
                self._finish(outbound, TransferState.FAILED, reason, Failure.TIMED_OUT)

    async def detached(self) -> None:
        """The broker stream broke: nothing in flight can complete."""
        for outbound in list(self.transfers.values()):
            reason = "broker connection lost"
            self._finish(outbound, TransferState.FAILED, reason, Failure.UNAVAILABLE, False)

    async def close(self) -> None:
        for outbound in list(self.transfers.values()):
            if outbound.write is not None:
                outbound.write.cancel()
            reason = "encoder shutting down"
            self._finish(outbound, TransferState.FAILED, reason, Failure.UNAVAILABLE)
        if self._closing:
            await asyncio.wait(set(self._closing))
        for writer in self.writers.values():
            await writer.close()
