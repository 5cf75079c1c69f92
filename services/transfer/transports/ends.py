"""The one place that names each transport's classes: the language side's
receive pool with its receive ends, and the encoder side's writers, for the
transports an instance is configured with (those that cannot run here are
skipped, and said so)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout
from services.transfer.transports.base import ReceiveEnd, Writer
from services.transfer.transports.cuda_ipc import CudaIpcMemory, CudaIpcWriter, cuda_ipc_available
from services.transfer.transports.grpc_stream import GrpcReceiveEnd, GrpcWriter
from services.transfer.transports.nixl import NixlReceiver, NixlWriter, nixl_available
from services.transfer.transports.shm import ShmReceiveEnd, ShmWriter
from services.wire.transport import Transport

logger = logging.getLogger(__name__)


def _available(transport: Transport, device: torch.device) -> bool:
    if transport is Transport.NIXL:
        return nixl_available()
    if transport is Transport.CUDA_IPC:
        return device.type == "cuda" and cuda_ipc_available()
    if transport is Transport.SHM:
        return device.type == "cpu"  # a GPU pool is not in shared memory
    return True


def _skipped(transport: Transport) -> None:
    logger.warning("transport %s is not available here; skipped", transport.name.lower())


def receive_side(
    layout: PoolLayout,
    device: torch.device,
    transports: Sequence[Transport],
    instance_id: str,
    address: Callable[[], str],
) -> tuple[EmbeddingPool, dict[Transport, ReceiveEnd]]:
    """The receive pool (a decode instance's: its KV cache), in memory the
    transports can reach (CUDA IPC: exported device memory; shm: shared memory),
    and a receive end per transport."""
    usable = [t for t in transports if _available(t, device)]
    for transport in set(transports) - set(usable):
        _skipped(transport)
    ends: dict[Transport, ReceiveEnd] = {}
    if Transport.CUDA_IPC in usable:
        memory = CudaIpcMemory(layout, device)
        pool = memory.pool
        ends[Transport.CUDA_IPC] = memory
    elif device.type == "cuda":
        pool = EmbeddingPool.on_cuda(layout, device)
    elif Transport.SHM in usable:
        pool = EmbeddingPool.in_shared_memory(layout)
        ends[Transport.SHM] = ShmReceiveEnd(pool)
    else:
        pool = EmbeddingPool.in_host_memory(layout)
    if Transport.NIXL in usable:
        ends[Transport.NIXL] = NixlReceiver(f"epd-{instance_id}", pool)
    if Transport.GRPC in usable:
        ends[Transport.GRPC] = GrpcReceiveEnd(address)
    return pool, ends


def writers(
    transports: Sequence[Transport],
    instance_id: str,
    source: EmbeddingPool,
    timeout_s: float,
    what: str = "",
) -> dict[Transport, Writer]:
    """A writer per transport, reading from `source` (an encoder's send buffer; a
    prefill instance's KV cache, `what` "kv": its NIXL agent is named for it)."""
    out: dict[Transport, Writer] = {}
    for transport in transports:
        if transport is Transport.SHM:
            out[transport] = ShmWriter()
        elif transport is Transport.GRPC:
            out[transport] = GrpcWriter(instance_id, timeout_s)
        elif transport is Transport.NIXL and nixl_available():
            agent = f"epd-{instance_id}-{what}" if what else ""
            out[transport] = NixlWriter(instance_id, source, timeout_s, agent)
        elif transport is Transport.CUDA_IPC and cuda_ipc_available():
            out[transport] = CudaIpcWriter()
        else:
            _skipped(transport)
    return out
