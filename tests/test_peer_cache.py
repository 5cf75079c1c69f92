"""The cluster as one embedding cache, through the whole stack (a real Triton,
broker, encoders, language instance and gateway; the official openai client).
The broker takes turns between the encoders (round-robin), so a second request
about an image goes to the encoder that did not encode it: that one fetches the
embedding from the holder instead of running Triton, and the answer equals HF
generate()'s. A holder that stalls (SIGSTOP) or dies (SIGKILL) during the fetch
costs the fetch, not the request: the item is encoded after all."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from PIL import Image

from services.broker.server import BrokerServer
from services.encoder.peers import FETCH_TIMEOUT_S
from services.encoder.server import EncoderServer
from services.gateway.server import GatewayServer
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from services.triton.launcher import TritonServer
from services.wire.messages import media_key
from tests.processes import epd_process
from tests.reference import hf_greedy, on_a_thread
from tests.stack import MODEL, start_broker, start_encoder, start_gateway, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUESTION = "What is in this picture?"
HOLDER = "holder-encoder"


@dataclass
class Stack:
    broker: BrokerServer
    encoders: list[EncoderServer]
    language: LanguageServer
    gateway: GatewayServer

    def counts(self, name: str, label: str = "") -> list[float]:
        """Each in-process encoder's counter (`label`: only that label's series)."""
        out = []
        for encoder in self.encoders:
            metric = getattr(encoder.metrics, name)
            samples = [s for m in metric.collect() for s in m.samples if s.name.endswith("_total")]
            out.append(sum(s.value for s in samples if not label or label in s.labels.values()))
        return out

    def whole(self) -> bool:
        language = self.language
        return (
            not language.receiver.transfers
            and language.pool.allocator.num_used_blocks == 0
            and not language.receiver.quarantine
            and language.engine.load.kv_pages_used == 0
            and all(e.buffer.pool.allocator.num_used_blocks == 0 for e in self.encoders)
        )


@contextlib.asynccontextmanager
async def _stack(checkpoint: Path, triton: TritonServer, encoders: int) -> AsyncIterator[Stack]:
    broker = await start_broker(encoder_routing="round-robin")
    started = [await start_encoder(checkpoint, triton, broker) for _ in range(encoders)]
    language = await start_language(checkpoint, broker)
    gateway = await start_gateway(checkpoint, broker)
    await until(lambda: len(broker.broker.registry.sessions()) == encoders + 1, 30)
    yield Stack(broker, started, language, gateway)
    await gateway.stop()
    for server in (language, *started, broker):
        await server.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[Stack]:
    async with _stack(tiny_checkpoint, triton, 2) as built:
        yield built


def _picture(seed: int) -> tuple[Image.Image, str, str]:
    """An image, its data: URL and its cache key."""
    picture = random_image(112, 84, seed=seed)
    data = encode_image(picture)
    return picture, "data:image/png;base64," + base64.b64encode(data).decode(), media_key(data)


async def _ask(stack: Stack, url: str, lead: str) -> list[str]:
    """A request about the image after `lead` (another lead for each request: the
    language instance's prefix cache never covers the image): its tokens' texts."""
    client = AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": lead},
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
        timeout=60,
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None
    return [t.token for t in content]


async def _reference(checkpoint: Path, picture: Image.Image, lead: str) -> list[str]:
    hf = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": lead},
                {"type": "image"},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    tokenizer = load_tokenizer(checkpoint)
    tokens = await on_a_thread(hf_greedy, checkpoint, hf, [picture], 8)
    return [tokenizer.decode([t]) for t in tokens]


async def test_an_image_another_encoder_holds_is_fetched_not_encoded(
    stack: Stack, tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd.requests")
    picture, url, key = _picture(seed=4242)
    encoded, sent = stack.counts("encoded_items"), stack.counts("peer_served", "sent")
    assert await _ask(stack, url, "First:") == await _reference(tiny_checkpoint, picture, "First:")
    after_first = stack.counts("encoded_items")
    holder = next(i for i in range(2) if after_first[i] == encoded[i] + 1)
    other = 1 - holder
    assert after_first[other] == encoded[other]
    fetched = stack.counts("peer_fetches", "fetched")
    fetch_bytes = stack.counts("peer_fetch_bytes")

    # round-robin: the next request goes to the other encoder, which fetches the image
    assert await _ask(stack, url, "Second:") == await _reference(
        tiny_checkpoint, picture, "Second:"
    )
    # each request's log line: the second's says its image came from a peer
    await until(lambda: len(_logged(caplog)) == 2, 10)
    assert {r["encoder"]: r["peer_items"] for r in _logged(caplog)} == {
        stack.encoders[holder].instance_id: 0,
        stack.encoders[other].instance_id: 1,
    }
    assert stack.counts("encoded_items") == after_first  # no Triton request anywhere
    assert stack.counts("peer_fetches", "fetched")[other] == fetched[other] + 1
    assert stack.counts("peer_served", "sent")[holder] == sent[holder] + 1
    held = stack.encoders[holder].pipeline.cache.get(key)
    assert held is not None and stack.encoders[other].pipeline.cache.get(key) is not None
    assert stack.counts("peer_fetch_bytes")[other] == fetch_bytes[other] + held.nbytes
    # both now hold it: a third request encodes nothing and fetches nothing
    assert await _ask(stack, url, "Third:") == await _reference(tiny_checkpoint, picture, "Third:")
    assert stack.counts("encoded_items") == after_first
    assert stack.counts("peer_fetches", "fetched")[other] == fetched[other] + 1
    await until(stack.whole, 10)


def _logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "epd.requests"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", ["stalled", "killed"])
async def test_a_holder_that_stalls_or_dies_costs_the_fetch_not_the_request(
    tiny_checkpoint: Path, triton: TritonServer, tmp_path: Path, fault: str
) -> None:
    """The holder, `epd encoder` in a process of its own, is stopped (SIGSTOP)
    before the request that would fetch from it is routed; "killed" kills it
    (SIGKILL) while the fetch waits. The request answers HF's tokens either way,
    the survivor encoding the image itself: after the fetch deadline when the
    holder stalls, at once when it dies. Every block and buffer comes back."""
    async with _stack(tiny_checkpoint, triton, 1) as stack:
        args = [
            "encoder", "--checkpoint", str(tiny_checkpoint), "--model-name", MODEL,
            "--port", "0", "--broker", stack.broker.address,
            "--triton", triton.config.grpc_url, "--instance-id", HOLDER,
        ]  # fmt: skip
        with epd_process(args, tmp_path / "holder.log") as process:
            registry = stack.broker.broker.registry
            await until(lambda: registry.get(HOLDER) is not None, 60)
            picture, url = await _held_by_the_holder(stack, seed=7000 + len(fault))
            survivor = stack.encoders[0].pipeline
            encoded = stack.counts("encoded_items")[0]
            os.killpg(process.pid, signal.SIGSTOP)
            answer = asyncio.ensure_future(_ask(stack, url, "Again:"))
            await until(lambda: bool(survivor._fetching), 10)
            started = time.monotonic()
            if fault == "killed":
                os.killpg(process.pid, signal.SIGKILL)
            await until(lambda: not survivor._fetching, 10)
            fetch_s = time.monotonic() - started  # from the kill, or the fetch's start
            tokens = await asyncio.wait_for(answer, 60)
        assert tokens == await _reference(tiny_checkpoint, picture, "Again:")
        assert stack.counts("encoded_items")[0] == encoded + 1  # encoded here after all
        assert stack.counts("peer_fetches", "failed")[0] == 1
        if fault == "killed":  # the dead holder's connection resets: no wait for the deadline
            assert fetch_s < FETCH_TIMEOUT_S / 2, fetch_s
        else:  # a stalled holder answers nothing: the fetch's deadline ends it
            assert fetch_s > FETCH_TIMEOUT_S / 2, fetch_s
        await until(stack.whole, 10)


async def _held_by_the_holder(stack: Stack, seed: int) -> tuple[Image.Image, str]:
    """A new image that the holder encoded (round-robin: the survivor and the
    holder take turns, so at most a second one is needed), the next route the
    survivor's."""
    for attempt in range(2):
        picture, url, _ = _picture(seed * 10 + attempt)
        before = stack.counts("encoded_items")[0]
        await _ask(stack, url, "First:")
        if stack.counts("encoded_items")[0] == before:
            return picture, url
    raise AssertionError("the survivor encoded both images: the turns did not alternate")
