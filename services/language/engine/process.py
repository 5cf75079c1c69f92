"""EngineProcess: the engine loop in a process of its own, for asyncio callers.

In one process, the engine thread releases and takes back the GIL around
every torch op and kernel call, and the threads that stream each token (the
event loop, gRPC's poller) take it in between (py-spy: 39 % of the forward's
samples waiting for the GIL). In a child of its own the decode steps of the
small demo's text workload are ~10 % shorter (docs/performance.md's history has the rest
of what the stack costs the engine). As vLLM V1 runs its EngineCore, the child
owns the LLMEngine (weights, KV
cache, scheduler, sampler, detokenizers) and the parent keeps everything else
(gRPC, rendering, receiving embeddings). They talk over a pipe:

    parent: event loop                               child: engine loop
      generate(request) ── AddRequest(request) ──────▶ add_request
      abort(request_id) ── AbortRequest(request_id) ─▶ abort_request
      its request's queue ◀── _Outputs (one a step) ── step()
      export_prefix ── _ExportPrefix ──────────────▶ the pipe reader, beside step()

Besides the loop, the child has one thread: its pipe's reader, which queues the
messages for the loop and answers an export itself (another instance's fetch of
a chat's KV pages need not wait for a step of a second). It ends with its pipe:
when the parent stops it, closes it, or dies (then the kernel also kills it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from subprocess import DEVNULL
from typing import Any

import torch

from services.language.engine import loop
from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.grammar import Grammars
from services.language.engine.interface import EngineHost, OutputQueue
from services.language.engine.kv_cache import PrefixPages
from services.language.engine.loop import AbortRequest, AddMedia, AddRequest, Encoding, Reply
from services.language.engine.outputs import EngineLoad, EngineLostError, RequestOutput, StepStats
from services.language.engine.request import Request
from services.model.spec import ModelSpec
from services.runtime import env, logs
from services.runtime.malloc import keep_freed_memory
from services.wire.messages import FirstToken

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # weights, warm-up and kernels built on first use


# -- the messages ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ready:
    num_kv_pages: int
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class _Timing:
    """What the engine noted of a finished request, for its trace (Frontend)."""

    first_scheduled_time: float | None
    first_token_time: float | None
    num_prefill_steps: int
    num_cached_pages: int
    num_preemptions: int
    held_seconds: float
    output_token_ids: list[int]


# an output (or the error that ends the request), and with a request's last, its
# timing; or an export's pages (or its error)
_Item = tuple[str, RequestOutput | PrefixPages | Exception, _Timing | None]


@dataclass(frozen=True, slots=True)
class _ExportPrefix:
    """The cached pages the digests begin with (LLMEngine.export_prefix), answered
    under `call_id` by the child's pipe reader, not its loop."""

    call_id: str
    digests: tuple[bytes, ...]
    min_pages: int = 1
    with_planes: bool = True


_CLOSED = "closed"  # the pipe reader's last word: the parent closed the pipe, or is gone


@dataclass(frozen=True, slots=True)
class _Outputs:
    items: list[_Item]
    load: EngineLoad
    step: tuple[StepStats, float] | None = None  # a step's, with its seconds


def _put(conn: Connection, message: object) -> None:
    """Plain pickle, tensors inline: Connection.send's pickler would pass torch's
    storages as file descriptors, which only multiprocessing's own children
    (sharing its authentication key) can take."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _get(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _portable(request: Request) -> Request:
    """The request as it crosses to the child: its generator and grammar matcher
    are rebuilt there (from its seed and grammar), its grammar travels serialized."""
    out = copy.copy(request)
    out.generator = out.matcher = None
    if request.grammar is not None:
        out.grammar = request.grammar.serialize_json()
    return out


def _restored(request: Request, grammars: Grammars) -> Request:
    if request.grammar is not None:
        request.grammar = grammars.deserialize(request.grammar)
    request.__post_init__()  # the generator and the matcher
    return request


def _timing(request: Request) -> _Timing:
    return _Timing(
        request.first_scheduled_time,
        request.first_token_time,
        request.num_prefill_steps,
        request.num_cached_pages,
        request.num_preemptions,
        request.held_seconds,
        request.output_token_ids,
    )


def _apply(timing: _Timing, request: Request) -> None:
    request.first_scheduled_time = timing.first_scheduled_time
    request.first_token_time = timing.first_token_time
    request.num_prefill_steps = timing.num_prefill_steps
    request.num_cached_pages = timing.num_cached_pages
    request.num_preemptions = timing.num_preemptions
    request.held_seconds = timing.held_seconds
    request.output_token_ids = timing.output_token_ids


# -- the child ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Start:
    checkpoint: Path
    config: EngineConfig
    log_level: int


def _bound_to(parent: int) -> None:
    """Killed with its parent; deaf to the signals that stop its parent (a Ctrl-C
    reaches the whole process group): the parent stops it over the pipe, once
    its requests in flight are done."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        raise SystemExit("the parent died before its engine process started")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


