"""The gateway in front of a real back end (Triton, broker, encoder, language),
shared by the gateway's test modules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from services.gateway.server import GatewayConfig, GatewayServer
from services.language.engine.config import EngineConfig
from services.triton.launcher import TritonServer
from services.wire.transport import Transport
from tests.stack import start_broker, start_encoder, start_language

MAX_BODY_BYTES = 4 * 1024 * 1024


@pytest_asyncio.fixture(loop_scope="session", scope="package")
async def gateway(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[GatewayServer]:
    broker = await start_broker()
    encoder = await start_encoder(tiny_checkpoint, triton, broker)
    language = await start_language(
        tiny_checkpoint,
        broker,
        transports=(Transport.SHM,),
        engine=EngineConfig(max_model_len=1024, kv_cache_bytes=32 << 20),  # tools take ~450
    )
    server = GatewayServer(
        GatewayConfig(
            broker=broker.address,
            checkpoint=tiny_checkpoint,
            port=0,
            api_key="sesame",
            max_body_bytes=MAX_BODY_BYTES,
        )
    )
    await server.start()
    yield server
    await server.stop()
    for s in (language, encoder, broker):
        await s.stop()
