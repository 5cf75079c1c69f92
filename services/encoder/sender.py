"""Sender: the encoder side of each embedding transfer.

    start()  -> EmbeddingMeta to the broker               WAITING_FOR_INPUT
    Prealloc / Resume(blocks) -> write min(remaining, allocated) tokens
                              -> TransferDone(sent, total)  TRANSFERRING
    sent == total             -> release the send buffer    SUCCESS
    Abort / PeerLost / timeout / write error -> release     FAILED

The language instances it may send to are announced by the broker
(InstanceJoined); the transport per pair is the best one both offer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.broker.client import BrokerLink, BrokerUnavailableError
from services.broker.messages import (
    Abort,
    BrokerMessage,
    EmbeddingMeta,
    InstanceJoined,
    PeerLost,
    Prealloc,
    Registration,
    Resume,
    TransferDone,
)
from services.encoder.send_buffer import Held, SendBuffer
from services.model.processor import ImageGrid
from services.transfer.state import TransferState
from services.transfer.transport import Transport, choose_transport
from services.transfer.transports.base import Part, Writer

logger = logging.getLogger(__name__)


class UnknownPeerError(LookupError):
    """The target language instance is not (or no longer) registered."""


@dataclass(slots=True)
class Outbound:
    request_id: str
    peer: Registration
    transport: Transport
    held: Held
    updated: float
    state: TransferState = TransferState.BOOTSTRAPPING
    sent_tokens: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

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
        self.peers: dict[str, Registration] = {}
        self._peer_joined = asyncio.Condition()
        self.transfers: dict[str, Outbound] = {}
        self._on_finished = on_finished

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(self.writers)

    def transport_to(self, peer: Registration) -> Transport | None:
        assert peer.pool is not None
        return choose_transport(
            self.transports, self.host_id, peer.pool.endpoints.transports, peer.host_id
        )

    async def peer(self, instance_id: str, wait_s: float = 2.0) -> Registration:
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

    def _send(self, message: EmbeddingMeta | TransferDone | Abort) -> None:
        if self.link is None:
            raise BrokerUnavailableError("this encoder has no broker")
        self.link.send(message)

    async def start(
        self, request_id: str, peer: Registration, held: Held, grids: Sequence[ImageGrid]
    ) -> None:
        transport = self.transport_to(peer)
        if transport is None:
            raise UnknownPeerError(f"no transport in common with {peer.instance_id}")
        assert peer.pool is not None
        layout = self.buffer.pool.layout
        outbound = Outbound(request_id, peer, transport, held, time.monotonic())
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
        except BrokerUnavailableError:
            await self._finish(outbound, TransferState.FAILED, "broker unavailable", notify=False)
            raise
        outbound.state = TransferState.WAITING_FOR_INPUT

    async def on_message(self, message: BrokerMessage) -> None:
        if isinstance(message, InstanceJoined):
            registration = message.instance.registration
            async with self._peer_joined:
                self.peers[registration.instance_id] = registration
                self._peer_joined.notify_all()
        elif isinstance(message, Prealloc):
            self._part(message.request_id, message.block_ids, message.allocated_tokens, 0)
        elif isinstance(message, Resume):
            self._part(
                message.request_id, message.block_ids, message.allocated_tokens, message.sent_tokens
            )
        elif isinstance(message, Abort):
            outbound = self.transfers.get(message.request_id)
            if outbound is not None:
                await self._finish(outbound, TransferState.FAILED, message.reason, notify=False)
        elif isinstance(message, PeerLost):
            await self._peer_lost(message)

    async def _peer_lost(self, message: PeerLost) -> None:
        for request_id in message.request_ids:
            outbound = self.transfers.get(request_id)
            if outbound is not None:
                reason = f"{message.instance_id} was lost"
                await self._finish(outbound, TransferState.FAILED, reason, notify=False)
        if self.peers.pop(message.instance_id, None) is not None:
            for outbound in [
                t for t in self.transfers.values() if t.peer.instance_id == message.instance_id
            ]:
                await self._finish(outbound, TransferState.FAILED, "peer left", notify=False)
            for writer in self.writers.values():
                await writer.forget(message.instance_id)

    def _part(self, request_id: str, blocks: Sequence[int], allocated: int, sent: int) -> None:
        outbound = self.transfers.get(request_id)
        if outbound is None or outbound.state is not TransferState.WAITING_FOR_INPUT:
            return  # finished or aborted meanwhile; the broker hears about it elsewhere
        if sent != outbound.sent_tokens or allocated <= 0 or not blocks:
            reason = (
                f"bad part: resume at {sent} with {allocated} tokens, {outbound.sent_tokens} sent"
            )
            self._spawn(outbound, self._finish(outbound, TransferState.FAILED, reason))
            return
        outbound.state = TransferState.TRANSFERRING
        outbound.updated = time.monotonic()
        self._spawn(outbound, self._write(outbound, list(blocks), allocated))

    @staticmethod
    def _spawn(outbound: Outbound, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        outbound.tasks.add(task)
        task.add_done_callback(outbound.tasks.discard)

    async def _write(self, outbound: Outbound, blocks: list[int], allocated: int) -> None:
        count = min(outbound.total_tokens - outbound.sent_tokens, allocated)
        part = Part(outbound.request_id, outbound.held.blocks, outbound.sent_tokens, count, blocks)
        try:
            await self.writers[outbound.transport].write(outbound.peer, self.buffer.pool, part)
        except Exception as exc:
            logger.warning(
                "%s: %s write failed: %s", outbound.request_id, outbound.transport.name, exc
            )
            await self._finish(
                outbound,
                TransferState.FAILED,
                f"{outbound.transport.name.lower()} write failed: {exc}",
            )
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
        except BrokerUnavailableError:
            await self._finish(outbound, TransferState.FAILED, "broker unavailable", notify=False)
            return
        if outbound.sent_tokens >= outbound.total_tokens:
            await self._finish(outbound, TransferState.SUCCESS, "")
        else:
            outbound.state = TransferState.WAITING_FOR_INPUT

    async def _finish(
        self, outbound: Outbound, state: TransferState, reason: str, notify: bool = True
    ) -> None:
        if self.transfers.pop(outbound.request_id, None) is None:
            return
        outbound.state = state
        self._on_finished(outbound.request_id, state)
        if state is TransferState.FAILED:
            logger.info("%s: transfer failed: %s", outbound.request_id, reason)
            if notify:
                with contextlib.suppress(BrokerUnavailableError):
                    self._send(Abort(outbound.request_id, reason))
        await self.buffer.release(outbound.request_id)

    async def abort(self, request_id: str, reason: str) -> None:
        outbound = self.transfers.get(request_id)
        if outbound is not None:
            await self._finish(outbound, TransferState.FAILED, reason)

    async def expire(self) -> None:
        """Fails transfers with no progress for timeout_s."""
        now = time.monotonic()
        for outbound in list(self.transfers.values()):
            if (
                outbound.state is TransferState.WAITING_FOR_INPUT
                and now - outbound.updated > self.timeout_s
            ):
                await self._finish(
                    outbound,
                    TransferState.FAILED,
                    f"no preallocation or resume within {self.timeout_s:.0f}s",
                )

    async def detached(self) -> None:
        """The broker stream broke: nothing in flight can complete."""
        for outbound in list(self.transfers.values()):
            await self._finish(
                outbound, TransferState.FAILED, "broker connection lost", notify=False
            )

    async def close(self) -> None:
        for outbound in list(self.transfers.values()):
            for task in list(outbound.tasks):
                task.cancel()
            await self._finish(outbound, TransferState.FAILED, "encoder shutting down")
        for writer in self.writers.values():
            await writer.close()
