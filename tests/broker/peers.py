"""Broker peers for tests: registrations, and BrokerLinks that record what they hear."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from services.broker.client import BrokerLink
from services.broker.server import BrokerServer
from services.wire.messages import (
    BrokerMessage,
    GrpcPool,
    Heartbeat,
    Plane,
    PoolDescriptor,
    Register,
    Role,
    ShmPool,
)
from services.wire.transport import Transport


def language(instance_id: str, host: str = "h1", shm: bool = True, model: str = "m") -> Register:
    pool = PoolDescriptor(
        16,
        256,
        (Plane("embeddings", 8),),
        torch.float32,
        shm=ShmPool(("seg",)) if shm else None,
        grpc=GrpcPool(f"{instance_id}:1"),
    )
    return Register(
        Role.LANGUAGE, instance_id, f"{instance_id}:1", host, pool.transports, model, pool
    )


def encoder(
    instance_id: str,
    host: str = "h1",
    transports: tuple[Transport, ...] = (Transport.SHM, Transport.GRPC),
    model: str = "m",
) -> Register:
    return Register(Role.ENCODER, instance_id, f"{instance_id}:1", host, transports, model)


class Peer:
    """A BrokerLink that records what it receives."""

    def __init__(self, address: str, registration: Register, load: int = 0) -> None:
        self.received: list[BrokerMessage] = []
        self.load = Heartbeat(num_requests=load)
        self.link = BrokerLink(address, registration, self._on, lambda: self.load)

    async def _on(self, message: BrokerMessage) -> None:
        self.received.append(message)

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.received if isinstance(m, kind)]


async def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def attach(broker: BrokerServer, registration: Register, load: int = 0) -> Peer:
    peer = Peer(broker.address, registration, load)
    await peer.link.start()
    return peer
