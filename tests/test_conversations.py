"""A conversation about an image through the whole stack (a real Triton, broker,
encoder, language instance and gateway, the official openai client): turn 2
resends turn 1's image, and the language instance's prefix cache, which holds
its KV, answers the preallocation with "not needed": no Triton inference, no
embedding transfer, and the answer still equals HF generate()'s. The encoder's
embedding cache is off, so nothing but the language instance's word keeps the
image from Triton."""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from prometheus_client.metrics import MetricWrapperBase

from services.encoder.server import EncoderServer
from services.gateway.server import GatewayServer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from services.triton.launcher import TritonServer
from services.wire.transport import Transport
from tests.reference import hf_greedy, on_a_thread
from tests.stack import MODEL, start_broker, start_encoder, start_gateway, start_language

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUESTION = "Describe the picture in a few words, please, and say what colours it has."


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(
    tiny_checkpoint: Path, triton: TritonServer
) -> AsyncIterator[tuple[GatewayServer, EncoderServer, LanguageServer]]:
    broker = await start_broker()
    encoder = await start_encoder(tiny_checkpoint, triton, broker, cache_bytes=0)
    language = await start_language(
        tiny_checkpoint,
        broker,
        transports=(Transport.SHM,),
        engine=EngineConfig(max_model_len=1024, kv_cache_bytes=32 << 20),
    )
    gateway = await start_gateway(tiny_checkpoint, broker)
    yield gateway, encoder, language
    await gateway.stop()
    for server in (language, encoder, broker):
        await server.stop()


def total(metric: MetricWrapperBase, suffix: str = "_total") -> float:
    """A metric's samples of that suffix, summed over its labels."""
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix))


def sent(encoder: EncoderServer, language: LanguageServer) -> dict[str, float]:
    """What shows an image was encoded or crossed a transport, and what was held."""
    return {
        "triton requests": total(encoder.metrics.triton_seconds, "_count"),
        "bytes written": total(encoder.metrics.write_bytes),
        "images held": total(encoder.metrics.held_items),
        "tokens held": total(language.metrics.media_tokens_held),
    }


async def held_counted(
    encoder: EncoderServer, want: float, timeout_s: float = 10.0, at_least: bool = False
) -> None:
    """The encoder counts an item held when its request's handling ends, which
    may be after the language instance, answering from its cache, has replied:
    the count reaches `want` (`at_least`: or more) within the deadline."""
    for _ in range(int(timeout_s / 0.01)):  # polled: a counter sets no event
        if total(encoder.metrics.held_items) >= want:
            break
        await asyncio.sleep(0.01)
    count = total(encoder.metrics.held_items)
    assert count >= want if at_least else count == want, (count, want)


async def test_turn_two_about_an_image_is_neither_encoded_nor_sent(
    stack: tuple[GatewayServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    gateway, encoder, language = stack
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    picture = random_image(112, 112, seed=7)
    url = "data:image/png;base64," + base64.b64encode(encode_image(picture)).decode()
    turn_1: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    tokenizer = load_tokenizer(tiny_checkpoint)

    async def answer(messages: list[dict[str, Any]]) -> str:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content or ""

    async def reference(messages: list[dict[str, Any]]) -> str:
        hf = [
            {
                "role": m["role"],
                "content": [
                    {"type": "image"} if p["type"] == "image_url" else p for p in m["content"]
                ],
            }
            for m in messages
        ]
        return tokenizer.decode(await on_a_thread(hf_greedy, tiny_checkpoint, hf, [picture], 8))

    before = sent(encoder, language)
    first = await answer(turn_1)
    after_1 = sent(encoder, language)
    assert after_1["triton requests"] == before["triton requests"] + 1
    assert after_1["bytes written"] > before["bytes written"]
    assert after_1["images held"] == before["images held"]
    assert first == await reference(turn_1)

    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": [{"type": "text", "text": first}]},
        {"role": "user", "content": [{"type": "text", "text": "And what is in its corner?"}]},
    ]
    second = await answer(turn_2)
    after_2 = sent(encoder, language)
    assert after_2["triton requests"] == after_1["triton requests"], "turn 2 ran Triton"
    assert after_2["bytes written"] == after_1["bytes written"], "turn 2's image was sent"
    await held_counted(encoder, after_1["images held"] + 1)
    assert after_2["tokens held"] > after_1["tokens held"]
    assert second == await reference(turn_2)


async def test_a_cache_salt_scopes_the_cached_pages_and_the_held_images(
    stack: tuple[GatewayServer, EncoderServer, LanguageServer],
) -> None:
    """Through the gateway with the official client: a chat about an image under
    salt "a", its next turn under "a" (the image held: no Triton request, cached
    tokens reported), then the same turn under "b" and with no salt: the image
    is encoded and sent again, and nothing of "a"'s is reported cached."""
    gateway, encoder, language = stack
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    picture = encode_image(random_image(112, 112, seed=8))
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    turn_1: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]

    async def ask(messages: list[dict[str, Any]], salt: str | None) -> Any:
        return await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True} | ({"cache_salt": salt} if salt else {}),
        )

    first = await ask(turn_1, "a")
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And its corners?"},
    ]
    cached = {}
    for salt, held in (("a", True), ("b", False), (None, False)):
        before = sent(encoder, language)
        reply = await ask(turn_2, salt)
        after = sent(encoder, language)
        cached[salt] = reply.usage.prompt_tokens_details.cached_tokens
        await held_counted(encoder, before["images held"] + int(held))
        assert after["triton requests"] - before["triton requests"] == int(not held), salt
    # "b" shares nothing; unsalted requests share with unsalted ones only (the
    # system prompt's page other tests' chats left), never salt "a"'s turn
    assert cached["a"] > 0 and cached["b"] == 0 and cached[None] < cached["a"]


