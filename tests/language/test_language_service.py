"""The language service over gRPC with the whole back end: tritonserver, the
broker, the encoder; embeddings reach the engine through the real receiver."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from services.broker.server import BrokerServer
from services.encoder.server import EncoderServer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.processor import ImageTokenRule
from services.proto import common_pb2, encoder_pb2, language_pb2
from services.triton.launcher import TritonServer
from services.wire.transport import Transport
from tests.reference import chat, hf_greedy, on_a_thread
from tests.reflection import list_services, server_streaming_json
from tests.stack import (
    backend,
    encoder_stub,
    language_stub,
    start_language,
)
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(
    tiny_checkpoint: Path, triton: TritonServer
) -> AsyncIterator[tuple[BrokerServer, EncoderServer, LanguageServer]]:
    async with backend(tiny_checkpoint, triton) as servers:
        yield servers


def proto_messages(text: str, hints: list[int]) -> list[language_pb2.ChatMessage]:
    parts = [language_pb2.ContentPart(image=language_pb2.ImagePart(token_hint=h)) for h in hints]
    parts.append(language_pb2.ContentPart(text=text))
    return [language_pb2.ChatMessage(role="user", content=parts)]


async def awaiting_embeddings(language: LanguageServer, request_id: str) -> Any:
    """A Generate with one image whose encoder call never comes, once it waits
    in the receiver (cancel it to end it)."""
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id=request_id,
            messages=proto_messages("hi", [64]),
            sampling=common_pb2.SamplingParams(max_tokens=5),
        )
    )
    await until(lambda: request_id in language.receiver.transfers)
    return call


def hints_for(checkpoint: Path, images: list[bytes]) -> list[int]:
    from PIL import Image

    rule = ImageTokenRule.from_checkpoint(checkpoint)
    return [rule.num_tokens(*Image.open(io.BytesIO(d)).size[::-1]) for d in images]


async def generate(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    checkpoint: Path,
    request_id: str,
    text: str,
    images: list[bytes],
    sampling: common_pb2.SamplingParams,
    language: LanguageServer | None = None,
) -> list[language_pb2.GenerateResponse]:
    """What the gateway does: Encode and Generate concurrently."""
    broker, encoder, default_language = stack
    language = language or default_language
    hints = hints_for(checkpoint, images)
    calls: list[Any] = []
    if images:  # routed to this pair, as the gateway's Route does
        broker.broker.rendezvous.route(request_id, encoder.instance_id, language.instance_id)
        calls.append(
            encoder_stub(encoder).Encode(
                encoder_pb2.EncodeRequest(
                    request_id=request_id,
                    images=images,
                    language_instance_id=language.instance_id,
                )
            )
        )

    async def stream() -> list[language_pb2.GenerateResponse]:
        call = language_stub(language).Generate(
            language_pb2.GenerateRequest(
                request_id=request_id, messages=proto_messages(text, hints), sampling=sampling
            )
        )
        return [r async for r in call]

    results = await asyncio.gather(stream(), *calls)
    return results[0]


def token_ids(responses: list[language_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def pil(data: list[bytes]) -> list[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(d)).convert("RGB") for d in data]


CASES = [
    ("Hello! How are you?", 0, 12),
    ("Describe this image.", 1, 16),
    ("Compare the three pictures.", 3, 10),
]


@pytest.mark.parametrize(
    ("text", "num_images", "max_tokens"), CASES, ids=["text", "1-image", "3-images"]
)
async def test_generate_equals_hf(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    text: str,
    num_images: int,
    max_tokens: int,
) -> None:
    images = [
        encode_image(random_image(200 + 30 * i, 180 + 20 * i, seed=i + 50))
        for i in range(num_images)
    ]
    responses = await generate(
        stack,
        tiny_checkpoint,
        f"gen-{num_images}",
        text,
        images,
        common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    expected = await on_a_thread(
        hf_greedy, tiny_checkpoint, chat(text, num_images), pil(images), max_tokens
    )
    assert token_ids(responses) == expected
    complete = responses[-1].complete
    assert complete.completion_tokens == len(expected)
    assert complete.finish_reason in (
        language_pb2.FINISH_REASON_STOP,
        language_pb2.FINISH_REASON_LENGTH,
    )
    assert complete.image_tokens == sum(hints_for(tiny_checkpoint, images))


async def test_top_logprobs_alone_asks_for_logprobs(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    """proto3 has no unset bool: top_logprobs > 0 with logprobs left false still
    returns each token's logprob and its alternatives (as OpenAI's legacy form)."""
    responses = await generate(
        stack,
        tiny_checkpoint,
        "top-logprobs-alone",
        "Hello",
        [],
        common_pb2.SamplingParams(max_tokens=3, top_logprobs=2, ignore_eos=True),
    )
    logprobs = [lp for r in responses if r.HasField("chunk") for lp in r.chunk.logprobs]
    assert len(logprobs) == 3
    assert all(len(lp.top) == 2 for lp in logprobs)


async def test_eight_concurrent_mixed_requests_on_a_small_kv_cache(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    broker, _, _ = stack
    # 14 pages of 16 tokens: the eight cannot all fit at once. Whether they overlap
    # enough to preempt depends on arrival timing; test_engine forces preemption
    # deterministically.
    small = await start_language(
        tiny_checkpoint,
        broker,
        transports=(Transport.SHM,),
        engine=EngineConfig(max_model_len=224, kv_cache_bytes=16384 * 14),
    )
    try:
        cases = [
            (f"Request number {i}: " + "tell me more " * (i % 3), i % 3, 6 + 3 * i)
            for i in range(8)
        ]
        all_images = [
            [encode_image(random_image(84 + 28 * j, 84, seed=100 * i + j)) for j in range(n)]
            for i, (_, n, _) in enumerate(cases)
        ]
        results = await asyncio.gather(
            *(
                generate(
                    stack,
                    tiny_checkpoint,
                    f"mix-{i}",
                    text,
                    all_images[i],
                    common_pb2.SamplingParams(max_tokens=m),
                    language=small,
                )
                for i, (text, _, m) in enumerate(cases)
            )
        )
        for i, (text, n, m) in enumerate(cases):
            assert token_ids(results[i]) == await on_a_thread(
                hf_greedy, tiny_checkpoint, chat(text, n), pil(all_images[i]), m
            )
        assert small.engine.engine.blocks.num_used_pages == 0
        assert small.pool.allocator.num_used_blocks == 0
    finally:
        await small.stop()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (common_pb2.SamplingParams(max_tokens=5000), "exceeds the context length"),
        (common_pb2.SamplingParams(temperature=-1), "temperature must be >= 0"),
        (common_pb2.SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (common_pb2.SamplingParams(top_logprobs=50), "top_logprobs must be in [0, 20]"),
    ],
)
async def test_bad_requests_are_invalid_argument(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    sampling: common_pb2.SamplingParams,
    message: str,
) -> None:
    _, _, language = stack
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id="bad", messages=proto_messages("hi", []), sampling=sampling
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


async def test_prompt_over_the_context_length(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
) -> None:
    _, _, language = stack
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id="long",
            messages=proto_messages("word " * 3000, []),
            sampling=common_pb2.SamplingParams(max_tokens=1),
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context length of 2048 tokens" in info.value.details()


async def test_cancelled_generate_frees_everything(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
) -> None:
    _, _, language = stack
    # A request with an image whose encoder call never comes: cancelled while receiving.
    waiting = await awaiting_embeddings(language, "cancel-receiving")
    assert language.pool.allocator.num_used_blocks > 0
    waiting.cancel()
    # A long text-only request, cancelled mid-stream.
    streaming = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id="cancel-decoding",
            messages=proto_messages("Tell me everything.", []),
            sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
        )
    )
    async for response in streaming:
        if response.HasField("chunk"):
            break
    streaming.cancel()
    await until(
        lambda: (
            language.pool.allocator.num_used_blocks == 0
            and language.engine.engine.blocks.num_used_pages == 0
            and not language.engine.engine.requests
        )
    )
    language.pool.allocator.check_integrity()
    language.engine.engine.blocks.allocator.check_integrity()


async def test_the_engine_is_told_while_requests_await_their_embeddings(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    """Pacing.encoding (its steps' threads: EngineConfig.threads_while_encoding)
    is on from the first request awaiting its embeddings to the last one's end,
    whether that one got them or went away; the engine knows when the oldest of
    them came, and how long embeddings took to arrive (Pacing.awaiting_since and
    media_wait_s: the TTFT target's pacing)."""
    _, _, language = stack
    engine = language.engine.engine
    assert not engine.pacing.encoding
    waiting = await awaiting_embeddings(language, "encoding-waits")
    await until(lambda: engine.pacing.encoding)
    oldest = engine.pacing.awaiting_since
    assert oldest is not None and oldest <= time.monotonic()
    image = encode_image(random_image(64, 64, seed=3))
    sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0)
    await generate(stack, tiny_checkpoint, "encoding-served", "What is it?", [image], sampling)
    assert engine.pacing.awaiting_since == oldest  # the first one still waits
    served = language.frontend._media_wait_s
    assert served > 0  # the time the served one's embeddings took
    waiting.cancel()
    await until(lambda: not engine.pacing.encoding)
    assert engine.pacing.media_wait_s == served  # the one cancelled does not count


async def test_abort_rpc_ends_the_stream(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
) -> None:
    _, _, language = stack
    stub = language_stub(language)
    call = stub.Generate(
        language_pb2.GenerateRequest(
            request_id="to-abort",
            messages=proto_messages("Go on forever.", []),
            sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
        )
    )
    responses = []
    async for response in call:
        responses.append(response)
        if len(responses) == 2:
            reply = await stub.Abort(language_pb2.AbortRequest(request_id="to-abort"))
            assert reply.found
    assert responses[-1].complete.finish_reason == language_pb2.FINISH_REASON_ABORT
    assert language.engine.engine.blocks.num_used_pages == 0


async def test_grpcurl_generate_and_metrics(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
) -> None:
    import urllib.request

    _, _, language = stack
    assert "epd.v1.Language" in await asyncio.to_thread(list_services, language.address)
    replies = await asyncio.to_thread(
        server_streaming_json,
        language.address,
        "epd.v1.Language/Generate",
        {
            "requestId": "json",
            "messages": [{"role": "user", "content": [{"text": "Hello"}]}],
            "sampling": {"maxTokens": 4},
        },
    )
    assert "complete" in replies[-1]
    assert replies[-1]["complete"]["completionTokens"] == 4
    again = {"requestId": "json-again", "messages": [{"role": "user", "content": [{"text": "Hi"}]}]}
    await asyncio.to_thread(
        server_streaming_json, language.address, "epd.v1.Language/Generate", again
    )
    url = f"http://127.0.0.1:{language.grpc.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in (
        "epd_language_running_requests",
        "epd_language_waiting_requests",
        "epd_language_kv_blocks_used",
        "epd_language_generated_tokens_total",
        "epd_language_ttft_seconds_bucket",
        "epd_language_tpot_seconds_bucket",
    ):
        assert name in text
    # the second request began with the first's system prompt: its pages were cached
    hits = text.split('\nepd_language_prefix_cache_hit_tokens_total{kind="text"} ')[1].split()[0]
    assert float(hits) >= language.engine.engine.blocks.page_size
    steps = {
        kind: float(text.split(f'epd_language_step_seconds_count{{kind="{kind}"}} ')[1].split()[0])
        for kind in ("prefill", "decode")
    }
    assert steps["prefill"] >= 1 and steps["decode"] >= 3  # this request's, at least