# The child's program (not `-m` this module: it would be __main__, and the
# messages it unpickles would name other classes than its own).
CHILD = "from services.language.engine.process import main; main()"


def main(argv: Sequence[str] = sys.argv[1:]) -> None:
    """The child, given FD (its end of the pipe: a socket the parent passed it)
    and PARENT_PID."""
    fd, parent = map(int, argv)
    _bound_to(parent)
    keep_freed_memory()
    conn = Connection(fd)
    start = _get(conn)
    assert isinstance(start, _Start)
    logs.configure(logging.getLevelName(start.log_level), env.LOG_FORMAT.get())
    from services.model.checkpoint import load_language_weights
    from services.model.spec import load_spec
    from services.model.tokenizer import load_tokenizer

    spec = load_spec(start.checkpoint)
    weights = load_language_weights(start.checkpoint, spec, start.config.dtype)
    engine = LLMEngine(spec, weights, load_tokenizer(start.checkpoint), start.config)
    engine.warm_up()
    _put(conn, _Ready(engine.blocks.allocator.num_blocks, engine.load()))
    with contextlib.suppress(EOFError, OSError):  # the parent closed the pipe, or is gone
        loop.run(engine, _Child(engine, conn))
    # Done: leave without the interpreter's teardown (torch's and the thread pools'
    # state cost seconds of CPU to free, which a stack stopping at once pays in wall
    # time; services.launcher.cli.exit_now does the same for every epd process).
    logging.shutdown()
    os._exit(0)


