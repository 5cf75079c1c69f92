"""Real services in the test process, on free ports."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from services.broker.instance import InstanceConfig
from services.broker.server import BrokerConfig, BrokerServer
from services.encoder.server import EncoderConfig, EncoderServer
from services.gateway.server import GatewayConfig, GatewayServer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageConfig, LanguageServer, noop
from services.proto import broker_pb2_grpc, encoder_pb2_grpc, language_pb2_grpc
from services.runtime.grpc_server import channel
from services.runtime.security import Security, current
from services.triton.launcher import TritonServer
from services.wire.messages import Role
from services.wire.transport import Transport

MODEL = "demo-tiny"


async def start_broker(**overrides: Any) -> BrokerServer:
    settings: dict[str, Any] = {"port": 0, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0}
    config = BrokerConfig(**{**settings, **overrides})
    server = BrokerServer(config)
    await server.start()
    return server


def instance(role: Role, broker: BrokerServer | None, overrides: dict[str, Any]) -> InstanceConfig:
    """Port 0, the test broker, and the transports the test asked for (taken out of overrides)."""
    transports = {"transports": overrides.pop("transports")} if "transports" in overrides else {}
    return InstanceConfig(role, port=0, broker=broker.address if broker else None, **transports)


async def start_encoder(
    checkpoint: Path,
    triton: TritonServer | None,
    broker: BrokerServer | None = None,
    **overrides: Any,
) -> EncoderServer:
    triton_url = triton.config.grpc_url if triton is not None else overrides.pop("triton_url")
    config = EncoderConfig(
        checkpoint=checkpoint,
        model_name=MODEL,
        instance=instance(Role.ENCODER, broker, overrides),
        triton_url=triton_url,
        **overrides,
    )
    server = EncoderServer(config)
    await server.start()
    return server


async def start_language(
    checkpoint: Path,
    broker: BrokerServer | None = None,
    engine: EngineConfig | None = None,
    on_engine_lost: Callable[[], None] = noop,
    **overrides: Any,
) -> LanguageServer:
    config = LanguageConfig(
        checkpoint=checkpoint,
        model_name=MODEL,
        instance=instance(Role.LANGUAGE, broker, overrides),
        engine=engine or EngineConfig(max_model_len=2048, kv_cache_bytes=64 * 1024 * 1024),
        **overrides,
    )
    server = LanguageServer(config, on_engine_lost)
    await server.start()
    return server


async def start_gateway(checkpoint: Path, broker: BrokerServer) -> GatewayServer:
    """A gateway on a free port, without an API key."""
    config = GatewayConfig(broker=broker.address, checkpoint=checkpoint, port=0, api_key="")
    server = GatewayServer(config)
    await server.start()
    return server


@functools.cache
def _kept_channel(address: str, security: Security) -> grpc.aio.Channel:
    """One channel per address, kept: a stub does not keep its channel alive, and
    with the cluster token its calls start in a task, after a bare channel is gone."""
    return channel(address, security)


def _channel(address: str) -> grpc.aio.Channel:
    return _kept_channel(address, current())


@contextlib.asynccontextmanager
async def backend(
    checkpoint: Path, triton: TritonServer, **language_overrides: Any
) -> AsyncIterator[tuple[BrokerServer, EncoderServer, LanguageServer]]:
    """A broker, an encoder and a language instance (shared memory between them)."""
    broker = await start_broker()
    encoder = await start_encoder(checkpoint, triton, broker)
    language = await start_language(
        checkpoint, broker, transports=(Transport.SHM,), **language_overrides
    )
    try:
        yield broker, encoder, language
    finally:
        for server in (language, encoder, broker):
            await server.stop()


def encoder_stub(server: EncoderServer) -> encoder_pb2_grpc.EncoderStub:
    return encoder_stub_at(server.address)


def encoder_stub_at(address: str) -> encoder_pb2_grpc.EncoderStub:
    return encoder_pb2_grpc.EncoderStub(_channel(address))


def language_stub(server: LanguageServer) -> language_pb2_grpc.LanguageStub:
    return language_pb2_grpc.LanguageStub(_channel(server.address))


def broker_stub(server: BrokerServer) -> broker_pb2_grpc.BrokerStub:
    return broker_pb2_grpc.BrokerStub(_channel(server.address))


async def status_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
