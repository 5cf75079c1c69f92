"""nixl: a NIXL agent with the UCX backend (RDMA / GPUDirect across nodes; shared
memory or TCP on one CPU host). The language pool is registered once at
start-up and its agent metadata travels in the broker registration; the encoder
registers its send buffer once and WRITEs one descriptor per contiguous run,
with "request_id:sent_tokens" as the notification.

Agents run without NIXL's progress thread: it spins a whole core even when idle
(measured here: 3.0 CPU-seconds per 3 s). The initiator makes progress by
polling its transfer's state; the target must make progress too for the
initiator to see DONE, so the language side polls its notifications, every
0.5 ms while transfers are pending and every 20 ms otherwise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from services.broker.messages import Registration
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, Run, copy_runs
from services.transfer.transport import NixlEndpoint, Transport
from services.transfer.transports.base import Part, check_compatible, receiver_layout

BUSY_POLL_S = 0.0005
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


def notification(request_id: str, sent_tokens: int) -> bytes:
    return f"{request_id}:{sent_tokens}".encode()


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
            name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
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
    """The language side: its pool registered with an agent, notifications drained on demand."""

    def __init__(self, name: str, pool: EmbeddingPool) -> None:
        tensors = [pool.embeddings] + ([pool.deepstack] if pool.deepstack is not None else [])
        self.agent = NixlAgent(name, tensors)
        self.pool = pool
        self._seen: set[bytes] = set()

    def endpoint(self) -> NixlEndpoint:
        return NixlEndpoint(
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata,
            embeddings_addr=self.pool.embeddings.data_ptr(),
            deepstack_addr=self.pool.deepstack.data_ptr() if self.pool.deepstack is not None else 0,
            device_id=_device(self.pool.embeddings),
            memory_type=_memory_type(self.pool.embeddings),
        )

    def _drain(self) -> None:
        """Makes UCX progress and collects the notifications that arrived."""
        for messages in self.agent.agent.get_new_notifs().values():
            self._seen.update(messages)

    async def progress(self, busy: Callable[[], bool]) -> None:
        """Runs forever: the target-side progress the initiators' writes need."""
        while True:
            self._drain()
            await asyncio.sleep(BUSY_POLL_S if busy() else IDLE_POLL_S)

    async def wait_notification(self, message: bytes, timeout_s: float) -> None:
        """Returns once the sender's notification for a part arrived (the data is in)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            if message in self._seen:
                self._seen.discard(message)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no NIXL notification {message!r} within {timeout_s:.0f}s")
            await asyncio.sleep(BUSY_POLL_S)

    def close(self) -> None:
        self.agent.close()


class NixlWriter:
    transport = Transport.NIXL

    def __init__(self, name: str, source: EmbeddingPool, timeout_s: float = 60.0) -> None:
        tensors = [source.embeddings] + ([source.deepstack] if source.deepstack is not None else [])
        self.agent = NixlAgent(name, tensors)
        self.timeout_s = timeout_s
        self._peers: dict[str, str] = {}

    def _remote(self, peer: Registration) -> tuple[str, NixlEndpoint]:
        assert peer.pool is not None and peer.pool.endpoints.nixl is not None
        endpoint = peer.pool.endpoints.nixl
        if peer.instance_id not in self._peers:
            name = self.agent.agent.add_remote_agent(endpoint.agent_metadata)
            self._peers[peer.instance_id] = name.decode() if isinstance(name, bytes) else str(name)
        return self._peers[peer.instance_id], endpoint

    def _descriptors(
        self,
        runs: list[Run],
        local: torch.Tensor,
        remote_addr: int,
        remote_device: int,
        row_bytes: int,
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        base, device = local.data_ptr(), _device(local)
        src = [(base + r.src_row * row_bytes, r.length * row_bytes, device) for r in runs]
        dst = [
            (remote_addr + r.dst_row * row_bytes, r.length * row_bytes, remote_device) for r in runs
        ]
        return src, dst

    async def write(self, peer: Registration, source: EmbeddingPool, part: Part) -> None:
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
        src, dst = self._descriptors(
            runs, source.embeddings, endpoint.embeddings_addr, endpoint.device_id, target.row_bytes
        )
        if source.deepstack is not None:
            deep_src, deep_dst = self._descriptors(
                runs,
                source.deepstack,
                endpoint.deepstack_addr,
                endpoint.device_id,
                target.deepstack_row_bytes,
            )
            src += deep_src
            dst += deep_dst
        agent = self.agent.agent
        local_descs = agent.get_xfer_descs(src, _memory_type(source.embeddings))
        remote_descs = agent.get_xfer_descs(dst, endpoint.memory_type)
        handle = agent.initialize_xfer(
            "WRITE",
            local_descs,
            remote_descs,
            remote_name,
            notification(part.request_id, part.start + part.count),
        )
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL write to {peer.instance_id} timed out")
                await asyncio.sleep(0.0002)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL write to {peer.instance_id} failed")
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