def _words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    vocabulary = [
        "red",
        "green",
        "blue",
        "house",
        "river",
        "stone",
        "cloud",
        "light",
        "window",
        "garden",
        "road",
        "tree",
    ]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def _gauge(metric: MetricWrapperBase) -> float:
    return next(s.value for m in metric.collect() for s in m.samples)


async def test_follow_ups_whose_pins_would_fill_the_cache_all_answer(
    tiny_checkpoint: Path, triton: TritonServer
) -> None:
    """Three chats about a 448x448 image (256 tokens) each, turn 1 about 700 tokens; a KV cache
    of twice max_model_len; the three follow-ups come together, each asking for
    the rest of max_model_len. Their pins alone would leave too little for one of
    them to finish: at least one is given up (that image is encoded again), each
    follow-up answers in full, and every page comes back."""
    max_model_len = 1024
    text = load_spec(tiny_checkpoint).text
    token_bytes = text.num_layers * 2 * text.num_kv_heads * text.head_dim * 4  # float32
    broker = await start_broker()
    encoder = await start_encoder(tiny_checkpoint, triton, broker, cache_bytes=0)
    language = await start_language(
        tiny_checkpoint,
        broker,
        transports=(Transport.SHM,),
        engine=EngineConfig(
            max_model_len=max_model_len, kv_cache_bytes=2 * max_model_len * token_bytes
        ),
    )
    gateway = await start_gateway(tiny_checkpoint, broker)
    try:
        client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)

        def chat(seed: int) -> list[dict[str, Any]]:
            picture = encode_image(random_image(448, 448, seed=seed))
            url = "data:image/png;base64," + base64.b64encode(picture).decode()
            return [
                {
                    "role": "user",
                    "content": [  # the image last: its pages, held, are the turn's
                        {"type": "text", "text": _words(130, seed)},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ]

        async def ask(messages: list[dict[str, Any]], max_tokens: int | None) -> Any:
            return await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

        firsts = [chat(seed) for seed in range(3)]
        replies = [await ask(messages, 8) for messages in firsts]
        assert all(540 < r.usage.prompt_tokens < 640 for r in replies), [r.usage for r in replies]
        follow_ups = [
            [
                *messages,
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Go on."},
            ]
            for messages, reply in zip(firsts, replies, strict=True)
        ]
        before = sent(encoder, language)
        answers = await asyncio.wait_for(  # no max_tokens: up to the context length
            asyncio.gather(*(ask(m, None) for m in follow_ups)), timeout=120
        )
        after = sent(encoder, language)
        for answer in answers:
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage.prompt_tokens + answer.usage.completion_tokens == max_model_len
        await held_counted(encoder, before["images held"] + 1, at_least=True)
        assert after["triton requests"] - before["triton requests"] >= 1, "no pin was given up"
        assert _gauge(language.metrics.kv_pages_used) == 0
    finally:
        await gateway.stop()
        for server in (language, encoder, broker):
            await server.stop()
