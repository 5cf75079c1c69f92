"""Broker peers for tests: registrations, and BrokerLinks that record what they hear."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from services.broker.client import BrokerLink
from services.broker.messages import BrokerMessage, Load, PoolInfo, Registration, Role
from services.broker.server import BrokerServer
from services.transfer.transport import Endpoints, GrpcEndpoint, ShmEndpoint, Transport


def language(
    instance_id: str, host: str = "h1", shm: bool = True, model: str = "m"
) -> Registration:
    endpoints = Endpoints(
        shm=ShmEndpoint("seg") if shm else None, grpc=GrpcEndpoint(f"{instance_id}:1")
    )
    pool = PoolInfo(16, 256, 8, 0, torch.float32, endpoints)
    return Registration(
        Role.LANGUAGE, instance_id, f"{instance_id}:1", host, endpoints.transports, model, pool
    )


def encoder(
    instance_id: str,
    host: str = "h1",
    transports: tuple[Transport, ...] = (Transport.SHM, Transport.GRPC),
    model: str = "m",
) -> Registration:
    return Registration(Role.ENCODER, instance_id, f"{instance_id}:1", host, transports, model)


class Peer:
    """A BrokerLink that records what it receives."""

    def __init__(self, address: str, registration: Registration, load: int = 0) -> None:
        self.received: list[BrokerMessage] = []
        self.load = Load(num_requests=load)
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


async def attach(broker: BrokerServer, registration: Registration, load: int = 0) -> Peer:
    peer = Peer(broker.address, registration, load)
    await peer.link.start()
    return peer