async def test_a_duplicate_request_id_is_refused_and_the_first_goes_on(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
) -> None:
    _, _, language = stack
    stub = language_stub(language)

    def generate_dup(max_tokens: int) -> Any:
        return stub.Generate(
            language_pb2.GenerateRequest(
                request_id="dup",
                messages=proto_messages("Go on.", []),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
        )

    first = generate_dup(300)
    responses = [await anext(aiter(first))]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in generate_dup(5):
            pass
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup' is already in flight" in info.value.details()
    responses += [r async for r in first]
    assert len(token_ids(responses)) == 300
    assert responses[-1].complete.finish_reason == language_pb2.FINISH_REASON_LENGTH


async def test_requests_beyond_the_admission_limit_are_refused_fast(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    broker, _, _ = stack
    limited = await start_language(
        tiny_checkpoint, broker, transports=(Transport.SHM,), max_active_requests=2
    )
    stub = language_stub(limited)

    def long(request_id: str, max_tokens: int = 400) -> Any:
        return stub.Generate(
            language_pb2.GenerateRequest(
                request_id=request_id,
                messages=proto_messages("Keep going.", []),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
        )

    try:
        busy = [long("busy-0"), long("busy-1")]
        for call in busy:
            await anext(aiter(call))
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in long("one-too-many"):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert asyncio.get_running_loop().time() - started < 1
        for call in busy:
            call.cancel()
        await until(lambda: not limited.engine.engine.requests)
        assert token_ids([r async for r in long("after", 3)])
    finally:
        await limited.stop()
