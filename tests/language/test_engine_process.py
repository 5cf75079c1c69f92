"""The language service with its engine in a child process (EngineProcess,
`epd language`'s default on a CPU): outputs equal HF's through the real stack,
alone and concurrently; a seed and a JSON schema across the pipe; bad input
refused before it crosses; cancelled and aborted requests free the child's KV
pages; and a killed engine process fails its requests with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.broker.server import BrokerServer
from services.encoder.server import EncoderServer
from services.language.engine.config import EngineConfig
from services.language.engine.process import EngineProcess
from services.language.engine.request import SamplingParams
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.proto import common_pb2, language_pb2
from services.triton.launcher import TritonServer
from services.wire.transport import Transport
from tests.language.engine_fixtures import make_engine, make_request, run_to_completion, tokens
from tests.language.test_language_service import (
    CASES,
    awaiting_embeddings,
    generate,
    pil,
    proto_messages,
    token_ids,
)
from tests.reference import chat, hf_greedy, on_a_thread
from tests.stack import backend, language_stub, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

Stack = tuple[BrokerServer, EncoderServer, LanguageServer]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[Stack]:
    async with backend(tiny_checkpoint, triton, engine_process=True) as servers:
        assert isinstance(servers[2].engine, EngineProcess)
        yield servers


def _images(n: int, seed: int) -> list[bytes]:
    return [encode_image(random_image(200 + 30 * i, 180, seed=seed + i)) for i in range(n)]


async def _idle(language: LanguageServer) -> None:
    """Every request gone from the child, its KV pages free again."""
    await until(
        lambda: language.engine.num_requests == 0 and language.engine.load.kv_pages_used == 0
    )


@pytest.mark.parametrize(
    ("text", "num_images", "max_tokens"), CASES, ids=["text", "1-image", "3-images"]
)
async def test_generate_equals_hf(
    stack: Stack, tiny_checkpoint: Path, text: str, num_images: int, max_tokens: int
) -> None:
    images = _images(num_images, 50)
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    responses = await generate(stack, tiny_checkpoint, f"p-{num_images}", text, images, sampling)
    expected = await on_a_thread(
        hf_greedy, tiny_checkpoint, chat(text, num_images), pil(images), max_tokens
    )
    assert token_ids(responses) == expected
    assert responses[-1].complete.completion_tokens == len(expected)


async def test_concurrent_requests_each_equal_hf(stack: Stack, tiny_checkpoint: Path) -> None:
    cases = [(f"Request {i}: tell me more", i % 3, 5 + 2 * i) for i in range(6)]
    images = [_images(n, 10 * i) for i, (_, n, _) in enumerate(cases)]
    results = await asyncio.gather(
        *(
            generate(
                stack,
                tiny_checkpoint,
                f"c-{i}",
                text,
                images[i],
                common_pb2.SamplingParams(max_tokens=m),
            )
            for i, (text, _, m) in enumerate(cases)
        )
    )
    for i, (text, n, m) in enumerate(cases):
        expected = await on_a_thread(hf_greedy, tiny_checkpoint, chat(text, n), pil(images[i]), m)
        assert token_ids(results[i]) == expected, f"request {i}"
    await _idle(stack[2])


async def test_a_seed_draws_what_it_draws_in_this_process(
    stack: Stack, tiny_checkpoint: Path
) -> None:
    """The generator is rebuilt from the seed in the child: the same tokens as an
    engine here, with the same seed."""
    text, max_tokens = "Pick some words", 12
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=7)
    responses = await generate(stack, tiny_checkpoint, "seeded", text, [], sampling)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=7)
    request = make_request(tiny_checkpoint, "here", chat(text, 0), [], params)
    here = tokens(run_to_completion(make_engine(tiny_checkpoint), [request])["here"])
    assert token_ids(responses) == here


async def test_a_json_schema_crosses_compiled(stack: Stack, tiny_checkpoint: Path) -> None:
    """The grammar compiled here, serialized across, followed there."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    sampling = common_pb2.SamplingParams(max_tokens=64, json_schema=json.dumps(schema))
    responses = await generate(stack, tiny_checkpoint, "schema", "A number", [], sampling)
    text = "".join(r.chunk.text for r in responses if r.HasField("chunk"))
    if responses[-1].complete.finish_reason == language_pb2.FINISH_REASON_STOP:
        assert isinstance(json.loads(text)["n"], int)
    else:  # cut by max_tokens: still a prefix the grammar allows
        assert text.startswith('{"n":')


