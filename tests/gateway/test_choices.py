"""n > 1 through the real back end with the official client: chat and text
completions, streamed and not; greedy choices equal HF generate(), seeded
ones are reproducible per choice; the prompt is counted once."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from services.gateway.server import GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from tests.reference import chat, hf_greedy, hf_greedy_prompt
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "What is in this picture?"


def client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)


def _image_messages() -> list[dict[str, Any]]:
    data = encode_image(random_image(180, 130, seed=41))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]
    return [{"role": "user", "content": parts}]


async def test_greedy_choices_equal_hf(gateway: GatewayServer, tiny_checkpoint: Path) -> None:
    expected = hf_greedy(tiny_checkpoint, chat(PROMPT, 1), [random_image(180, 130, seed=41)], 12)
    # The whole decode: a trailing partial character is U+FFFD, as in HF's.
    text = load_tokenizer(tiny_checkpoint).decode(expected, skip_special_tokens=True)
    reply = await client(gateway).chat.completions.create(
        model=MODEL,
        messages=_image_messages(),
        max_tokens=12,
        temperature=0,
        n=3,  # type: ignore[arg-type]
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [text] * 3
    assert reply.usage is not None
    one = await client(gateway).chat.completions.create(
        model=MODEL,
        messages=_image_messages(),
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    assert one.usage is not None
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    # the same prompt again: its full pages, image and all, from the prefix cache
    details = one.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == one.usage.prompt_tokens // 16 * 16
    assert reply.usage.completion_tokens == 3 * one.usage.completion_tokens


async def _sampled(gateway: GatewayServer, seed: int, n: int, stream: bool) -> list[str]:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
        "n": n,
    }
    if not stream:
        reply = await client(gateway).chat.completions.create(**kwargs)
        return [c.message.content or "" for c in sorted(reply.choices, key=lambda c: c.index)]
    stream_ = await client(gateway).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    texts = [""] * n
    finishes: list[str | None] = [None] * n
    usage = None
    async for chunk in stream_:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                assert finishes[choice.index] is None, "one finish_reason per choice"
                finishes[choice.index] = choice.finish_reason
    assert all(f is not None for f in finishes)
    assert usage is not None and usage.completion_tokens > 0
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_seeded_choices_are_reproducible(gateway: GatewayServer, stream: bool) -> None:
    three = await _sampled(gateway, seed=21, n=3, stream=stream)
    assert three == await _sampled(gateway, seed=21, n=3, stream=stream)
    assert len(set(three)) == 3
    # Choice i draws from seed + i: the same as one choice with that seed.
    for index in range(3):
        assert three[index] == (await _sampled(gateway, seed=21 + index, n=1, stream=False))[0]


async def test_completions_number_choices_per_prompt(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    prompts = [[5, 17, 42, 99, 7], [300, 13, 8]]
    expected = [hf_greedy_prompt(tiny_checkpoint, p, 6) for p in prompts]
    tokenizer = load_tokenizer(tiny_checkpoint)
    reply = await client(gateway).completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    assert [c.text for c in reply.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)


async def test_a_streamed_completion_with_two_choices(gateway: GatewayServer) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "seed": 5}
    whole = await client(gateway).completions.create(n=2, **kwargs)
    texts = ["", ""]
    async for chunk in await client(gateway).completions.create(n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
