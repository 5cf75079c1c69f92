"""The gRPC twin of the gateway's bad-input table: each internal service refuses
what it cannot take with the right status and a message that says why, fast,
and serves the next request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from services.broker.server import BrokerServer
from services.encoder.server import EncoderServer
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.proto import broker_pb2, common_pb2, encoder_pb2, language_pb2
from services.triton.launcher import TritonServer
from tests.stack import (
    backend,
    broker_stub,
    encoder_stub,
    language_stub,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")

Stack = tuple[BrokerServer, EncoderServer, LanguageServer]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[Stack]:
    async with backend(tiny_checkpoint, triton) as servers:
        yield servers


def _messages(text: str = "hi", hints: tuple[int, ...] = ()) -> list[language_pb2.ChatMessage]:
    parts = [language_pb2.ContentPart(image=language_pb2.ImagePart(token_hint=h)) for h in hints]
    parts.append(language_pb2.ContentPart(text=text))
    return [language_pb2.ChatMessage(role="user", content=parts)]


def _generate(request_id: str = "bad", **fields: Any) -> language_pb2.GenerateRequest:
    request = {"request_id": request_id, "messages": _messages(), **fields}
    return language_pb2.GenerateRequest(**request)


def _sampling(**fields: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


PNG = encode_image(random_image(64, 64, seed=5))

GENERATE = [
    ("no request id", _generate(request_id=""), "request_id is required"),
    ("no messages", _generate(messages=[]), "messages must not be empty"),
    ("unknown role", _generate(messages=[language_pb2.ChatMessage(role="robot")]), "unknown role 'robot'"),
    ("a token hint of 2^32 - 1", _generate(messages=_messages(hints=(4294967295,))), "token_hint 4294967295 exceeds 1280"),
    ("hints over the context", _generate(messages=_messages(hints=(1000, 1000, 1000))), "exceed the context length of 2048"),
    ("negative temperature", _generate(sampling=_sampling(temperature=-1)), "temperature must be >= 0"),
    ("temperature NaN", _generate(sampling=_sampling(temperature=float("nan"))), "temperature must be >= 0"),
    ("top_p 1.5", _generate(sampling=_sampling(top_p=1.5)), "top_p must be in (0, 1]"),
    ("negative top_k", _generate(sampling=_sampling(top_k=-3)), "top_k must be >= 0"),
    ("top_logprobs 50", _generate(sampling=_sampling(top_logprobs=50)), "top_logprobs must be in [0, 20]"),
    ("an empty stop string", _generate(sampling=_sampling(stop=[""])), "stop strings must not be empty"),
    ("max_tokens over the context", _generate(sampling=_sampling(max_tokens=5000)), "exceeds the context length"),
    ("prompt over the context", _generate(messages=_messages("word " * 3000)), "context length of 2048 tokens"),
]  # fmt: skip

ENCODE = [
    ("no images", encoder_pb2.EncodeRequest(), grpc.StatusCode.INVALID_ARGUMENT, "no images to encode"),
    ("too many images", encoder_pb2.EncodeRequest(images=[PNG] * 17), grpc.StatusCode.INVALID_ARGUMENT, "too many images: 17"),
    ("not an image", encoder_pb2.EncodeRequest(images=[b"garbage"]), grpc.StatusCode.INVALID_ARGUMENT, "image 0: not a valid image"),
    ("a target without a request id", encoder_pb2.EncodeRequest(images=[PNG], language_instance_id="x"), grpc.StatusCode.INVALID_ARGUMENT, "request_id is required"),
    ("an unknown target", encoder_pb2.EncodeRequest(request_id="r", images=[PNG], language_instance_id="nobody"), grpc.StatusCode.NOT_FOUND, "'nobody' is not registered"),
]  # fmt: skip


async def _status(call: Any) -> tuple[grpc.StatusCode, str, float]:
    started = asyncio.get_running_loop().time()
    try:
        result = await call if not hasattr(call, "__aiter__") else [r async for r in call]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", asyncio.get_running_loop().time() - started
    raise AssertionError(f"accepted: {result}")


async def _serves(stack: Stack) -> None:
    replies = [
        r
        async for r in language_stub(stack[2]).Generate(
            _generate("ok", sampling=_sampling(max_tokens=2))
        )
    ]
    assert replies[-1].HasField("complete")


@pytest.mark.parametrize(("name", "request_", "message"), GENERATE, ids=[c[0] for c in GENERATE])
async def test_language_generate(stack: Stack, name: str, request_: Any, message: str) -> None:
    code, details, seconds = await _status(language_stub(stack[2]).Generate(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    assert seconds < 1
    await _serves(stack)


@pytest.mark.parametrize(
    ("name", "request_", "code", "message"), ENCODE, ids=[c[0] for c in ENCODE]
)
async def test_encoder_encode(
    stack: Stack, name: str, request_: Any, code: grpc.StatusCode, message: str
) -> None:
    got, details, _ = await _status(encoder_stub(stack[1]).Encode(request_))
    assert (got, message in details) == (code, True), details
    assert (
        await encoder_stub(stack[1]).Encode(encoder_pb2.EncodeRequest(images=[PNG]))
    ).total_tokens


def _attach(first: broker_pb2.PeerMessage) -> Callable[[BrokerServer], Any]:
    async def messages() -> AsyncIterator[broker_pb2.PeerMessage]:
        yield first

    return lambda broker: broker_stub(broker).Attach(messages())


BROKER = [
    ("attach without registering", _attach(broker_pb2.PeerMessage(heartbeat=broker_pb2.Heartbeat())), grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register"),
    ("register without an id", _attach(broker_pb2.PeerMessage(register=broker_pb2.Register(role=common_pb2.ROLE_ENCODER))), grpc.StatusCode.INVALID_ARGUMENT, "instance_id is empty"),
    ("a language without a pool", _attach(broker_pb2.PeerMessage(register=broker_pb2.Register(role=common_pb2.ROLE_LANGUAGE, instance_id="l"))), grpc.StatusCode.INVALID_ARGUMENT, "must register its pool"),
    ("route an unknown model", lambda b: broker_stub(b).Route(broker_pb2.RouteRequest(model="gpt-9")), grpc.StatusCode.UNAVAILABLE, "no language instance serves model 'gpt-9'"),
    ("describe an unknown request", lambda b: broker_stub(b).DescribeRequest(broker_pb2.DescribeRequestRequest(request_id="?")), grpc.StatusCode.NOT_FOUND, "is not known to the broker"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "code", "message"), BROKER, ids=[c[0] for c in BROKER])
async def test_broker(
    stack: Stack,
    name: str,
    call: Callable[[BrokerServer], Any],
    code: grpc.StatusCode,
    message: str,
) -> None:
    got, details, _ = await _status(call(stack[0]))
    assert (got, message in details) == (code, True), details
    await _serves(stack)


async def test_push_embeddings_for_an_unknown_request(stack: Stack) -> None:
    async def chunks() -> AsyncIterator[language_pb2.EmbeddingChunk]:
        yield language_pb2.EmbeddingChunk(request_id="nobody", num_tokens=1)

    code, details, _ = await _status(language_stub(stack[2]).PushEmbeddings(chunks()))
    assert code == grpc.StatusCode.NOT_FOUND and "'nobody' is not receiving" in details
