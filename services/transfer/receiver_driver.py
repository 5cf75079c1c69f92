"""ReceiverDriver: runs the Receiver state machine against the real world.

It feeds the machine the broker's messages, the caller's calls, gRPC chunks
and the clock, and carries out the actions the machine returns: messages on
the broker stream, blocks from and back to the receive pool (waiting for
them without holding the broker's read loop), parts copied out of the pool
(or, a decode instance's KV pages, kept for the request), arrivals confirmed
by the transport's receive end (NIXL: the write's notification), and each
request's future resolved.

Blocks come from a `ReceiveBlocks`: the pool's own allocator, a part at a time
(PartBlocks, embeddings); or a decode instance's KV cache, whose pages its
engine hands out, all of a part or none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import torch

from services.broker.client import BrokerUnavailableError
from services.runtime import tracing
from services.transfer.block_pool import BlockPool
from services.transfer.embedding_pool import EmbeddingPool, tensor_from_bytes
from services.transfer.receiver import (
    DEFAULT_ALLOCATE_TOKENS,
    Action,
    Allocate,
    Confirm,
    Fail,
    Forget,
    ForgetSender,
    Free,
    Inbound,
    Keep,
    Quarantined,
    Receiver,
    Send,
    Stage,
    Succeed,
)
from services.transfer.state import (
    MachineDriver,
    PoolExhaustedError,
    TransferFailedError,
    TransferState,
    fail,
)
from services.transfer.transports.base import ReceiveEnd
from services.wire.messages import (
    Abort,
    BrokerMessage,
    EmbeddingMeta,
    KvMeta,
    PeerLost,
    Prealloc,
    Released,
    Resume,
    TransferDone,
    TransferMeta,
)
from services.wire.transport import TRANSFER_TIMEOUT_S, Transport

Planes = list[torch.Tensor]  # a request's tokens, [tokens, width] per plane of the pool


class ReceiveBlocks(Protocol):
    @property
    def keeps_blocks(self) -> bool:
        """A request keeps its blocks once its data arrived (KV pages) instead of
        having each part copied out and its blocks freed (embeddings)."""

    async def allocate(self, num_tokens: int, wait_s: float) -> list[int]:
        """Blocks for a part of up to num_tokens; PoolExhaustedError after wait_s."""

    def free(self, blocks: list[int]) -> None: ...


class PartBlocks:
    """A part at a time from the pool's own allocator: what is free, up to the rest."""

    keeps_blocks = False

    def __init__(self, pool: EmbeddingPool) -> None:
        self.blocks = BlockPool(pool.allocator)

    async def allocate(self, num_tokens: int, wait_s: float) -> list[int]:
        return await self.blocks.allocate_up_to(num_tokens, wait_s)

    def free(self, blocks: list[int]) -> None:
        self.blocks.free(blocks)


