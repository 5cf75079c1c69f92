"""E/P/D over gRPC: a prefill and a decode instance attached to a real broker,
the KV pages crossing over each transport; the decode instance streams what an
instance that does both does, token for token, and both give their pages back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.broker.server import BrokerServer
from services.gateway.backend import Backend, GenerateCall
from services.gateway.errors import ApiError
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.proto import broker_pb2, common_pb2, language_pb2
from services.wire.messages import LanguageRole
from services.wire.request import (
    ChatMessage,
    GenerateChunk,
    GenerateRequest,
    PrefillReply,
    SamplingParams,
)
from services.wire.transport import Transport
from tests.stack import broker_stub, language_stub, start_broker, start_language

pytestmark = pytest.mark.asyncio(loop_scope="session")

TRANSPORTS = [Transport.SHM, Transport.NIXL, Transport.GRPC]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def both(tiny_checkpoint: Path) -> AsyncIterator[LanguageServer]:
    server = await start_language(tiny_checkpoint)
    yield server
    await server.stop()


@pytest_asyncio.fixture(loop_scope="session", params=TRANSPORTS, ids=lambda t: t.name.lower())
async def epd(
    request: pytest.FixtureRequest, tiny_checkpoint: Path
) -> AsyncIterator[tuple[BrokerServer, LanguageServer, LanguageServer]]:
    transport: Transport = request.param
    if transport is Transport.NIXL:
        pytest.importorskip("nixl_cu12")
    broker = await start_broker()
    prefill = await start_language(
        tiny_checkpoint, broker, role=LanguageRole.PREFILL, transports=(transport,)
    )
    decode = await start_language(
        tiny_checkpoint, broker, role=LanguageRole.DECODE, transports=(transport,)
    )
    try:
        yield broker, prefill, decode
    finally:
        for server in (decode, prefill, broker):
            await server.stop()


def text_request(request_id: str, text: str, **sampling: object) -> language_pb2.GenerateRequest:
    return language_pb2.GenerateRequest(
        request_id=request_id,
        messages=[
            language_pb2.ChatMessage(role="user", content=[language_pb2.ContentPart(text=text)])
        ],
        sampling=common_pb2.SamplingParams(**sampling),
    )


async def collect(call: grpc.aio.UnaryStreamCall) -> tuple[list[int], str, str]:
    tokens: list[int] = []
    text, finish = "", ""
    async for response in call:
        if response.HasField("chunk"):
            tokens += response.chunk.token_ids
            text += response.chunk.text
        elif response.HasField("complete"):
            finish = language_pb2.FinishReason.Name(response.complete.finish_reason)
    return tokens, text, finish


async def through_epd(
    epd: tuple[BrokerServer, LanguageServer, LanguageServer],
    request: language_pb2.GenerateRequest,
) -> tuple[list[int], str, str]:
    broker, prefill, decode = epd
    route = await broker_stub(broker).Route(
        broker_pb2.RouteRequest(request_id=request.request_id, model="demo-tiny")
    )
    assert (route.language_id, route.decode_id) == (prefill.instance_id, decode.instance_id)
    to_prefill = language_pb2.GenerateRequest()
    to_prefill.CopyFrom(request)
    to_prefill.decode_instance_id = route.decode_id
    to_decode = language_pb2.GenerateRequest()
    to_decode.CopyFrom(request)
    to_decode.prefill_instance_id = route.language_id
    stream = language_stub(decode).Generate(to_decode, timeout=60)
    reply, out = await asyncio.gather(
        language_stub(prefill).Prefill(to_prefill, timeout=60), collect(stream)
    )
    assert reply.num_prompt_tokens > 0
    return out


async def test_list_instances_shows_the_roles(
    epd: tuple[BrokerServer, LanguageServer, LanguageServer],
) -> None:
    broker, prefill, decode = epd
    listed = await broker_stub(broker).ListInstances(broker_pb2.ListInstancesRequest())
    roles = {i.registration.instance_id: i.registration.language_role for i in listed.instances}
    assert roles == {
        prefill.instance_id: common_pb2.LANGUAGE_ROLE_PREFILL,
        decode.instance_id: common_pb2.LANGUAGE_ROLE_DECODE,
    }


async def wait_idle(*servers: LanguageServer) -> None:
    """Every KV page and receive block back (the engines free them on their thread)."""
    for _ in range(200):
        if all(
            s.engine.load.kv_pages_used == 0 and not s.receiver.transfers for s in servers
        ) and not any(s.receiver.quarantine for s in servers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError([(s.engine.load, dict(s.receiver.transfers)) for s in servers])


async def test_decode_streams_what_one_instance_generates(
    epd: tuple[BrokerServer, LanguageServer, LanguageServer], both: LanguageServer
) -> None:
    for i, (text, sampling) in enumerate(
        [
            ("Tell me a story about a cat", {"max_tokens": 24, "ignore_eos": True}),
            ("Hi", {"max_tokens": 1}),
            (
                "Count",
                {"max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True},
            ),
            ("Answer in JSON", {"max_tokens": 16, "json_object": True}),
        ]
    ):
        expected = await collect(
            language_stub(both).Generate(text_request(f"a{i}", text, **sampling))
        )
        got = await through_epd(epd, text_request(f"b{i}", text, **sampling))
        assert got == expected, text
    await wait_idle(epd[1], epd[2])
    _, prefill, decode = epd
    transport = prefill.config.instance.transports[0].name.lower()
    for server, direction in ((prefill, "sent"), (decode, "received")):
        pages = server.metrics.kv_transfer_pages.labels(direction, transport)._value.get()
        handoffs = server.metrics.kv_transfer_seconds.labels(direction, transport)._sum.get()
        assert pages >= 3 and handoffs > 0, (direction, transport)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def small_pools(
    tiny_checkpoint: Path,
) -> AsyncIterator[tuple[BrokerServer, LanguageServer, LanguageServer]]:
    """E/P/D over shm with a short wait for pages: for the faults."""
    broker = await start_broker()
    prefill = await start_language(
        tiny_checkpoint, broker, role=LanguageRole.PREFILL, transports=(Transport.SHM,)
    )
    decode = await start_language(
        tiny_checkpoint,
        broker,
        role=LanguageRole.DECODE,
        transports=(Transport.SHM,),
        pool_wait_s=0.5,
    )
    try:
        yield broker, prefill, decode
    finally:
        for server in (decode, prefill, broker):
            await server.stop()


def call(request_id: str, text: str, max_tokens: int = 8) -> GenerateCall:
    message = ChatMessage("user", (text,))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return GenerateCall(GenerateRequest(request_id, (message,), sampling), "demo-tiny")


async def drain(backend: Backend, request: GenerateCall) -> list[int]:
    tokens: list[int] = []
    async for response in backend.generate(request):
        if isinstance(response.kind, GenerateChunk):
            tokens += response.kind.token_ids
    return tokens


async def test_a_decode_instance_without_free_pages_answers_503_and_nothing_leaks(
    small_pools: tuple[BrokerServer, LanguageServer, LanguageServer],
) -> None:
    broker, prefill, decode = small_pools
    backend = Backend(broker.address, max_failovers=0)
    page = decode.engine.engine.blocks.page_size
    held = await decode.engine.reserve_pages(decode.engine.num_kv_pages * page, 5)
    try:
        with pytest.raises(ApiError) as failed:
            await drain(backend, call("full", "Tell me a story"))
        assert failed.value.status == 503
        assert "no free KV pages" in failed.value.message
    finally:
        decode.engine.free_pages(held)
    await wait_idle(prefill, decode)
    assert await drain(backend, call("room-again", "Tell me a story"))  # serving goes on
    await wait_idle(prefill, decode)
    await backend.close()


async def test_a_client_that_leaves_during_the_hand_off_leaks_nothing(
    small_pools: tuple[BrokerServer, LanguageServer, LanguageServer],
) -> None:
    """Cancelled at every moment from routing to the first token: both pools whole."""
    broker, prefill, decode = small_pools
    backend = Backend(broker.address)
    prompt = "Describe the sea at night, wave after wave. " * 20  # a prefill that takes a while
    for i, delay in enumerate((0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4)):
        task = asyncio.ensure_future(drain(backend, call(f"leaves-{i}", prompt, 64)))
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_idle(prefill, decode)
    assert len(await drain(backend, call("stays", "Hi", 4))) == 4
    await backend.close()


async def test_a_prefill_instance_lost_after_the_hand_off_ends_nothing(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode instance streams once it holds the KV pages: a prefill instance
    that goes away after handing them over (its Prefill answer lost) no longer
    concerns the request, which completes as it would have."""
    broker = await start_broker()
    prefill = await start_language(
        tiny_checkpoint, broker, role=LanguageRole.PREFILL, transports=(Transport.SHM,)
    )
    decode = await start_language(
        tiny_checkpoint, broker, role=LanguageRole.DECODE, transports=(Transport.SHM,)
    )
    backend = Backend(broker.address, max_failovers=0)
    handed_over = prefill.frontend.prefill

    async def hands_over_then_hangs(request: GenerateRequest) -> PrefillReply:
        await handed_over(request)
        await asyncio.Event().wait()  # until the instance goes away
        raise AssertionError("unreachable")

    try:
        expected = await drain(backend, call("whole", "Tell me a story", 16))
        monkeypatch.setattr(prefill.frontend, "prefill", hands_over_then_hangs)
        tokens: list[int] = []
        async for response in backend.generate(call("lost", "Tell me a story", 16)):
            if not tokens:
                await prefill.stop()
            if isinstance(response.kind, GenerateChunk):
                tokens += response.kind.token_ids
        assert tokens == expected
        await wait_idle(decode)
    finally:
        await backend.close()
        for server in (decode, prefill, broker):
            await server.stop()


@pytest.mark.gpu
async def test_kv_pages_over_cuda_ipc(tiny_checkpoint: Path) -> None:
    """On a GPU: the decode instance's KV cache exported by CUDA IPC, the prefill
    instance copying device to device; the same tokens as one instance there."""
    engine = EngineConfig(max_model_len=2048, kv_cache_bytes=64 << 20, device="cuda")
    broker = await start_broker()
    servers = [await start_language(tiny_checkpoint, engine=engine)]
    for role in (LanguageRole.PREFILL, LanguageRole.DECODE):
        servers.append(
            await start_language(
                tiny_checkpoint, broker, engine, role=role, transports=(Transport.CUDA_IPC,)
            )
        )
    both, prefill, decode = servers
    try:
        request = text_request("g", "Tell me a story about a cat", max_tokens=24, ignore_eos=True)
        expected = await collect(language_stub(both).Generate(request))
        request.request_id = "g-epd"
        assert await through_epd((broker, prefill, decode), request) == expected
        await wait_idle(prefill, decode)
    finally:
        for server in (*servers, broker):
            await server.stop()
