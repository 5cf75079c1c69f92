"""`epd broker`: the broker's gRPC server and its periodic upkeep."""

from __future__ import annotations

import asyncio
import contextlib

from services.broker.broker import Broker
from services.broker.config import BrokerConfig
from services.broker.metrics import BrokerMetrics
from services.broker.placement import EncoderRouting, LoadBound
from services.broker.registry import Registry
from services.broker.rendezvous import Rendezvous
from services.broker.servicer import BrokerServicer
from services.proto import broker_pb2, broker_pb2_grpc
from services.runtime import env
from services.runtime.grpc_server import GrpcServer, metrics_registry
from services.runtime.security import Security, current


class BrokerServer:
    def __init__(self, config: BrokerConfig, security: Security | None = None) -> None:
        self.config = config
        security = security or current()
        registry = metrics_registry()
        self.broker = Broker(
            BrokerMetrics(registry),
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            rendezvous=Rendezvous(ttl_s=config.rendezvous_ttl_s),
            registry=Registry(
                encoder_routing=EncoderRouting(config.encoder_routing),
                load_bound=LoadBound(config.load_factor, config.load_slack),
                prefix_routing=config.language_routing == "prefix",
                peer_cache=config.peer_cache,
                prefix_moves=config.prefix_moves,
            ),
        )
        servicer = BrokerServicer(
            self.broker, show_endpoints=bool(security.token), route_wait_s=config.route_wait_s
        )
        self.grpc = GrpcServer(
            "broker",
            [broker_pb2.DESCRIPTOR.services_by_name["Broker"].full_name],
            lambda server: broker_pb2_grpc.add_BrokerServicer_to_server(servicer, server),
            registry,
            host=config.host,
            port=config.port,
            metrics_port=config.metrics_port,
            security=security,
        )
        self._upkeep: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.grpc.address

    async def start(self) -> None:
        await self.grpc.start()
        self._upkeep = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        """The broker's upkeep, every tick_s. A tick late by more than a tick was
        held up by the broker itself (its process stopped, its loop blocked): the
        instances' heartbeats waited in its sockets meanwhile, so that time is not
        counted as their silence (it was: every instance evicted at once on waking)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = loop.time()
            late = now - last - self.config.tick_s
            self.broker.tick(held_up_s=late if late > self.config.tick_s else 0.0)
            last = now

    async def stop(self, grace_s: float | None = None) -> None:
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
        await self.grpc.stop(env.SHUTDOWN_GRACE.get() if grace_s is None else grace_s)
