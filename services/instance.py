"""InstanceConfig: what every instance attached to the broker is configured
with (where it listens, how peers reach it, who it is, which broker, which
transports), and the gRPC server and broker registration built from it."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry

from services import env
from services.grpc_server import GrpcServer
from services.wire.messages import PoolDescriptor, Register, Role
from services.wire.transport import Transport


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    role: Role
    port: int
    host: str = "127.0.0.1"
    metrics_port: int | None = 0
    advertise_host: str | None = None  # default: host, or this machine's name for 0.0.0.0
    instance_id: str = ""  # default: the role and a random suffix
    host_id: str = field(default_factory=env.HOST_ID.get)
    broker: str | None = None
    transports: tuple[Transport, ...] = (Transport.SHM, Transport.NIXL, Transport.GRPC)

    def __post_init__(self) -> None:
        if not self.instance_id:
            generated = f"{self.role.name.lower()}-{secrets.token_hex(3)}"
            object.__setattr__(self, "instance_id", generated)

    def server(
        self,
        service_name: str,
        add_servicers: Callable[[grpc.aio.Server], None],
        registry: CollectorRegistry,
    ) -> GrpcServer:
        return GrpcServer(
            self.role.name.lower(),
            [service_name],
            add_servicers,
            registry,
            host=self.host,
            port=self.port,
            metrics_port=self.metrics_port,
            advertise_host=self.advertise_host,
        )

    def registration(
        self,
        address: str,
        transports: tuple[Transport, ...],
        model: str,
        pool: PoolDescriptor | None = None,
    ) -> Register:
        return Register(
            role=self.role,
            instance_id=self.instance_id,
            grpc_address=address,
            host_id=self.host_id,
            transports=transports,
            model=model,
            pool=pool,
        )