async def test_bad_requests_are_refused_before_they_cross(stack: Stack) -> None:
    language = stack[2]
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id="too-long",
            messages=proto_messages("hi", []),
            sampling=common_pb2.SamplingParams(max_tokens=5000),
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the context length" in (info.value.details() or "")


def _endless(request_id: str) -> language_pb2.GenerateRequest:
    """A text request that runs until it is stopped."""
    return language_pb2.GenerateRequest(
        request_id=request_id,
        messages=proto_messages("Tell me everything.", []),
        sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
    )


async def test_cancelled_and_aborted_requests_free_the_childs_pages(stack: Stack) -> None:
    language = stack[2]
    stub = language_stub(language)
    streaming = stub.Generate(_endless("cancel-me"))
    async for response in streaming:
        if response.HasField("chunk"):
            break
    assert language.engine.load.kv_pages_used > 0
    streaming.cancel()
    await _idle(language)
    aborted = stub.Generate(_endless("abort-me"))
    responses = []
    async for response in aborted:
        responses.append(response)
        if len(responses) == 2:
            assert (await stub.Abort(language_pb2.AbortRequest(request_id="abort-me"))).found
    assert responses[-1].complete.finish_reason == language_pb2.FINISH_REASON_ABORT
    await _idle(language)


async def test_a_killed_engine_process_fails_its_requests(
    stack: Stack, tiny_checkpoint: Path
) -> None:
    """Its streams end with UNAVAILABLE (another instance may take what it had
    not answered), new ones too, and the server is told (`epd language` leaves,
    to be restarted)."""
    lost = asyncio.Event()
    language = await start_language(
        tiny_checkpoint, stack[0], engine_process=True, on_engine_lost=lost.set
    )
    try:
        engine = language.engine
        assert isinstance(engine, EngineProcess)
        stub = language_stub(language)
        call = stub.Generate(_endless("doomed"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                if response.HasField("chunk"):
                    os.kill(engine._process.pid, signal.SIGKILL)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(lost.wait(), 5)
        after = stub.Generate(
            language_pb2.GenerateRequest(
                request_id="after",
                messages=proto_messages("hi", []),
                sampling=common_pb2.SamplingParams(max_tokens=2),
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in after:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await language.stop()


async def test_its_steps_run_on_fewer_threads_while_requests_await_embeddings(
    stack: Stack, tiny_checkpoint: Path
) -> None:
    """threads_while_encoding across the pipe: while a request waits for its
    embeddings the child steps on that many threads (epd_language_engine_threads),
    then on all of them again."""
    broker = stack[0]
    engine = EngineConfig(max_model_len=2048, kv_cache_bytes=64 << 20, threads_while_encoding=1)
    language = await start_language(
        tiny_checkpoint, broker, engine=engine, engine_process=True, transports=(Transport.SHM,)
    )

    def threads() -> float:
        return float(language.metrics.engine_threads._value.get())

    sampling = common_pb2.SamplingParams(max_tokens=3)
    try:
        await generate(stack, tiny_checkpoint, "all-threads", "Hello", [], sampling, language)
        every = threads()
        assert every > 1
        waiting = await awaiting_embeddings(language, "never-encoded")
        await generate(stack, tiny_checkpoint, "one-thread", "Hello", [], sampling, language)
        assert threads() == 1
        waiting.cancel()
        await until(lambda: language.receiver.transfers == {})
        await generate(stack, tiny_checkpoint, "all-again", "Hello", [], sampling, language)
        assert threads() == every
    finally:
        await language.stop()
