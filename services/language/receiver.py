"""Receiver: the language side of each embedding transfer.

    expect(hint)  -> allocate blocks for hint (or default) tokens, Prealloc     WAITING_FOR_INPUT
    EmbeddingMeta -> remember the grids and the total
    TransferDone(sent < total) -> stage what arrived, free its blocks,
                                  allocate for the rest, Resume(sent)          TRANSFERRING
    TransferDone(sent == total) -> SUCCESS: wait() returns the metadata
    take()        -> the embeddings copied out (staged parts + the last part's blocks);
                     the blocks are free again before prefill even starts
    PeerLost      -> its encoder is gone before anything landed: forget its meta and
                     wait, with the same blocks, for the encoder the gateway moves it to
    Abort / timeout / release() -> FAILED

A request only ever holds one part's blocks, so a small pool slows large
requests down (more resumes) but never deadlocks them. Allocation waits when
the pool is full, up to `pool_wait_s`.

Blocks of a request that ends while an encoder may still be writing them
(it was given them, and its last TransferDone has not come) are quarantined:
they return to the pool when the encoder says Released, when the encoder is
lost, or after `quarantine_s`, never while a write can still land.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from services.broker.client import BrokerLink, BrokerUnavailableError
from services.transfer.embedding_pool import EmbeddingPool, tensor_from_bytes
from services.transfer.state import PoolExhaustedError, TransferFailedError, TransferState
from services.transfer.transports.nixl import NixlReceiver, notification
from services.wire.messages import (
    Abort,
    BrokerMessage,
    EmbeddingMeta,
    PeerLost,
    Prealloc,
    Released,
    Resume,
    TransferDone,
)
from services.wire.transport import Transport

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Inbound:
    request_id: str
    updated: float
    done: asyncio.Future[EmbeddingMeta]
    state: TransferState = TransferState.BOOTSTRAPPING
    blocks: list[int] = field(default_factory=list)  # the current part's
    part_start: int = 0  # tokens that arrived before the current part
    allocated_tokens: int = 0
    received_in_part: int = 0  # gRPC chunks written into the current part
    meta: EmbeddingMeta | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    num_parts: int = 0
    num_failovers: int = 0

    @property
    def part_tokens(self) -> int:
        """Tokens the current part carries."""
        assert self.meta is not None
        return min(self.meta.total_tokens - self.part_start, self.allocated_tokens)


@dataclass(slots=True)
class Quarantined:
    """Blocks an encoder may still write into, kept out of the pool."""

    blocks: list[int]
    encoder_id: str  # "" when the request ended before its meta named the encoder
    until: float


class Receiver:
    def __init__(
        self,
        pool: EmbeddingPool,
        default_allocate_tokens: int = 4096,
        timeout_s: float = 30.0,
        nixl: NixlReceiver | None = None,
        on_finished: Callable[[TransferState], None] = lambda state: None,
        pool_wait_s: float = 5.0,
        quarantine_s: float = 15.0,
    ) -> None:
        self.pool = pool
        self.default_allocate_tokens = default_allocate_tokens
        self.timeout_s = timeout_s
        self.pool_wait_s = pool_wait_s
        self.quarantine_s = quarantine_s
        self.nixl = nixl
        self.link: BrokerLink | None = None
        self.transfers: dict[str, Inbound] = {}
        self.quarantine: dict[str, Quarantined] = {}
        # Requests whose data comes over NIXL: read by the NIXL progress thread
        # (len() only: never iterated there) to poll fast while it is not empty.
        self.nixl_pending: set[str] = set()
        self._freed = asyncio.Condition()
        self._on_finished = on_finished
        self._tasks: set[asyncio.Task[None]] = set()

    def _send(self, message: Prealloc | Resume | Abort) -> None:
        if self.link is None:
            raise BrokerUnavailableError("this language instance has no broker")
        self.link.send(message)

    async def _allocate(self, want_tokens: int) -> list[int]:
        """Blocks for up to want_tokens (fewer if the pool is tight; at least one block)."""
        allocator = self.pool.allocator
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: allocator.num_free_blocks > 0), self.pool_wait_s
                )
            except TimeoutError:
                raise PoolExhaustedError(
                    f"no free embedding blocks within {self.pool_wait_s:g}s"
                ) from None
            tokens = min(want_tokens, allocator.num_free_blocks * allocator.block_size)
            blocks = allocator.allocate(tokens)
        assert blocks is not None
        return blocks

    async def _free(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self.pool.allocator.free(blocks)
        async with self._freed:
            self._freed.notify_all()

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(q.blocks) for q in self.quarantine.values())

    async def expect(self, request_id: str, hint_tokens: int) -> None:
        """Preallocates for a request whose embeddings an encoder will send."""
        if request_id in self.transfers:
            raise ValueError(f"request {request_id!r} is already receiving")
        want = hint_tokens if hint_tokens > 0 else self.default_allocate_tokens
        inbound = Inbound(request_id, time.monotonic(), asyncio.get_running_loop().create_future())
        self.transfers[request_id] = inbound
        try:
            blocks = await self._allocate(want)
            if self.transfers.get(request_id) is not inbound:  # released while waiting
                await self._free(blocks)
                raise TransferFailedError(f"request {request_id!r} ended while preallocating")
            inbound.blocks = blocks
            inbound.allocated_tokens = len(inbound.blocks) * self.pool.layout.block_size
            self._send(Prealloc(request_id, tuple(inbound.blocks), inbound.allocated_tokens))
        except BaseException:
            await self.release(request_id, "preallocation failed", notify=False)
            raise
        inbound.state = TransferState.WAITING_FOR_INPUT
        inbound.updated = time.monotonic()

    async def wait(self, request_id: str) -> EmbeddingMeta:
        """The metadata, once every token has arrived; TransferFailedError otherwise."""
        inbound = self.transfers.get(request_id)
        if inbound is None:
            raise TransferFailedError(f"request {request_id!r} is not receiving")
        return await asyncio.shield(inbound.done)

    async def take(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A finished request's embeddings [total, hidden] (and deepstack), copied out of
        the pool; its blocks are free again when this returns."""
        inbound = self.transfers.pop(request_id)
        assert inbound.state is TransferState.SUCCESS and inbound.meta is not None
        last = self.pool.read(inbound.blocks, 0, inbound.meta.total_tokens - inbound.part_start)
        await self._free(inbound.blocks)
        if not inbound.staged:  # one part, already a copy: no second one
            return last
        parts = [*inbound.staged, last]
        embeddings = torch.cat([p[0] for p in parts])
        deepstack = None
        if last[1] is not None:
            deepstack = torch.cat([p[1] for p in parts if p[1] is not None])
        return embeddings, deepstack

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def release(self, request_id: str, reason: str, notify: bool = True) -> None:
        """Ends a request's transfer, whatever its state; frees its blocks."""
        inbound = self.transfers.pop(request_id, None)
        if inbound is None:
            return
        if not inbound.state.is_finished:
            self._on_finished(TransferState.FAILED)
            if notify and inbound.state is not TransferState.BOOTSTRAPPING:
                with contextlib.suppress(BrokerUnavailableError):
                    self._send(Abort(request_id, reason))
        writable = inbound.state in (TransferState.WAITING_FOR_INPUT, TransferState.TRANSFERRING)
        inbound.state = TransferState.FAILED
        if not inbound.done.done():
            inbound.done.set_exception(TransferFailedError(reason))
            inbound.done.exception()  # consumed here if nobody waits
        inbound.staged.clear()
        self.nixl_pending.discard(request_id)
        if self.nixl is not None:
            self.nixl.forget(request_id)
        blocks, inbound.blocks = inbound.blocks, []
        if writable and blocks:  # an encoder was given them: a write may still land
            encoder = inbound.meta.encoder_instance_id if inbound.meta is not None else ""
            held = self.quarantine.setdefault(
                request_id, Quarantined([], encoder, time.monotonic() + self.quarantine_s)
            )
            held.blocks += blocks
            return
        await self._free(blocks)

    async def _unquarantine(self, request_id: str) -> None:
        held = self.quarantine.pop(request_id, None)
        if held is not None:
            await self._free(held.blocks)

    async def _rewind(self, request_id: str, encoder_id: str) -> None:
        """The request's encoder is gone and nothing of it had landed: forget that
        encoder's meta, keep the blocks, wait for the next encoder's."""
        inbound = self.transfers.get(request_id)
        if inbound is None or inbound.state.is_finished:
            return
        if inbound.num_parts or inbound.staged:
            await self.release(request_id, f"encoder {encoder_id} was lost mid-transfer")
            return
        inbound.meta = None
        inbound.received_in_part = 0
        inbound.num_failovers += 1
        inbound.state = TransferState.WAITING_FOR_INPUT
        inbound.updated = time.monotonic()
        self.nixl_pending.discard(request_id)
        if self.nixl is not None:
            self.nixl.forget(request_id)

    def write_chunk(
        self,
        request_id: str,
        start_token: int,
        num_tokens: int,
        embeddings: bytes,
        deepstack: bytes,
        encoder_id: str,
    ) -> None:
        """gRPC data plane: a run of tokens of the current part."""
        inbound = self.transfers.get(request_id)
        if inbound is None or inbound.state.is_finished:
            raise TransferFailedError(f"request {request_id!r} is not receiving")
        if inbound.meta is not None and inbound.meta.encoder_instance_id != encoder_id:
            raise TransferFailedError(
                f"request {request_id!r} is sent by {inbound.meta.encoder_instance_id}, "
                f"not {encoder_id}"
            )
        layout = self.pool.layout
        offset = start_token - inbound.part_start
        if offset < 0 or offset + num_tokens > inbound.allocated_tokens:
            raise ValueError(
                f"tokens [{start_token}, {start_token + num_tokens}) are outside the current part "
                f"[{inbound.part_start}, {inbound.part_start + inbound.allocated_tokens})"
            )
        values = tensor_from_bytes(embeddings, layout.dtype, layout.hidden_size)
        deep = (
            tensor_from_bytes(deepstack, layout.dtype, layout.deepstack_width)
            if layout.deepstack_levels
            else None
        )
        if values.shape[0] != num_tokens or (deep is not None and deep.shape[0] != num_tokens):
            raise ValueError(f"chunk carries {values.shape[0]} tokens, says {num_tokens}")
        self.pool.write(inbound.blocks, offset, values, deep)
        inbound.received_in_part += num_tokens
        inbound.state = TransferState.TRANSFERRING
        inbound.updated = time.monotonic()

    async def on_message(self, message: BrokerMessage) -> None:
        if isinstance(message, EmbeddingMeta):
            await self._on_meta(message)
        elif isinstance(message, TransferDone):
            inbound = self.transfers.get(message.request_id)
            if inbound is not None:
                # Completing a part may wait for blocks: never inside the broker's read loop.
                self._spawn(self._on_done(inbound, message))
        elif isinstance(message, Abort):
            await self.release(message.request_id, message.reason, notify=False)
        elif isinstance(message, Released):
            await self._unquarantine(message.request_id)
        elif isinstance(message, PeerLost):
            for request_id in message.request_ids:
                await self._rewind(request_id, message.instance_id)
            for request_id, held in list(self.quarantine.items()):
                if held.encoder_id == message.instance_id:
                    await self._unquarantine(request_id)

    async def _on_meta(self, meta: EmbeddingMeta) -> None:
        inbound = self.transfers.get(meta.request_id)
        if inbound is None:
            with contextlib.suppress(BrokerUnavailableError):
                self._send(
                    Abort(meta.request_id, "the language instance does not know this request")
                )
            return
        layout = self.pool.layout
        problem = ""
        if (meta.hidden_size, meta.deepstack_levels, meta.dtype) != (
            layout.hidden_size,
            layout.deepstack_levels,
            layout.dtype,
        ):
            problem = (
                f"embeddings {meta.hidden_size} x {meta.dtype} (deepstack {meta.deepstack_levels}) "
                f"do not match the pool {layout.hidden_size} x {layout.dtype}"
            )
        elif meta.total_tokens <= 0:
            problem = "metadata announces no tokens"
        if problem:
            await self.release(meta.request_id, problem)
            return
        inbound.meta = meta
        inbound.updated = time.monotonic()
        if meta.transport is Transport.NIXL and self.nixl is not None:
            self.nixl_pending.add(meta.request_id)
            self.nixl.wake()

    async def _on_done(self, inbound: Inbound, done: TransferDone) -> None:
        request_id = inbound.request_id
        if inbound.meta is None or inbound.state.is_finished:
            await self.release(request_id, "transfer finished before its metadata arrived")
            return
        expected = inbound.part_start + inbound.part_tokens
        if done.sent_tokens != expected or done.total_tokens != inbound.meta.total_tokens:
            await self.release(
                request_id,
                f"part ends at {done.sent_tokens}/{done.total_tokens}, expected {expected}",
            )
            return
        try:
            if done.transport is Transport.GRPC and inbound.received_in_part != inbound.part_tokens:
                raise TransferFailedError(
                    f"{inbound.received_in_part} of {inbound.part_tokens} tokens arrived over gRPC"
                )
            if done.transport is Transport.NIXL:
                if self.nixl is None:
                    raise TransferFailedError("NIXL transfer, but this instance has no NIXL agent")
                await self.nixl.wait_notification(
                    notification(request_id, inbound.meta.encoder_instance_id, done.sent_tokens),
                    self.timeout_s,
                )
        except (TransferFailedError, TimeoutError) as exc:
            await self.release(request_id, str(exc))
            return
        inbound.num_parts += 1
        inbound.updated = time.monotonic()
        if done.is_last:
            self.nixl_pending.discard(request_id)
            inbound.state = TransferState.SUCCESS
            self._on_finished(TransferState.SUCCESS)
            inbound.done.set_result(inbound.meta)
            return
        await self._resume(inbound, done.sent_tokens)

    async def _resume(self, inbound: Inbound, sent: int) -> None:
        assert inbound.meta is not None
        count = inbound.part_tokens
        inbound.staged.append(self.pool.read(inbound.blocks, 0, count))
        await self._free(inbound.blocks)
        inbound.blocks = []
        try:
            blocks = await self._allocate(inbound.meta.total_tokens - sent)
        except TransferFailedError as exc:
            await self.release(inbound.request_id, str(exc))
            return
        if inbound.request_id not in self.transfers:  # released while waiting for blocks
            await self._free(blocks)
            return
        inbound.blocks = blocks
        inbound.part_start = sent
        inbound.allocated_tokens = len(blocks) * self.pool.layout.block_size
        inbound.received_in_part = 0
        inbound.state = TransferState.WAITING_FOR_INPUT
        try:
            self._send(Resume(inbound.request_id, tuple(blocks), sent, inbound.allocated_tokens))
        except BrokerUnavailableError:
            await self.release(inbound.request_id, "broker unavailable", notify=False)

    async def expire(self) -> None:
        now = time.monotonic()
        for request_id, held in list(self.quarantine.items()):
            if now > held.until:
                await self._unquarantine(request_id)
        for inbound in list(self.transfers.values()):
            if not inbound.state.is_finished and now - inbound.updated > self.timeout_s:
                await self.release(
                    inbound.request_id,
                    f"embeddings did not arrive within {self.timeout_s:.0f}s "
                    f"({inbound.state.name.lower()})",
                )

    async def detached(self) -> None:
        for inbound in list(self.transfers.values()):
            if not inbound.state.is_finished:
                await self.release(inbound.request_id, "broker connection lost", notify=False)

    async def close(self) -> None:
        for request_id in list(self.transfers):
            await self.release(request_id, "language instance shutting down")
        for request_id in list(self.quarantine):
            await self._unquarantine(request_id)
        for task in list(self._tasks):
            task.cancel()
