"""nixl: a NIXL agent with the UCX backend (RDMA / GPUDirect across nodes; shared
memory or TCP on one CPU host). The language pool is registered once at
start-up and its agent metadata travels in the broker registration; the encoder
registers its send buffer once and WRITEs one descriptor per contiguous run,
with "request_id:encoder_id:sent_tokens" as the notification (naming the
sender: a request that moved to another encoder never takes the old one's).

Agents run without NIXL's progress thread: it spins a whole core even when idle
(measured here: 3.0 CPU-seconds per 3 s). The initiator makes progress by
polling its transfer's state; the target must make progress too for the
initiator to see DONE, so the language side polls its notifications, every
50 us while transfers are pending and every 20 ms otherwise, and hands each
notification to the coroutine waiting for it. Both poll on threads (asyncio
timers have a 1 ms floor), so the agents are created thread-safe."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, copy_runs
from services.transfer.transports.base import Part, check_compatible, receiver_layout
from services.wire.messages import NixlPool, Register
from services.wire.transport import Transport

logger = logging.getLogger(__name__)

BUSY_POLL_S = 0.00005
IDLE_POLL_S = 0.02


def nixl_available() -> bool:
    try:
        _api()
    except ImportError:
        return False
    return True


def _api() -> Any:
    # The `nixl` meta package picks a CUDA variant by what it detects (and fails
    # on a CUDA 13 toolkit without a driver); the cu12 build also runs on CPU.
    import nixl_cu12._api as api

    return api


def notification(request_id: str, encoder_id: str, sent_tokens: int) -> bytes:
    return f"{request_id}:{encoder_id}:{sent_tokens}".encode()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter that timed out has cancelled it
        future.set_result(None)


def _fail(future: asyncio.Future[None], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _memory_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def _device(tensor: torch.Tensor) -> int:
    return (tensor.device.index or 0) if tensor.is_cuda else 0


class NixlAgent:
    """One agent per process side, its pool tensors registered once."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        api = _api()
        self.name = name
        self.agent = api.nixl_agent(
            name,
            api.nixl_agent_config(
                enable_prog_thread=False,
                backends=["UCX"],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        self._registrations = [self.agent.register_memory(t) for t in tensors]

    @property
    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def close(self) -> None:
        for registration in self._registrations:
            self.agent.deregister_memory(registration)
        self._registrations = []


class NixlReceiver:
    """The language side: its pool registered with an agent, and a thread making
    progress and collecting notifications (a part is in once the writer's
    notification for it arrived)."""

    transport = Transport.NIXL
    polled = True

    def __init__(self, name: str, pool: EmbeddingPool) -> None:
        self.agent = NixlAgent(name, pool.tensors)
        self.pool = pool
        self._seen: set[bytes] = set()  # arrived before anyone waited for them
        self._waiters: dict[bytes, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def endpoint(self) -> NixlPool:
        return NixlPool(
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            plane_addrs=tuple(t.data_ptr() for t in self.pool.tensors),
            device_id=_device(self.pool.tensors[0]),
            memory_type=_memory_type(self.pool.tensors[0]),
        )

    def start(self, busy: Callable[[], bool]) -> None:
        """Starts the progress thread; `busy()` says whether transfers are pending."""
        self._thread = threading.Thread(
            target=self._run, args=(busy,), name="nixl-progress", daemon=True
        )
        self._thread.start()

    def _run(self, busy: Callable[[], bool]) -> None:
        """Never dies on an error: it logs it, fails the transfers waiting right
        now (their data may never be seen), and goes on polling."""
        while not self._stop.is_set():
            try:
                self._poll(busy())
            except Exception as exc:
                logger.exception("NIXL progress failed; failing the waiting transfers")
                self._fail_waiters(exc)
                time.sleep(IDLE_POLL_S)

    def _poll(self, busy: bool) -> None:
        if busy:
            time.sleep(BUSY_POLL_S)
        else:
            self._wake.wait(IDLE_POLL_S)
            self._wake.clear()
        notifications = self.agent.agent.get_new_notifs()
        if notifications:
            with self._lock:
                for messages in notifications.values():
                    for message in messages:
                        self._arrived(message)

    def _fail_waiters(self, exc: Exception) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        error = RuntimeError(f"NIXL progress failed: {exc}")
        for loop, future in waiters.values():
            loop.call_soon_threadsafe(_fail, future, error)

    def forget(self, request_id: str) -> None:
        """Drops notifications kept for a request that ended (or changed encoder)."""
        prefix = f"{request_id}:".encode()
        with self._lock:
            self._seen = {m for m in self._seen if not m.startswith(prefix)}

    def announced(self, request_id: str) -> None:
        """A transfer is about to start: poll fast from now on."""
        self._wake.set()

    async def confirm(
        self, request_id: str, encoder_id: str, sent_tokens: int, timeout_s: float
    ) -> None:
        await self.wait_notification(notification(request_id, encoder_id, sent_tokens), timeout_s)

    def _arrived(self, message: bytes) -> None:
        """On the progress thread, under the lock: wakes the waiter, or keeps it for one."""
        waiter = self._waiters.pop(message, None)
        if waiter is None:
            self._seen.add(message)
            return
        loop, future = waiter
        loop.call_soon_threadsafe(_resolve, future)

    async def wait_notification(self, message: bytes, timeout_s: float) -> None:
        """Returns once the sender's notification for a part arrived (the data is in)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if message in self._seen:
                self._seen.discard(message)
                return
            future: asyncio.Future[None] = loop.create_future()
            self._waiters[message] = (loop, future)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            raise TimeoutError(
                f"no NIXL notification {message!r} within {timeout_s:.0f}s"
            ) from None
        finally:
            with self._lock:
                self._waiters.pop(message, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.agent.close()


class NixlWriter:
    transport = Transport.NIXL

    def __init__(
        self, instance_id: str, source: EmbeddingPool, timeout_s: float = 60.0, agent: str = ""
    ) -> None:
        """`agent`: the agent's name (default epd-<instance id>; a prefill instance's
        KV writer is another agent than its embedding receiver)."""
        self.instance_id = instance_id
        self.agent = NixlAgent(agent or f"epd-{instance_id}", source.tensors)
        self.timeout_s = timeout_s
        self._peers: dict[str, str] = {}

    def _remote(self, peer: Register) -> tuple[str, NixlPool]:
        assert peer.pool is not None and peer.pool.nixl is not None
        endpoint = peer.pool.nixl
        if peer.instance_id not in self._peers:
            name = self.agent.agent.add_remote_agent(endpoint.agent_metadata)
            self._peers[peer.instance_id] = name.decode() if isinstance(name, bytes) else str(name)
        return self._peers[peer.instance_id], endpoint

    async def write(self, peer: Register, source: EmbeddingPool, part: Part) -> None:
        target: PoolLayout = receiver_layout(peer)
        check_compatible(source.layout, target, peer.instance_id)
        remote_name, endpoint = self._remote(peer)
        runs = copy_runs(
            part.src_blocks,
            source.layout.block_size,
            part.start,
            part.dst_blocks,
            target.block_size,
            0,
            part.count,
        )
        # One descriptor per run and plane, all in one WRITE with one notification.
        src: list[tuple[int, int, int]] = []
        dst: list[tuple[int, int, int]] = []
        for local, remote_addr, plane in zip(
            source.tensors, endpoint.plane_addrs, target.planes, strict=True
        ):
            base, device, row = local.data_ptr(), _device(local), target.row_bytes(plane)
            for r in runs:
                src.append((base + r.src_row * row, r.length * row, device))
                dst.append((remote_addr + r.dst_row * row, r.length * row, endpoint.device_id))
        message = notification(part.request_id, self.instance_id, part.start + part.count)
        await asyncio.to_thread(
            self._transfer,
            src,
            dst,
            _memory_type(source.tensors[0]),
            endpoint,
            remote_name,
            message,
        )

    def _transfer(
        self,
        src: list[tuple[int, int, int]],
        dst: list[tuple[int, int, int]],
        local_memory: str,
        endpoint: NixlPool,
        remote_name: str,
        message: bytes,
    ) -> None:
        """One WRITE, polled to completion on a worker thread."""
        agent = self.agent.agent
        handle = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(src, local_memory),
            agent.get_xfer_descs(dst, endpoint.memory_type),
            remote_name,
            message,
        )
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write to {endpoint.agent_name} timed out")
                time.sleep(BUSY_POLL_S)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL write to {endpoint.agent_name} failed")
        finally:
            agent.release_xfer_handle(handle)

    async def forget(self, instance_id: str) -> None:
        name = self._peers.pop(instance_id, None)
        if name is not None:
            self.agent.agent.remove_remote_agent(name)

    async def close(self) -> None:
        for instance_id in list(self._peers):
            await self.forget(instance_id)
        self.agent.close()
