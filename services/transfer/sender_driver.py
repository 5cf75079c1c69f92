"""SenderDriver: runs the Sender state machine against the real world.

It keeps the instances the broker announced (InstanceJoined) and the
transport to each, feeds the machine the broker's messages, the caller's
calls and the clock, and carries out the actions it returns: messages on the
broker stream, writes through the transport's writer (each in a task of its
own, never holding the broker's read loop), the source's blocks let go, and
each request's future resolved, so Encode (a prefill instance's Prefill)
answers once its data landed (or says why it did not).

The source is where the writes read: an encoder's send buffer, a prefill
instance's KV cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from services.broker.client import BrokerUnavailableError
from services.runtime import tracing
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.sender import (
    Action,
    Fail,
    Failure,
    Free,
    Outbound,
    Preallocated,
    Send,
    Sender,
    Succeed,
    Write,
)
from services.transfer.state import MachineDriver, TransferState, fail
from services.transfer.transports.base import Part, Writer
from services.wire.messages import (
    Abort,
    BrokerMessage,
    InstanceJoined,
    PeerLost,
    Prealloc,
    Register,
    Released,
    Resume,
    TransferDone,
    TransferMeta,
)
from services.wire.transport import TRANSFER_TIMEOUT_S, Transport, choose_transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Held:
    """A request's data in the source: its tokens from the start of these blocks."""

    request_id: str
    blocks: list[int]
    num_tokens: int


class Source(Protocol):
    """Where a sender's writes read: the pool, and each request's blocks in it."""

    @property
    def pool(self) -> EmbeddingPool: ...

    def held(self, request_id: str) -> Held: ...

    def release(self, request_id: str) -> None:
        """No write reads the request's blocks any more."""


class UnknownPeerError(LookupError):
    """The target instance is not (or no longer) registered."""