class _Child:
    """The loop's Host in the child: messages from the pipe, replies into it (with
    the timing of each request's choice 0 as it finishes). A thread reads the pipe:
    it answers an export itself, while the loop steps (LLMEngine.export_prefix
    reads cached pages safely beside a step), and queues the rest for the loop."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.requests: dict[str, Request] = {}  # choice 0 of each, for its timing
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writing = threading.Lock()  # one message at a time into the pipe
        self._load = engine.load()  # as last published
        threading.Thread(target=self._read, name="pipe", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                message = _get(self.conn)
                if isinstance(message, _ExportPrefix):
                    self._export(message)
                else:
                    self._inbox.put(message)
        except (EOFError, OSError):
            self._inbox.put(_CLOSED)

    def _export(self, message: _ExportPrefix) -> None:
        engine = self.engine
        item: PrefixPages | Exception
        try:
            item = engine.export_prefix(message.digests, message.min_pages, message.with_planes)
        except Exception as exc:  # a bug: the caller hears of it, the engine goes on
            logger.exception("exporting a prefix failed")
            item = exc
        self._write(_Outputs([(message.call_id, item, None)], self._load))

    def _write(self, outputs: _Outputs) -> None:
        with self._writing:
            _put(self.conn, outputs)

    def receive(self, timeout: float | None) -> list[object]:
        """Raises EOFError once the parent has closed the pipe or died."""
        messages = []
        with contextlib.suppress(queue.Empty):
            messages.append(
                self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            )
            while True:
                messages.append(self._inbox.get_nowait())
        if _CLOSED in messages:
            raise EOFError
        return messages

    def apply(self, message: object) -> list[Reply]:
        if isinstance(message, AddRequest):
            request = _restored(message.request, self.engine.grammars)
            self.requests[request.request_id] = request
            message = AddRequest(request)
        return loop.apply(self.engine, message)

    def publish(self, replies: list[Reply], step: tuple[StepStats, float] | None) -> None:
        if replies or step is not None:
            self._load = self.engine.load()
            self._write(_Outputs([self._item(*reply) for reply in replies], self._load, step))

    def _item(self, request_id: str, item: RequestOutput | Exception) -> _Item:
        timing = None
        if isinstance(item, Exception) or (item.finished and item.index == 0):
            request = self.requests.pop(request_id, None)
            if request is not None and not isinstance(item, Exception):
                timing = _timing(request)
        return request_id, item, timing


# -- the parent --------------------------------------------------------------------


class EngineProcess(EngineHost):
    """The engine in a child process, with AsyncEngine's interface for the
    frontend (Engine): requests in through `generate`, their outputs back on
    per-request queues filled from the pipe by the event loop itself (a reader
    on its file descriptor, no thread). Checks and grammar compilation happen
    here, before a request crosses. `on_lost`: called once if the child dies."""

    def __init__(
        self,
        checkpoint: Path,
        config: EngineConfig,
        spec: ModelSpec,
        tokenizer: Any,
        on_step: Callable[[StepStats, float], None] = lambda stats, seconds: None,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(config, spec, Grammars(tokenizer, spec))
        self.checkpoint = checkpoint
        self._on_step = on_step
        self._on_lost = on_lost
        self._requests: dict[str, Request] = {}  # in flight: their timing is noted here
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lost = False
        self._exports: dict[str, asyncio.Future[PrefixPages]] = {}  # by call id
        self._calls = itertools.count()
        self.num_kv_pages = 0
        self.load = EngineLoad()

    def start(self) -> None:
        """Starts the child and waits until it has warmed its engine up. A plain
        Python child (spawned, not forked: this process runs gRPC's threads; and not
        multiprocessing's spawn, which imports this program's main module again)."""
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-c", CHILD, str(theirs.fileno()), str(os.getpid())]
        self._process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        level = logging.getLogger().getEffectiveLevel()
        _put(conn, _Start(self.checkpoint, self.config, level))
        if not conn.poll(READY_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process was not ready within {READY_TIMEOUT_S:g}s")
        try:
            ready = _get(conn)
        except EOFError:
            code = self._process.wait()
            raise RuntimeError(f"the engine process exited during start-up ({code})") from None
        assert isinstance(ready, _Ready)
        self.num_kv_pages, self.load = ready.num_kv_pages, ready.load
        self._conn = conn
        asyncio.get_running_loop().add_reader(conn.fileno(), self._receive)
        # uvloop's reader (libuv's uv_poll_init) makes the socket non-blocking,
        # and a request larger than its buffer (a large image's embeddings) would
        # then go half-written; the reader reads only once data is there anyway
        os.set_blocking(conn.fileno(), True)

    async def stop(self) -> None:
        if self._conn is None:
            return
        asyncio.get_running_loop().remove_reader(self._conn.fileno())
        self._conn.close()  # the child's loop ends at EOF
        self._conn = None
        process = self._process
        assert process is not None
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)

    def _receive(self) -> None:
        """One message of the child's; the loop calls again while the pipe holds more
        (not Connection.poll(), which builds a selector a call: ~9 % of this
        process's time under load)."""
        assert self._conn is not None
        try:
            outputs = _get(self._conn)
        except (EOFError, OSError):
            self._died()
            return
        for request_id, item, timing in outputs.items:
            if self._answered(request_id, item):
                continue
            assert not isinstance(item, PrefixPages)
            if (q := self._queues.get(request_id)) is not None:
                if timing is not None:
                    _apply(timing, self._requests[request_id])
                q.put_nowait(item)
        self.load = outputs.load
        if outputs.step is not None:
            self._on_step(*outputs.step)

    def _died(self) -> None:
        """The child is gone: every request fails, and nothing new is taken."""
        assert self._conn is not None
        asyncio.get_running_loop().remove_reader(self._conn.fileno())
        self._lost = True
        code = self._process.poll() if self._process is not None else None
        logger.error("the engine process died (exit code %s): failing its requests", code)
        for q in self._queues.values():
            q.put_nowait(EngineLostError("the engine process died"))
        for future in self._exports.values():
            if not future.done():
                future.set_exception(EngineLostError("the engine process died"))
        self._on_lost()

    async def export_prefix(
        self, digests: Sequence[bytes], min_pages: int, timeout_s: float, with_planes: bool = True
    ) -> PrefixPages:
        call_id = f"\0export-{next(self._calls)}"  # no request's id: a NUL never comes in one
        future = asyncio.get_running_loop().create_future()
        self._exports[call_id] = future
        try:
            self._send(_ExportPrefix(call_id, tuple(digests), min_pages, with_planes))
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            del self._exports[call_id]

    def _answered(self, call_id: str, item: object) -> bool:
        """Whether an item from the child answers an export (then it is delivered)."""
        future = self._exports.get(call_id)
        if future is None:
            return False
        if not future.done():
            if isinstance(item, BaseException):
                future.set_exception(item)
            else:
                assert isinstance(item, PrefixPages)
                future.set_result(item)
        return True

    def _send(self, message: AddRequest | AbortRequest | _ExportPrefix) -> None:
        if self._lost or self._conn is None:
            raise EngineLostError("the engine process is not running")
        _put(self._conn, message)

    async def generate(
        self, request: Request, firsts: Sequence[FirstToken] = ()
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request, its choices interleaved, until every choice
        finishes; leaving early aborts it. Its timing is noted on `request` before
        its last output comes (as the engine notes it in process)."""
        assert not firsts, "a prefilled request needs the engine's KV cache in this process"
        self.check(request)
        self._send(AddRequest(_portable(request)))  # what crosses: _portable's
        q: OutputQueue = asyncio.Queue()
        self._queues[request.request_id] = q
        self._requests[request.request_id] = request
        try:
            async with contextlib.aclosing(self._outputs(request, q)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            del self._requests[request.request_id]

    def add_media(
        self, request_id: str, start: int, embeds: torch.Tensor, deepstack: torch.Tensor | None
    ) -> None:
        self._tell(AddMedia(request_id, start, embeds, deepstack))

    def abort(self, request_id: str) -> None:
        self._tell(AbortRequest(request_id))

    def set_encoding(self, since: float | None, wait_s: float) -> None:
        self._tell(Encoding(since, wait_s))

    def _tell(self, message: AddMedia | AbortRequest | Encoding) -> None:
        """A message that matters only to a running child (none is sent otherwise)."""
        if not self._lost and self._conn is not None:
            _put(self._conn, message)
