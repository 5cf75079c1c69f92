"""The gRPC server every EPD service runs: its servicers plus the standard
health service and server reflection (what grpcurl needs), and a Prometheus
endpoint for its own metrics registry."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from services.proto import telemetry_pb2, telemetry_pb2_grpc
from services.runtime import tracing
from services.runtime.ports import port_taken
from services.runtime.security import Security, aio_channel, current

logger = logging.getLogger(__name__)

TELEMETRY = telemetry_pb2.DESCRIPTOR.services_by_name["Telemetry"].full_name

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A peer that stops answering (a hung or frozen process keeps its TCP connection
# up) fails its calls after ~keepalive time + timeout instead of at their deadline.
# A peer that restarts is reached again within a second of serving (the default
# reconnect backoff grows to two minutes).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    # without it this gRPC never times a ping out: a frozen server held a call
    # to its deadline (measured: 39 s of 40, against 7 s with it)
    ("grpc.http2.ping_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
CHANNEL_OPTIONS = [
    *_SIZES,
    *KEEPALIVE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [
    *_SIZES,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 4000),  # the clients ping every 5 s
]


def metrics_registry() -> CollectorRegistry:
    """A component's Prometheus registry, with its process's own metrics (CPU,
    memory, start time: a restart shows as a change of process_start_time_seconds)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def channel(address: str, security: Security | None = None) -> grpc.aio.Channel:
    """A channel with the project's message-size limits and keepalive, the cluster
    token on every call, TLS when configured (this process's by default) and,
    when tracing, the caller's trace context."""
    return aio_channel(address, CHANNEL_OPTIONS, security, tracing.client_interceptors())


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServicer):
    async def RecentSpans(
        self, request: telemetry_pb2.RecentSpansRequest, context: grpc.aio.ServicerContext
    ) -> telemetry_pb2.RecentSpansReply:
        return telemetry_pb2.RecentSpansReply(
            traces=tracing.recent_spans(request.request_id), tracing=tracing.enabled()
        )


class GrpcServer:
    """Start with start(); `port` and `metrics_port` are the bound ones (0 picks free ports)."""

    def __init__(
        self,
        name: str,
        service_names: Sequence[str],
        add_servicers: Callable[[grpc.aio.Server], None],
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = 0,
        advertise_host: str | None = None,
        security: Security | None = None,
    ) -> None:
        self.name = name
        self.security = security or current()
        self.host = host
        # What peers dial: a wildcard bind is reachable under this host's name.
        self.advertise_host = advertise_host or (
            socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host
        )
        self.service_names = list(service_names)
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=self.security.server_interceptors()
        )
        add_servicers(self.server)
        telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, TELEMETRY, health.SERVICE_NAME, reflection.SERVICE_NAME],
            self.server,
        )
        self._requested_port = port
        self._registry = registry
        self._requested_metrics_port = metrics_port
        self._metrics_server: Any = None
        self.port = 0
        self.metrics_port = 0

    @property
    def address(self) -> str:
        """The address peers use (registered with the broker)."""
        return f"{self.advertise_host}:{self.port}"

    async def start(self) -> None:
        bind = f"{self.host}:{self._requested_port}"
        try:
            if self.security.tls:
                self.port = self.server.add_secure_port(bind, self.security.server_credentials())
            else:
                self.port = self.server.add_insecure_port(bind)
        except RuntimeError:  # grpc's "Failed to bind": it does not say why
            raise port_taken(self.name, self.host, self._requested_port) from None
        await self.server.start()
        if self._requested_metrics_port is not None:
            try:
                self._metrics_server, _ = start_http_server(
                    self._requested_metrics_port, addr=self.host, registry=self._registry
                )
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                what = f"{self.name}'s metrics"
                raise port_taken(what, self.host, self._requested_metrics_port) from None
            self.metrics_port = self._metrics_server.server_port
        await self.set_serving(True)
        if not self.security.token:
            logger.warning(
                "%s: no cluster token (EPD_CLUSTER_TOKEN): any caller that reaches "
                "this port is trusted",
                self.name,
            )
        logger.info(
            "%s serving on %s:%s as %s (metrics on %s)",
            self.name,
            self.host,
            self.port,
            self.address,
            self.metrics_port or "-",
        )

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ["", *self.service_names]:
            await self.health.set(service, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
        if self._metrics_server is not None:
            # shutdown() waits for the serving thread's next poll (up to 0.5 s):
            # off the stop's path, which only needs the port closed soon after
            threading.Thread(target=_close_http, args=(self._metrics_server,), daemon=True).start()
            self._metrics_server = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def _close_http(server: Any) -> None:
    server.shutdown()
    server.server_close()
