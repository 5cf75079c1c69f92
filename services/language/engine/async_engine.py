"""AsyncEngine: runs LLMEngine's loop on its own thread for asyncio callers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import torch

from services.language.engine import loop
from services.language.engine.engine import LLMEngine
from services.language.engine.interface import EngineHost, OutputQueue
from services.language.engine.kv_cache import PrefixPages
from services.language.engine.loop import AbortRequest, AddMedia, AddRequest, Encoding, Reply
from services.language.engine.outputs import RequestOutput, StepStats
from services.language.engine.request import Request
from services.transfer.state import PoolExhaustedError
from services.wire.messages import FirstToken

logger = logging.getLogger(__name__)


def _give(future: asyncio.Future[list[int]], pages: list[int]) -> None:
    if not future.done():  # else the caller gave up, and its _Unreserve frees them
        future.set_result(pages)


# What else the thread's inbox takes (interface.py has the messages both hosts take)


@dataclass(frozen=True, slots=True)
class _AddPrefilled:
    request: Request
    firsts: tuple[FirstToken, ...]


@dataclass(frozen=True, slots=True)
class _Release:
    request_id: str


@dataclass(slots=True)
class _Reservation:
    """KV pages for num_tokens, for a decode instance's incoming transfer: given
    (pages) by the engine thread when free, or given up by the caller (gone)."""

    num_tokens: int
    future: asyncio.Future[list[int]]
    pages: list[int] | None = None
    gone: bool = False


@dataclass(frozen=True, slots=True)
class _Reserve:
    reservation: _Reservation


@dataclass(frozen=True, slots=True)
class _Unreserve:
    reservation: _Reservation


@dataclass(frozen=True, slots=True)
class _FreePages:
    pages: tuple[int, ...]


_Message = (
    AddRequest
    | AddMedia
    | _AddPrefilled
    | AbortRequest
    | Encoding
    | _Release
    | _Reserve
    | _Unreserve
    | _FreePages
)


class AsyncEngine(EngineHost):
    """Runs LLMEngine.step() on a dedicated thread for asyncio callers.

    The engine belongs to that thread: callers add and abort requests through
    a thread-safe inbox, get outputs on per-request asyncio queues, and read
    its load from the snapshot the thread publishes. What they may call from
    the event loop: the checks (they read the immutable config), grammar
    compilation (on its own thread), `generate`, `abort`, `has_request`,
    `num_requests` and `load`. `engine` is there for tests, once it is idle.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[StepStats, float], None] = lambda stats, seconds: None,
    ) -> None:
        super().__init__(engine.config, engine.spec, engine.grammars)
        self.engine = engine
        self._on_step = on_step
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._reservations: list[_Reservation] = []  # waiting for free pages, in order
        self._wake = threading.Event()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.load = engine.load()

    @property
    def num_kv_pages(self) -> int:
        return self.engine.blocks.allocator.num_blocks

    def start(self) -> None:
        """Warms the engine up, then starts its loop: whoever serves it says
        serving only after this."""
        self.engine.warm_up()
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=loop.run, args=(self.engine, self), name="engine", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def _deliver(self, items: list[Reply]) -> None:
        for request_id, item in items:
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(item)

    # -- the loop's Host: on the engine thread --------------------------------------

    def receive(self, timeout: float | None) -> list[object] | None:
        if timeout != 0:
            self._wake.wait(timeout)
            self._wake.clear()
        if self._stopping:
            return None
        messages: list[object] = []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self._inbox.get_nowait())
        return messages

    def apply(self, message: object) -> list[Reply]:
        match message:
            case _AddPrefilled(request, firsts):
                try:
                    return loop.replies(self.engine.add_prefilled(request, firsts))
                except ValueError as exc:
                    return [(request.request_id, exc)]
            case _Release(request_id):
                self.engine.release(request_id)
            case _Reserve(reservation):
                self._reservations.append(reservation)
            case _Unreserve(reservation):
                reservation.gone = True
                if reservation.pages is not None:  # given as the caller gave up
                    self.engine.blocks.allocator.free(reservation.pages)
            case _FreePages(pages):
                self.engine.blocks.allocator.free(list(pages))
            case _:
                return loop.apply(self.engine, message)
        return []

    def publish(self, replies: list[Reply], step: tuple[StepStats, float] | None) -> None:
        """Pages to the reservations they free, then the replies to the event loop
        in one wake-up (one per step, not per request)."""
        self._reserve()
        self.load = self.engine.load()
        assert self._event_loop is not None
        if replies:
            self._event_loop.call_soon_threadsafe(self._deliver, replies)
        if step is not None:
            self._on_step(*step)

    async def generate(
        self, request: Request, firsts: Sequence[FirstToken] = ()
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request, its choices interleaved, until every choice
        finishes (or, hold_kv, is prefilled: then `release` its pages); leaving
        early aborts it. With `firsts`, a request another instance prefilled
        (LLMEngine.add_prefilled), whose pages are freed if it is refused."""
        try:
            self.check(request)
        except ValueError:
            if firsts:
                self.free_pages(request.block_table)
            raise
        q: OutputQueue = asyncio.Queue()
        self._queues[request.request_id] = q
        self._inbox.put(_AddPrefilled(request, tuple(firsts)) if firsts else AddRequest(request))
        self._wake.set()
        async with contextlib.aclosing(self._outputs(request, q)) as outputs:
            async for output in outputs:
                yield output

    def _reserve(self) -> None:
        """Gives free pages to the reservations at the head of the line."""
        while self._reservations:
            reservation = self._reservations[0]
            if reservation.gone:
                self._reservations.pop(0)
                continue
            blocks = self.engine.blocks
            pages = blocks.allocate_pages(blocks.allocator.blocks_for(reservation.num_tokens))
            if pages is None:
                return
            self._reservations.pop(0)
            reservation.pages = pages
            assert self._event_loop is not None
            self._event_loop.call_soon_threadsafe(_give, reservation.future, pages)

    async def reserve_pages(self, num_tokens: int, wait_s: float) -> list[int]:
        """KV pages for num_tokens, out of any request's hands (a decode instance
        receives a request's KV into them); PoolExhaustedError if they are not
        free within wait_s. Give them back with `free_pages`, or as a request's
        block table."""
        if self.engine.blocks.allocator.blocks_for(num_tokens) > self.num_kv_pages:
            raise PoolExhaustedError(f"{num_tokens} tokens exceed the whole KV cache")
        reservation = _Reservation(num_tokens, asyncio.get_running_loop().create_future())
        self._inbox.put(_Reserve(reservation))
        self._wake.set()
        try:
            async with asyncio.timeout(wait_s):  # not wait_for: on 3.11 it can swallow a cancel
                return await asyncio.shield(reservation.future)
        except BaseException as exc:
            self._inbox.put(_Unreserve(reservation))  # frees them if they came meanwhile
            self._wake.set()
            if isinstance(exc, TimeoutError):
                raise PoolExhaustedError(
                    f"no KV pages for {num_tokens} tokens within {wait_s:g}s"
                ) from None
            raise

    def free_pages(self, pages: list[int]) -> None:
        if pages:
            self._inbox.put(_FreePages(tuple(pages)))
            self._wake.set()

    def add_media(
        self, request_id: str, start: int, embeds: torch.Tensor, deepstack: torch.Tensor | None
    ) -> None:
        self._inbox.put(AddMedia(request_id, start, embeds, deepstack))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))
        self._wake.set()

    def set_encoding(self, since: float | None, wait_s: float) -> None:
        self._inbox.put(Encoding(since, wait_s))
        self._wake.set()

    async def export_prefix(
        self, digests: Sequence[bytes], min_pages: int, timeout_s: float, with_planes: bool = True
    ) -> PrefixPages:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(
                self.engine.export_prefix, digests, min_pages, with_planes
            )

    def release(self, request_id: str) -> None:
        """Frees the pages a prefilled (hold_kv) request kept."""
        self._inbox.put(_Release(request_id))
        self._wake.set()
