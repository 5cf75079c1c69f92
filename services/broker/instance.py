"""What every instance attached to the broker (an encoder, a language instance)
shares: InstanceConfig (where it listens, how peers reach it, who it is, which
broker, which transports), and InstanceServer, the one lifecycle both run:

    start: serve gRPC -> on_serving -> attach to the broker -> run the periodic tasks
    stop:  "unavailable" to the broker -> what it routed before it heard
           (ROUTED_GRACE_S) -> refuse new requests -> the tasks -> gRPC
           (EPD_SHUTDOWN_GRACE for requests in flight) -> the transfer driver -> the broker link
           -> whatever the instance holds (release)
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry

from services.broker.client import BrokerLink, BrokerUnavailableError
from services.runtime import env
from services.runtime.grpc_server import GrpcServer
from services.wire.messages import (
    BrokerMessage,
    Heartbeat,
    LanguageRole,
    PeerMessage,
    PoolDescriptor,
    Register,
    Role,
)
from services.wire.transport import Transport

EXPIRE_INTERVAL_S = 0.5  # how often the transfer driver's deadlines are checked


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
        language_role: LanguageRole = LanguageRole.BOTH,
    ) -> Register:
        return Register(
            role=self.role,
            instance_id=self.instance_id,
            grpc_address=address,
            host_id=self.host_id,
            transports=transports,
            model=model,
            pool=pool,
            language_role=language_role,
        )


class TransferDriver(Protocol):
    """The I/O side of an instance's transfer machine (SenderDriver, ReceiverDriver)."""

    async def on_message(self, message: BrokerMessage) -> None: ...

    async def expire(self) -> None: ...

    async def detached(self) -> None: ...

    async def close(self) -> None: ...


# How long a stopping instance still takes requests once it told the broker it
# takes none: those the broker routed here before it heard, which the gateway
# sends right after routing (its Encode and Generate go out together).
ROUTED_GRACE_S = 0.3


class InstanceServer(abc.ABC):
    """The lifecycle of an instance attached to the broker. A subclass builds
    its gRPC server and transfer driver, says how it registers and what load it
    reports, and releases what it holds; it may add periodic tasks."""

    grpc: GrpcServer
    driver: TransferDriver

    def __init__(self, instance: InstanceConfig) -> None:
        self.instance = instance
        self.link: BrokerLink | None = None
        self.draining = False  # stopping: unavailable to new requests
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        return self.grpc.address

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    @abc.abstractmethod
    def registration(self) -> Register: ...

    @abc.abstractmethod
    def load(self) -> Heartbeat: ...

    def periodic(self) -> list[tuple[float, Callable[[], Awaitable[None]]]]:
        """Tasks to run every so many seconds while serving, beside the driver's expiry."""
        return []

    async def on_serving(self) -> None:  # noqa: B027 (a hook: most instances need none)
        """Runs once gRPC serves, before the instance registers with the broker."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Frees what the instance holds, once nothing serves any more."""

    async def start(self) -> None:
        await self.grpc.start()
        await self.on_serving()
        if self.instance.broker:
            self.link = BrokerLink(
                self.instance.broker,
                self.registration(),
                self.driver.on_message,
                self._heartbeat,
                on_detached=self.driver.detached,
            )
            await self.link.start()
        tasks = [(EXPIRE_INTERVAL_S, self.driver.expire), *self.periodic()]
        self._tasks = [asyncio.create_task(_every(s, work)) for s, work in tasks]

    def refuse_new(self) -> None:  # noqa: B027 - a hook: the gRPC server's stop suffices for most
        """From now on new requests are refused (their callers fail them over);
        those in flight go on. The gRPC server's stop does it for new calls; a
        language instance also refuses new requests on its open streams."""

    def _heartbeat(self) -> Heartbeat:
        load = self.load()
        return replace(load, unavailable=True) if self.draining else load

    async def stop(self) -> None:
        """Drains: the broker hears at once that this instance takes nothing new
        (so a stop the planner asked for fails no request); what it routed here
        before it heard is still taken for ROUTED_GRACE_S; then new requests are
        refused (refuse_new) and what is in flight gets the shutdown grace."""
        self.draining = True
        if self.link is not None and self.link.attached.is_set():
            self.link.send(self._heartbeat())
            await asyncio.sleep(ROUTED_GRACE_S)
        self.refuse_new()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.grpc.stop(env.SHUTDOWN_GRACE.get())  # requests in flight may finish
        await self.driver.close()
        if self.link is not None:
            await self.link.close()
        await self.release()

    def to_broker(self, message: PeerMessage) -> None:
        """Sends on the broker stream; BrokerUnavailableError without a broker."""
        if self.link is None:
            raise BrokerUnavailableError(f"this {self.instance.role.name.lower()} has no broker")
        self.link.send(message)


async def _every(seconds: float, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(seconds)
        await work()