class ReceiverDriver(MachineDriver):
    machine: Receiver

    def __init__(
        self,
        pool: EmbeddingPool,
        send: Callable[[Prealloc | Resume | Abort], None],
        ends: Mapping[Transport, ReceiveEnd],
        default_allocate_tokens: int = DEFAULT_ALLOCATE_TOKENS,
        timeout_s: float = TRANSFER_TIMEOUT_S,
        on_finished: Callable[[TransferState], None] = lambda state: None,
        pool_wait_s: float = 5.0,
        quarantine_s: float = 15.0,
        blocks: ReceiveBlocks | None = None,
    ) -> None:
        self.pool = pool
        self.blocks = blocks if blocks is not None else PartBlocks(pool)
        self.machine = Receiver(
            pool.layout,
            default_allocate_tokens,
            timeout_s,
            quarantine_s,
            polled=frozenset(t for t, end in ends.items() if end.polled),
            keeps_blocks=self.blocks.keeps_blocks,
        )
        self.timeout_s = timeout_s
        self.pool_wait_s = pool_wait_s
        self.ends = dict(ends)
        self._to_broker = send  # BrokerUnavailableError when not attached
        self._on_finished = on_finished
        self._done: dict[str, asyncio.Future[TransferMeta]] = {}
        self._staged: dict[str, list[Planes]] = {}
        # requests whose parts the caller takes as they arrive (`parts`), and each
        # part staged for it (None: the transfer ended)
        self._watched: dict[str, asyncio.Queue[Planes | None]] = {}
        # blocks staged out of a GPU pool, and the event of their copy (EmbeddingPool.stage)
        self._copying: dict[tuple[int, ...], torch.cuda.Event] = {}
        self._kept: dict[str, list[int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def transfers(self) -> dict[str, Inbound]:
        return self.machine.transfers

    @property
    def quarantine(self) -> dict[str, Quarantined]:
        return self.machine.quarantine

    @property
    def num_quarantined_blocks(self) -> int:
        return self.machine.num_quarantined_blocks

    @property
    def polling(self) -> set[str]:
        """Requests whose data comes over a polled transport (which polls fast meanwhile)."""
        return self.machine.polling

    # -- the servicer's calls ----------------------------------------------------

    async def expect(self, request_id: str, hint_tokens: int, skip_tokens: int = 0) -> None:
        """Preallocates for a request whose embeddings an encoder will send, all
        but the first `skip_tokens` (Receiver.expect); PoolExhaustedError if no
        blocks come free within pool_wait_s."""
        actions = self.machine.expect(request_id, hint_tokens, skip_tokens)
        done = self._done[request_id] = asyncio.get_running_loop().create_future()
        for action in actions:
            if isinstance(action, Allocate):
                await self._allocate(action)
            else:
                self._run([action])
        if done.done() and done.exception() is not None:
            raise done.exception()  # type: ignore[misc]

    async def wait(self, request_id: str) -> TransferMeta:
        """The metadata, once every token has arrived; TransferFailedError otherwise."""
        done = self._done.get(request_id)
        if done is None:
            raise TransferFailedError(f"request {request_id!r} is not receiving")
        return await asyncio.shield(done)

    async def take(self, request_id: str) -> dict[str, torch.Tensor]:
        """A finished request's tokens per plane, by the plane's name (the
        embeddings; with deepstack, its features), copied out of the pool; its
        blocks are free again when this returns."""
        self._watched.pop(request_id, None)
        self._run(self.machine.take(request_id))
        self._done.pop(request_id, None)
        parts = self._staged.pop(request_id, [])
        if not parts:  # every token was skipped
            layout = self.pool.layout.planes
            planes = [
                t.new_empty((0, p.width)) for t, p in zip(self.pool.tensors, layout, strict=True)
            ]
        elif len(parts) == 1:  # already a copy: no second one
            planes = parts[0]
        else:
            planes = [torch.cat(p) for p in zip(*parts, strict=True)]
        return self._named(planes)

    async def parts(
        self, request_id: str
    ) -> AsyncIterator[tuple[TransferMeta, dict[str, torch.Tensor]]]:
        """A request's tokens as they arrive, a part at a time in token order, as
        `take` gives them (each part's blocks are free again once it is out), with
        the transfer's metadata; the last part once every token is here.
        TransferFailedError when the transfer fails."""
        if request_id not in self._done:
            raise TransferFailedError(f"request {request_id!r} is not receiving")
        arrivals = self._watched[request_id] = asyncio.Queue()
        for part in self._staged.pop(request_id, []):
            arrivals.put_nowait(part)
        try:
            while True:
                arrived = await arrivals.get()
                if arrived is None:
                    break
                meta = self.transfers[request_id].meta
                assert meta is not None
                yield meta, self._named(arrived)
            meta = await self.wait(request_id)
            yield meta, await self.take(request_id)
        finally:
            self._watched.pop(request_id, None)

    def _named(self, planes: Planes) -> dict[str, torch.Tensor]:
        return {
            plane.name: tensor
            for plane, tensor in zip(self.pool.layout.planes, planes, strict=True)
        }

    def take_blocks(self, request_id: str) -> list[int]:
        """A finished request's blocks (keeps_blocks), in token order: the
        caller's to free from now on."""
        self._run(self.machine.take(request_id))
        self._done.pop(request_id, None)
        return self._kept.pop(request_id)

    def release(self, request_id: str, reason: str) -> None:
        """Ends a request's transfer, whatever its state; its blocks go back (or
        into quarantine while its encoder may still write them)."""
        self._run(self.machine.release(request_id, reason))
        self._done.pop(request_id, None)

    def write_chunk(
        self,
        request_id: str,
        start_token: int,
        num_tokens: int,
        planes: Sequence[bytes | memoryview],
        encoder_id: str,
    ) -> None:
        """gRPC data plane: a run of tokens of the current part, per plane."""
        blocks, offset = self.machine.chunk_target(request_id, start_token, num_tokens, encoder_id)
        layout = self.pool.layout
        if len(planes) != len(layout.planes):
            raise ValueError(
                f"chunk carries {len(planes)} planes; the pool holds {layout.describe()}"
            )
        values = [
            tensor_from_bytes(data, layout.dtype, plane.width)
            for data, plane in zip(planes, layout.planes, strict=True)
        ]
        for value in values:
            if value.shape[0] != num_tokens:
                raise ValueError(f"chunk carries {value.shape[0]} tokens, says {num_tokens}")
        self.pool.write(blocks, offset, values)
        self.machine.chunk_written(request_id, num_tokens)

    # -- the broker's messages, time, shutdown --------------------------------------

    async def on_message(self, message: BrokerMessage) -> None:
        match message:
            case EmbeddingMeta(request_id) | KvMeta(request_id):
                self._run(self.machine.on_meta(message))
                end = self.ends.get(message.transport)
                if end is not None and request_id in self.machine.transfers:
                    end.announced(request_id)
            case TransferDone():
                self._run(self.machine.on_done(message))
            case Abort():
                self._run(self.machine.on_abort(message))
            case Released():
                self._run(self.machine.on_released(message))
            case PeerLost():
                self._run(self.machine.on_peer_lost(message))

    async def close(self) -> None:
        self._run(self.machine.close())
        for task in list(self._tasks):
            task.cancel()

    # -- carrying out the actions ----------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send():
                    self._send(action)
                case Allocate():
                    self._spawn(self._allocate(action))
                case Free(blocks):
                    copying = self._copying.pop(blocks, None)
                    if copying is None:
                        self.blocks.free(list(blocks))
                    else:
                        self._spawn(self._free_once_copied(blocks, copying))
                case Stage(request_id, blocks, num_tokens):
                    parent = tracing.context_for(request_id)
                    with tracing.span("transfer.stage", parent, tokens=num_tokens):
                        part, copying = self.pool.stage(list(blocks), 0, num_tokens)
                    if request_id in self._watched:
                        self._watched[request_id].put_nowait(part)
                    else:
                        self._staged.setdefault(request_id, []).append(part)
                    if copying is not None:  # the Free that follows waits for it
                        self._copying[blocks] = copying
                case Keep(request_id, blocks):
                    self._kept[request_id] = list(blocks)
                case Confirm(request_id, transport, _, sent_tokens):
                    end = self.ends.get(transport)
                    if end is not None and not end.polled:  # in the pool before TransferDone
                        self._run(self.machine.arrived(request_id, sent_tokens))
                    else:
                        self._spawn(self._confirm(action))
                case Succeed(request_id, meta):
                    self._on_finished(TransferState.SUCCESS)
                    self._resolve(request_id, meta)
                case Fail(request_id, error):
                    self._on_finished(TransferState.FAILED)
                    self._resolve(request_id, error)
                case Forget(request_id):
                    self._staged.pop(request_id, None)
                    for end in self.ends.values():
                        end.forget(request_id)
                case ForgetSender(request_id):
                    for end in self.ends.values():
                        end.forget(request_id)

    def _send(self, action: Send) -> None:
        try:
            self._to_broker(action.message)
        except BrokerUnavailableError:
            if not isinstance(action.message, Abort):  # a Prealloc or Resume is lost
                self._run(self.machine.broker_unavailable(action.message.request_id))

    def _resolve(self, request_id: str, outcome: TransferMeta | TransferFailedError) -> None:
        if request_id in self._watched:
            self._watched[request_id].put_nowait(None)
        done = self._done.get(request_id)
        if done is None or done.done():
            return
        if isinstance(outcome, TransferFailedError):
            fail(done, outcome)
        else:
            done.set_result(outcome)

    async def _allocate(self, action: Allocate) -> None:
        try:
            blocks = await self.blocks.allocate(action.num_tokens, self.pool_wait_s)
        except PoolExhaustedError:
            kind = "KV pages" if self.blocks.keeps_blocks else "embedding blocks"
            reason = f"no free {kind} within {self.pool_wait_s:g}s"
            self._run(self.machine.allocation_failed(action.request_id, reason))
            return
        self._run(self.machine.allocated(action.request_id, blocks))

    async def _confirm(self, action: Confirm) -> None:
        end = self.ends.get(action.transport)
        try:
            if end is None:
                name = action.transport.name.lower()
                raise TransferFailedError(f"sent over {name}, which this instance does not offer")
            await end.confirm(
                action.request_id, action.encoder_id, action.sent_tokens, self.timeout_s
            )
        except (TimeoutError, RuntimeError) as exc:  # TransferFailedError included
            self._run(self.machine.arrival_failed(action.request_id, str(exc)))
            return
        self._run(self.machine.arrived(action.request_id, action.sent_tokens))

    async def _free_once_copied(self, blocks: tuple[int, ...], copying: torch.cuda.Event) -> None:
        """Frees blocks staged out of a GPU pool once the copy has run: it waits on a
        worker thread, not the event loop (the copy may queue behind an engine step)."""
        await asyncio.to_thread(copying.synchronize)
        self.blocks.free(list(blocks))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
