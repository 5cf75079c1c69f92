"""Language.GenerateStream, the gateway's many Generate calls on one stream
(services/gateway/streams.py its client), against a real language instance:
each request is served as its own Generate call would be (the same tokens, the
same statuses), a step's responses travel in one message, and a call that is
cancelled, times out or reaches a stopping instance ends cleanly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.broker import instance
from services.broker.server import BrokerServer
from services.gateway.streams import GenerateStreams, StreamedCall
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.proto import common_pb2, language_pb2
from services.wire.convert import from_proto
from services.wire.request import GenerateChunk, GenerateComplete, GenerateRequest, GenerateResponse
from services.wire.transport import Transport
from tests.language.test_language_service import proto_messages, token_ids
from tests.reference import chat, hf_greedy, on_a_thread
from tests.stack import _channel, language_stub, start_broker, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def start(checkpoint: Path, broker: BrokerServer) -> LanguageServer:
    return await start_language(
        checkpoint,
        broker,
        transports=(Transport.SHM,),
        engine=EngineConfig(max_model_len=512, kv_cache_bytes=32 << 20),
    )


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def language(tiny_checkpoint: Path) -> AsyncIterator[LanguageServer]:
    broker = await start_broker()
    server = await start(tiny_checkpoint, broker)
    yield server
    await server.stop()
    await broker.stop()


def request(
    request_id: str, text: str, max_tokens: int, ignore_eos: bool = False
) -> language_pb2.GenerateRequest:
    return language_pb2.GenerateRequest(
        request_id=request_id,
        messages=proto_messages(text, []),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )


def call(
    streams: GenerateStreams,
    language: LanguageServer,
    req: language_pb2.GenerateRequest,
    timeout_s: float = 60,
) -> StreamedCall:
    typed = from_proto(GenerateRequest, req)
    return streams.call(language.address, _channel(language.address), typed, timeout_s)


async def responses(streamed: StreamedCall) -> list[GenerateResponse]:
    return [r async for r in streamed]


def ids(responses: list[GenerateResponse]) -> list[int]:
    return [t for r in responses if isinstance(r.kind, GenerateChunk) for t in r.kind.token_ids]


def freed(language: LanguageServer) -> bool:
    engine = language.engine.engine
    return (
        not engine.requests and engine.blocks.num_used_pages == 0 and not language.servicer._active
    )


async def test_requests_on_one_stream_get_their_own_tokens_in_batched_messages(
    language: LanguageServer, tiny_checkpoint: Path
) -> None:
    cases = [(f"Tell me about the number {i}.", 6 + 2 * i) for i in range(4)]
    stream = language_stub(language).GenerateStream()
    for i, (text, max_tokens) in enumerate(cases):
        await stream.write(
            language_pb2.GenerateStreamRequest(
                start=language_pb2.GenerateStart(request=request(f"many-{i}", text, max_tokens))
            )
        )
    got: dict[str, list[language_pb2.GenerateResponse]] = {f"many-{i}": [] for i in range(4)}
    ends: dict[str, language_pb2.GenerateEnd] = {}
    messages = 0
    while len(ends) < len(cases):
        batch = await stream.read()
        messages += 1
        for response in batch.responses:
            assert response.request_id not in ends, "a response after its request's end"
            got[response.request_id].append(response)
        ends.update((end.request_id, end) for end in batch.ends)
    stream.cancel()
    for i, (text, max_tokens) in enumerate(cases):
        assert ends[f"many-{i}"].code == grpc.StatusCode.OK.value[0]
        assert token_ids(got[f"many-{i}"]) == await on_a_thread(
            hf_greedy, tiny_checkpoint, chat(text, 0), [], max_tokens
        )
        assert got[f"many-{i}"][-1].HasField("complete")
    total = sum(len(r) for r in got.values())
    assert messages < total / 2, (messages, total)  # a step's tokens of all four travel together


async def test_a_failed_request_ends_with_its_status_and_the_stream_serves_on(
    language: LanguageServer, tiny_checkpoint: Path
) -> None:
    streams = GenerateStreams()
    too_long = call(streams, language, request("too-long", "word " * 600, 4))
    good = call(streams, language, request("beside-it", "Hello there", 5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await responses(too_long)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length" in (info.value.details() or "")
    assert ids(await responses(good)) == await on_a_thread(
        hf_greedy, tiny_checkpoint, chat("Hello there", 0), [], 5
    )
    # a second request under an id in flight is refused; the first goes on
    first = call(streams, language, request("twice", "Count slowly.", 400, ignore_eos=True))
    reading = aiter(first)  # held: an iteration let go of cancels its call
    await anext(reading)
    second = call(GenerateStreams(), language, request("twice", "Again", 3))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await responses(second)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    await until(lambda: freed(language))
    await streams.close()


async def test_a_cancelled_call_frees_everything_and_its_stream_serves_on(
    language: LanguageServer, tiny_checkpoint: Path
) -> None:
    streams = GenerateStreams()
    long = call(streams, language, request("cancel-me", "Go on forever.", 400, ignore_eos=True))
    iterator = aiter(long)
    assert isinstance((await anext(iterator)).kind, GenerateChunk)
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await anext(iterator)
    await until(lambda: freed(language))
    after = call(streams, language, request("after-cancel", "Hi", 4))
    assert ids(await responses(after)) == await on_a_thread(
        hf_greedy, tiny_checkpoint, chat("Hi", 0), [], 4
    )
    await streams.close()


async def test_a_consumer_cancelled_mid_call_cancels_the_request_on_the_instance(
    language: LanguageServer,
) -> None:
    """The gateway's task that reads a call is cancelled (its client left): the
    instance hears it at once, not at the request's end, even if nothing calls
    cancel() after (a decode instance's request would otherwise wait for KV pages
    that never come, holding them, until its transfer timeout)."""
    streams = GenerateStreams()
    long = call(streams, language, request("reader-gone", "Go on forever.", 400, ignore_eos=True))
    ended = language.metrics.requests.labels("length")
    before = ended._value.get()

    async def read() -> None:
        async for _ in long:
            pass

    reader = asyncio.ensure_future(read())
    await until(lambda: language.engine.engine.requests)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await until(lambda: freed(language))
    assert ended._value.get() == before  # cancelled, not run to its 400 tokens
    await streams.close()


async def test_a_call_past_its_deadline_ends_deadline_exceeded_and_is_freed(
    language: LanguageServer,
) -> None:
    streams = GenerateStreams()
    # an image whose embeddings never come: the request waits in the receiver
    waiting = language_pb2.GenerateRequest(
        request_id="no-embeddings",
        messages=proto_messages("What is it?", [64]),
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await responses(call(streams, language, waiting, timeout_s=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2
    await until(lambda: freed(language) and not language.receiver.transfers)
    await streams.close()


async def test_a_stopping_instance_serves_what_the_broker_routed_before_it_heard(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop first tells the broker; a request the broker routed here before it
    heard still arrives for a moment (ROUTED_GRACE_S, held longer here than the
    test's steps take), and is served, not refused."""
    monkeypatch.setattr(instance, "ROUTED_GRACE_S", 3.0)
    broker = await start_broker()
    language = await start(tiny_checkpoint, broker)
    streams = GenerateStreams()
    stopping = None
    try:
        await responses(call(streams, language, request("opens-the-stream", "Hi", 2)))
        stopping = asyncio.ensure_future(language.stop())
        (session,) = broker.broker.registry.sessions()
        await until(lambda: session.load.unavailable)  # the broker heard: it routes here no more
        routed_before = await responses(call(streams, language, request("routed", "Hi", 3)))
        assert isinstance(done := routed_before[-1].kind, GenerateComplete)
        assert done.completion_tokens == 3
        await stopping
    finally:
        await streams.close()
        if stopping is None:
            await language.stop()
        await broker.stop()


async def test_a_stopping_instance_refuses_new_calls_and_ends_the_stream_once_idle(
    tiny_checkpoint: Path,
) -> None:
    broker = await start_broker()
    language = await start(tiny_checkpoint, broker)
    streams = GenerateStreams()
    try:
        running = call(
            streams, language, request("in-flight", "Tell me a story.", 12, ignore_eos=True)
        )
        iterator = aiter(running)
        await anext(iterator)
        language.servicer.drain()
        refused = call(streams, language, request("too-late", "Hi", 3))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await responses(refused)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the gateway fails it over
        rest = [r async for r in iterator]  # what was in flight completes
        assert isinstance(done := rest[-1].kind, GenerateComplete)
        assert done.completion_tokens == 12
        stream = streams._streams.get(language.address)
        await until(lambda: stream is None or stream.closed)
    finally:
        await streams.close()
        await language.stop()
        await broker.stop()
