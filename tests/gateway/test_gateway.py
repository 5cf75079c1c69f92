"""The gateway in front of a real back end (Triton, broker, encoder, language),
checked with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from openai import AsyncOpenAI, AuthenticationError, BadRequestError, NotFoundError

from services.gateway.server import GatewayConfig, GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from services.runtime.ports import free_port
from services.wire.transport import Transport
from tests.stack import MODEL, start_broker, start_encoder, start_language

pytestmark = pytest.mark.asyncio(loop_scope="session")


def client(gateway: GatewayServer, key: str = "sesame") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def image_part(seed: int) -> dict[str, Any]:
    data = base64.b64encode(encode_image(random_image(200, 160, seed=seed))).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


async def test_models_and_health(gateway: GatewayServer) -> None:
    models = await client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient() as http:
        health = await http.get(gateway.url + "/health")
    assert health.status_code == 200
    report = health.json()
    assert report["status"] == "ok"
    roles = sorted((c["role"], c["state"], c["model"]) for c in report["components"].values())
    assert roles == [("encoder", "serving", MODEL), ("language", "serving", MODEL)]


async def test_health_shows_each_encoders_cache_and_queue(gateway: GatewayServer) -> None:
    image = image_part(seed=8100)
    for _ in range(2):  # the second from the cache
        await client(gateway).chat.completions.create(
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}],  # type: ignore[list-item,misc]
        )
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # a heartbeat after the second encode carries it
            components = (await http.get(gateway.url + "/health")).json()["components"]
            (encoder,) = [c for c in components.values() if c["role"] == "encoder"]
            if encoder["hit_ratio"] > 0 and encoder["queue_depth"] == 0:
                break
            await asyncio.sleep(0.05)
    assert encoder["cached_items"] >= 1 and 0 < encoder["hit_ratio"] <= 1
    assert encoder["queue_depth"] == 0  # nothing encoding now
    (language,) = [c for c in components.values() if c["role"] == "language"]
    assert "cached_items" not in language


async def test_api_key_is_required(gateway: GatewayServer) -> None:
    with pytest.raises(AuthenticationError):
        await client(gateway, key="wrong").models.list()


async def test_streaming_chunks_and_usage(gateway: GatewayServer) -> None:
    stream = await client(gateway).chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[
            {"role": "user", "content": [image_part(1), {"type": "text", "text": "What is it?"}]}
        ],
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 8
    assert len({c.id for c in chunks}) == 1


async def test_logprobs_and_stop(gateway: GatewayServer) -> None:
    ai = client(gateway)
    plain = await ai.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": "Tell me a story"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    text = plain.choices[0].message.content
    stop = text[4:7]
    stopped = await ai.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        messages=[{"role": "user", "content": "Tell me a story"}],
    )
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


async def test_seeded_sampling_repeats(gateway: GatewayServer) -> None:
    ai = client(gateway)

    async def sample() -> str:
        reply = await ai.chat.completions.create(
            model=MODEL,
            max_tokens=10,
            temperature=0.8,
            top_p=0.9,
            seed=1234,
            messages=[{"role": "user", "content": "Pick words"}],
        )
        return reply.choices[0].message.content or ""

    assert await sample() == await sample()


BAD = [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (
        {"model": MODEL, "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]},
        400,
        "max_tokens",
    ),
    (
        {"model": MODEL, "temperature": 3, "messages": [{"role": "user", "content": "x"}]},
        400,
        "temperature",
    ),
    ({"model": MODEL, "n": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "n"),
    (
        {"model": MODEL, "top_logprobs": 2, "messages": [{"role": "user", "content": "x"}]},
        400,
        "requires logprobs",
    ),
    (
        {"model": MODEL, "presence_penalty": 3, "messages": [{"role": "user", "content": "x"}]},
        400,
        "presence_penalty",
    ),
    (
        {
            "model": MODEL,
            "stop": ["a", "b", "c", "d", "e"],
            "messages": [{"role": "user", "content": "x"}],
        },
        400,
        "at most 4",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1200}]},
        400,
        "context length of 1024 tokens",
    ),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD)
async def test_bad_requests_get_openai_errors(
    gateway: GatewayServer, body: dict[str, Any], status: int, message: str
) -> None:
    async with httpx.AsyncClient(headers={"Authorization": "Bearer sesame"}) as http:
        reply = await http.post(gateway.url + "/v1/chat/completions", json=body)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert message in error["message"]
        assert error["type"]
        ok = await http.post(
            gateway.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "ok?"}],
            },
        )
        assert ok.status_code == 200


async def test_malformed_json(gateway: GatewayServer) -> None:
    async with httpx.AsyncClient(headers={"Authorization": "Bearer sesame"}) as http:
        reply = await http.post(
            gateway.url + "/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]


async def test_an_image_that_fails_in_the_encoder_is_a_400(gateway: GatewayServer) -> None:
    """The header is fine (so the gateway takes it), the pixels are not."""
    png = encode_image(random_image(120, 90, seed=9))
    broken = png[: len(png) - 200]
    url = "data:image/png;base64," + base64.b64encode(broken).decode()
    with pytest.raises(BadRequestError) as info:
        await client(gateway).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
        )
    assert "image 0: corrupt or truncated image" in str(info.value)


async def test_unknown_model_with_the_client(gateway: GatewayServer) -> None:
    with pytest.raises(NotFoundError):
        await client(gateway).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )


async def test_metrics_endpoint(gateway: GatewayServer) -> None:
    async with httpx.AsyncClient() as http:
        text = (await http.get(gateway.url + "/metrics")).text
    assert "epd_gateway_requests_total" in text
    assert 'epd_gateway_requests_total{status="200"}' in text


async def test_a_stream_over_the_context_length_is_a_400_before_any_byte(
    gateway: GatewayServer,
) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "word " * 600}],
    }
    async with httpx.AsyncClient(headers={"Authorization": "Bearer sesame"}) as http:
        reply = await http.post(gateway.url + "/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"


async def test_a_tiny_temperature_beside_a_live_stream(gateway: GatewayServer) -> None:
    """temperature=1e-40 samples greedily, and the stream beside it is untouched."""
    ai = client(gateway)
    stream = await ai.chat.completions.create(
        model=MODEL,
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Go on and on."}],
    )
    chunks = [await anext(stream)]
    cold = await ai.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=1e-40,
        messages=[{"role": "user", "content": "Say hi"}],
    )
    greedy = await ai.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hi"}]
    )
    assert cold.choices[0].message.content == greedy.choices[0].message.content
    chunks += [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_nothing_is_left_in_flight(gateway: GatewayServer) -> None:
    """After every test above, good and bad requests alike."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(gateway.url + "/metrics")).text
    assert "epd_gateway_in_flight 0.0" in text


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def without_triton(tiny_checkpoint: Path) -> AsyncIterator[GatewayServer]:
    """A stack whose encoder's Triton is unreachable, and a gateway that admits one
    request at a time."""
    broker = await start_broker()
    encoder = await start_encoder(
        tiny_checkpoint, None, broker, triton_url=f"127.0.0.1:{free_port()}", triton_check_s=0.2
    )
    language = await start_language(tiny_checkpoint, broker, transports=(Transport.SHM,))
    server = GatewayServer(
        GatewayConfig(
            broker=broker.address,
            checkpoint=tiny_checkpoint,
            port=0,
            served_models=(MODEL,),
            max_concurrent_requests=1,
        )
    )
    await server.start()
    yield server
    await server.stop()
    for s in (language, encoder, broker):
        await s.stop()