class TransferError(RuntimeError):
    def __init__(self, failure: Failure, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure


class SenderDriver(MachineDriver):
    machine: Sender

    def __init__(
        self,
        buffer: Source,
        send: Callable[[TransferMeta | TransferDone | Abort | Released], None],
        writers: Mapping[Transport, Writer],
        host_id: str,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        on_finished: Callable[[str, TransferState], None] = lambda request_id, state: None,
        on_written: Callable[[Transport, int, float], None] = lambda transport, size, took: None,
    ) -> None:
        self.buffer = buffer
        self.writers = dict(writers)
        self.host_id = host_id
        self.machine = Sender(timeout_s)
        self._to_broker = send  # BrokerUnavailableError when not attached
        self.peers: dict[str, Register] = {}
        self._peer_joined = asyncio.Condition()
        self._done: dict[str, asyncio.Future[None]] = {}
        # each transfer's first preallocation: the tokens the receiver does not want
        self._preallocated: dict[str, asyncio.Future[int]] = {}
        self._targets: dict[str, Register] = {}  # each transfer's language instance
        self._writes: dict[str, asyncio.Task[None]] = {}
        self._on_finished = on_finished
        self._on_written = on_written  # each part written: its transport, bytes, seconds
        # (language instance, transport) pairs whose memory mapping failed: not again
        self._broken: set[tuple[str, Transport]] = set()

    @property
    def transports(self) -> tuple[Transport, ...]:
        return tuple(self.writers)

    @property
    def transfers(self) -> dict[str, Outbound]:
        return self.machine.transfers

    @property
    def num_closing(self) -> int:
        """Transfers that ended with a write still in flight."""
        return len(self.machine.closing)

    def transport_to(self, peer: Register) -> Transport | None:
        assert peer.pool is not None
        ours = tuple(t for t in self.transports if (peer.instance_id, t) not in self._broken)
        return choose_transport(ours, self.host_id, peer.pool.transports, peer.host_id)

    async def peer(self, instance_id: str, wait_s: float = 2.0) -> Register:
        """The receiving instance's registration; waits briefly for a just-joined one."""
        async with self._peer_joined:
            try:
                async with asyncio.timeout(wait_s):
                    await self._peer_joined.wait_for(lambda: instance_id in self.peers)
            except TimeoutError:
                raise UnknownPeerError(
                    f"instance {instance_id!r} is not registered with the broker"
                ) from None
        return self.peers[instance_id]

    # -- the servicer's calls ----------------------------------------------------

    def start(
        self, peer: Register, meta: TransferMeta, ready_tokens: int | None = None
    ) -> asyncio.Future[None]:
        """Announces the request's data held in the source (which this transfer
        lets go), over the best transport to the peer (filled into the meta); the
        future resolves when the data landed, or fails with TransferError.
        `ready_tokens`: how much of it is there yet (default: all; `ready` says more)."""
        transport = self.transport_to(peer)
        if transport is None:
            raise UnknownPeerError(f"no transport in common with {peer.instance_id}")
        actions = self.machine.start(replace(meta, transport=transport), ready_tokens)
        loop = asyncio.get_running_loop()
        done = self._done[meta.request_id] = loop.create_future()
        self._preallocated[meta.request_id] = loop.create_future()
        self._targets[meta.request_id] = peer
        self._run(actions)
        return done

    def preallocated(self, request_id: str) -> asyncio.Future[int]:
        """A started transfer's first preallocation: how many tokens, from the
        first, the receiver does not want (its prefix cache holds their KV); fails
        with TransferError if the transfer ends before, as it starts included (its
        meta lost with the broker out of reach)."""
        heard = self._preallocated.get(request_id)
        if heard is None:
            heard = asyncio.get_running_loop().create_future()
            fail(heard, _unpreallocated())
        return heard

    def ready(self, request_id: str, tokens: int) -> None:
        """The first `tokens` of the request's data are in the source."""
        self._run(self.machine.ready(request_id, tokens))

    def abort(self, request_id: str, reason: str) -> None:
        self._run(self.machine.abort(request_id, reason))

    def withdraw(self, request_id: str, reason: str) -> None:
        """Gives up on making the rest of the data (Sender.withdraw)."""
        self._run(self.machine.withdraw(request_id, reason))

    # -- the broker's messages, time, shutdown --------------------------------------

    async def on_message(self, message: BrokerMessage) -> None:
        match message:
            case InstanceJoined(instance):
                async with self._peer_joined:
                    self.peers[instance.registration.instance_id] = instance.registration
                    self._peer_joined.notify_all()
            case Prealloc():
                self._run(self.machine.on_prealloc(message))
            case Resume():
                self._run(self.machine.on_resume(message))
            case Abort():
                self._run(self.machine.on_abort(message))
            case PeerLost(instance_id):
                if self.peers.pop(instance_id, None) is not None:
                    for writer in self.writers.values():
                        await writer.forget(instance_id)
                self._run(self.machine.on_peer_lost(message))

    async def close(self) -> None:
        for write in self._writes.values():
            write.cancel()
        self._run(self.machine.close())
        if self._writes:
            await asyncio.wait(set(self._writes.values()))
        for writer in self.writers.values():
            await writer.close()

    # -- carrying out the actions ----------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send():
                    self._send(action)
                case Write():
                    self._write(action)
                case Free(request_id):
                    self.buffer.release(request_id)
                    self._targets.pop(request_id, None)
                case Preallocated(request_id, skip_tokens):
                    heard = self._preallocated.get(request_id)
                    if heard is not None and not heard.done():
                        heard.set_result(skip_tokens)
                case Succeed(request_id):
                    self._resolve(request_id, TransferState.SUCCESS, None)
                case Fail(request_id, failure, reason):
                    logger.info("%s: transfer failed: %s", request_id, reason)
                    self._resolve(request_id, TransferState.FAILED, TransferError(failure, reason))

    def _send(self, action: Send) -> None:
        message = action.message
        try:
            self._to_broker(message)
        except BrokerUnavailableError:
            # A lost Abort or Released is harmless (the broker times the request
            # out, the quarantine expires); a lost meta or TransferDone ends it.
            if isinstance(message, TransferMeta | TransferDone):
                self._run(self.machine.broker_unavailable(message.request_id))

    def _resolve(self, request_id: str, state: TransferState, error: TransferError | None) -> None:
        heard = self._preallocated.pop(request_id, None)
        if heard is not None and not heard.done():
            fail(heard, error or _unpreallocated())
        done = self._done.pop(request_id, None)
        if done is None or done.done():
            return
        self._on_finished(request_id, state)
        if error is None:
            done.set_result(None)
        else:
            fail(done, error)

    def _write(self, action: Write) -> None:
        held, peer = self.buffer.held(action.request_id), self._targets[action.request_id]
        part = Part(action.request_id, held.blocks, action.start, action.count, action.dst_blocks)
        self._spawn(action.request_id, self._writing(action.transport, peer, part))

    async def _writing(self, transport: Transport, peer: Register, part: Part) -> None:
        size = part.count * self.buffer.pool.layout.token_bytes
        started = time.perf_counter()
        try:
            with tracing.span(
                "transfer.write",
                tracing.context_for(part.request_id),
                transport=transport.name.lower(),
                tokens=part.count,
                bytes=size,
                target=peer.instance_id,
            ):
                transport = await self._write_part(transport, peer, part)
        except Exception as exc:  # the writer's own timeout bounds it
            name = transport.name.lower()
            logger.warning("%s: %s write failed: %s", part.request_id, name, exc)
            self._run(self.machine.write_failed(part.request_id, f"{name} write failed: {exc}"))
            return
        except asyncio.CancelledError:  # shutting down
            self._run(self.machine.write_failed(part.request_id, "write cancelled"))
            raise
        self._on_written(transport, size, time.perf_counter() - started)
        self._run(self.machine.written(part.request_id))

    async def _write_part(self, transport: Transport, peer: Register, part: Part) -> Transport:
        """One write, and where the transport cannot reach the peer's memory, the
        same part again over the fallback; the transport that wrote it."""
        try:
            await self.writers[transport].write(peer, self.buffer.pool, part)
        except Exception as exc:
            fallback = self._fallback(transport, peer, exc, part.request_id)
            if fallback is None:
                raise
            self.machine.switch_transport(part.request_id, fallback)
            await self.writers[fallback].write(peer, self.buffer.pool, part)
            return fallback
        return transport

    def _fallback(
        self, transport: Transport, peer: Register, error: Exception, request_id: str
    ) -> Transport | None:
        """After a failed write into mapped memory (CUDA IPC, shm: a handle or
        segment this process cannot open, e.g. containers without a shared PID or
        IPC namespace), the part goes again over gRPC, whose receive end needs no
        announcement, and later requests to that peer take the next transport both
        sides have. A slow or dead peer (a timeout) is not a reason to switch."""
        assert peer.pool is not None
        if transport not in (Transport.CUDA_IPC, Transport.SHM) or isinstance(error, TimeoutError):
            return None
        if Transport.GRPC not in self.writers or Transport.GRPC not in peer.pool.transports:
            return None
        self._broken.add((peer.instance_id, transport))
        logger.warning(
            "%s: %s write to %s failed (%s); this part goes over grpc, later requests "
            "to it over %s",
            request_id,
            transport.name.lower(),
            peer.instance_id,
            error,
            (self.transport_to(peer) or Transport.GRPC).name.lower(),
        )
        return Transport.GRPC

    def _spawn(self, request_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._writes[request_id] = task

        def forget(finished: asyncio.Task[None]) -> None:
            if self._writes.get(request_id) is finished:
                del self._writes[request_id]

        task.add_done_callback(forget)


def _unpreallocated() -> TransferError:
    """Why a transfer's preallocation never comes: it ended first."""
    return TransferError(Failure.ABORTED, "ended unpreallocated")
