"""A language instance that fails before it produced anything (dead, or not
reachable: here one the broker lists at an address nobody serves; or one that
cancels the call, as a gRPC server does with a call that arrives while it shuts
down) costs a request nothing: it starts again on another instance. An encoder
that cancels the call (an `epd encoder` told to stop cancels an Encode that
reaches it as its server shuts down) costs nothing either: the images go to
another encoder."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from services.broker.placement import hrw_weight
from services.gateway.backend import Backend
from services.gateway.server import GatewayConfig, GatewayServer
from services.language.engine.config import EngineConfig
from services.loadgen.synthetic import encode_image, random_image
from services.proto import encoder_pb2_grpc, language_pb2_grpc
from services.runtime.ports import free_port
from services.triton.launcher import TritonServer
from services.wire.messages import Register, RouteRequest, media_key
from tests.broker.peers import Peer, attach, encoder, language
from tests.gateway.test_gateway import image_part
from tests.reference import on_a_thread
from tests.stack import MODEL, start_broker, start_encoder, start_language


class _Cancelling(language_pb2_grpc.LanguageServicer):
    """Cancels every call (the gateway's stream of them) before producing anything."""

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")

    async def GenerateStream(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")


class _CancellingEncoder(encoder_pb2_grpc.EncoderServicer):
    """Cancels every Encode, and counts them."""

    def __init__(self) -> None:
        self.calls = 0

    async def Encode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")


@pytest_asyncio.fixture(loop_scope="session", params=["unreachable", "cancelling"])
async def with_a_ghost(
    tiny_checkpoint: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[GatewayServer, Peer]]:
    broker = await start_broker()
    real = await start_language(
        tiny_checkpoint, broker, engine=EngineConfig(max_model_len=512, kv_cache_bytes=32 << 20)
    )
    listed = language("language-ghost", model=MODEL)
    server = grpc.aio.server()
    language_pb2_grpc.add_LanguageServicer_to_server(_Cancelling(), server)
    if request.param == "cancelling":
        nobody = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
    else:
        nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    ghost = await attach(
        broker,
        Register(
            listed.role,
            listed.instance_id,
            nobody,
            listed.host_id,
            listed.transports,
            MODEL,
            listed.pool,
        ),
    )
    gateway = GatewayServer(GatewayConfig(broker=broker.address, port=0))
    await gateway.start()
    yield gateway, ghost
    await gateway.stop()
    await ghost.link.close()
    await server.stop(None)
    await real.stop()
    await broker.stop()


async def test_requests_routed_to_a_failing_instance_start_again_on_another(
    with_a_ghost: tuple[GatewayServer, Peer], caplog: pytest.LogCaptureFixture
) -> None:
    gateway, _ = with_a_ghost
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", max_retries=0)
    with caplog.at_level(logging.INFO):
        for i in range(4):  # the broker spreads them over both instances
            reply = await client.chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"hi {i}"}]
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
    retried = [r for r in caplog.records if "failed before its first token" in r.getMessage()]
    assert retried, "some request was routed to the failing instance"
    served = [r.fields for r in caplog.records if r.name == "epd.requests"]  # type: ignore[attr-defined]
    assert [f["status"] for f in served] == [200] * 4
    languages = {f["language"] for f in served}
    assert len(languages) == 1 and languages != {"language-ghost"}, languages  # the real one


@pytest_asyncio.fixture(loop_scope="session")
async def with_a_cancelling_encoder(
    tiny_checkpoint: Path, triton: TritonServer
) -> AsyncIterator[tuple[GatewayServer, _CancellingEncoder, str]]:
    broker = await start_broker()
    real_language = await start_language(
        tiny_checkpoint, broker, engine=EngineConfig(max_model_len=1024, kv_cache_bytes=32 << 20)
    )
    real_encoder = await start_encoder(tiny_checkpoint, triton, broker)
    cancelling = _CancellingEncoder()
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(cancelling, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    listed = encoder("encoder-ghost", model=MODEL)
    ghost = await attach(
        broker,
        Register(
            listed.role, listed.instance_id, address, listed.host_id, listed.transports, MODEL
        ),
    )
    gateway = GatewayServer(
        GatewayConfig(broker=broker.address, checkpoint=tiny_checkpoint, port=0)
    )
    await gateway.start()
    yield gateway, cancelling, real_encoder.instance_id
    await gateway.stop()
    await ghost.link.close()
    await server.stop(None)
    for s in (real_encoder, real_language, broker):
        await s.stop()


def _seeds(real_id: str) -> list[int]:
    """Images whose rendezvous weight the cancelling encoder wins (two) and the real
    one wins (two): the real encoder's id is new each run, so are its weights."""
    ghost: list[int] = []
    real: list[int] = []
    for seed in range(64):
        key = media_key(encode_image(random_image(200, 160, seed=seed)))
        wins = hrw_weight(key, "encoder-ghost") > hrw_weight(key, real_id)
        (ghost if wins else real).append(seed)
    return ghost[:2] + real[:2]


async def test_images_an_encoder_cancels_go_to_another(
    with_a_cancelling_encoder: tuple[GatewayServer, _CancellingEncoder, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway, cancelling, real_id = with_a_cancelling_encoder
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="-", max_retries=0)
    seeds = await on_a_thread(_seeds, real_id)  # two images the broker places on each encoder
    with caplog.at_level(logging.INFO):
        for i in seeds:
            reply = await client.chat.completions.create(
                model=MODEL,
                max_tokens=4,
                messages=[
                    {"role": "user", "content": [image_part(i), {"type": "text", "text": "?"}]}
                ],
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
    assert cancelling.calls == 2, "the two images it wins were routed to the cancelling encoder"
    failed_over = [r for r in caplog.records if "failing over" in r.getMessage()]
    assert len(failed_over) == cancelling.calls
    served = [r.fields for r in caplog.records if r.name == "epd.requests"]  # type: ignore[attr-defined]
    assert [f["status"] for f in served] == [200] * 4
    assert {f["encoder"] for f in served} != {"encoder-ghost"}


async def test_routing_waits_for_a_broker_that_comes_back() -> None:
    """A broker restarting (here: not yet started on its port) costs a request only
    the wait: the gateway asks it again until it answers, for a few seconds."""
    port = free_port()
    backend = Backend(f"127.0.0.1:{port}")
    routed = asyncio.ensure_future(backend._route(RouteRequest("r", "m")))
    await asyncio.sleep(1.0)
    assert not routed.done()
    broker = await start_broker(port=port)
    peer = await attach(broker, language("back"))
    try:
        assert (await asyncio.wait_for(routed, 10)).language_id == "back"
    finally:
        await peer.link.close()
        await backend.close()
        await broker.stop()