async def test_without_an_encoder_images_get_503_and_text_still_works(
    without_triton: GatewayServer,
) -> None:
    url = without_triton.url
    async with httpx.AsyncClient(timeout=30) as http:
        health = await http.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        states = {c["role"]: c["state"] for c in health.json()["components"].values()}
        assert states == {"encoder": "unavailable", "language": "serving"}
        image = await http.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": [image_part(3)]}],
            },
        )
        assert image.status_code == 503
        assert image.headers["retry-after"] == "2"
        assert "no available encoder" in image.json()["error"]["message"]
        text = await http.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
        )
        assert text.status_code == 200


async def test_beyond_the_gateways_limit_is_a_fast_429(without_triton: GatewayServer) -> None:
    url = without_triton.url + "/v1/chat/completions"
    long = {
        "model": MODEL,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Go on."}],
    }
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url, json=long) as busy:
        assert busy.status_code == 200
        started = time.monotonic()
        refused = await http.post(
            url,
            json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert time.monotonic() - started < 1


async def test_an_api_key_of_disabled_means_none() -> None:
    """compose requires EPD_API_KEY; "disabled" is how one asks for an open gateway."""
    from services.launcher.cli import _gateway_config, build_parser

    for given, expected in (("disabled", ""), ("k3y", "k3y")):
        args = build_parser().parse_args(["gateway", "--api-key", given])
        assert _gateway_config(args).api_key == expected
