"""A conversation moves with its KV, through the whole stack (a real Triton,
broker, encoder, two language instances, the gateway; the official openai
client; the engines in child processes, but for the mover of the fault tests).
Turn 1 about an image runs on the holder. The holder is then busy past the load
bound (a request of its own that waits for embeddings), so the broker routes
turn 2 to the other instance and names the holder: the mover fetches the chat's
KV pages from it, computes only turn 2's new tokens, is sent no embedding (no
Triton request either), and answers as HF generate() does. A holder that
stalls (SIGSTOP) or dies (SIGKILL) during the fetch, `epd language` in a
process of its own, costs the fetch, not the turn: the mover computes the
pages itself."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from openai import AsyncOpenAI
from prometheus_client.metrics import MetricWrapperBase

from services.broker.server import BrokerServer
from services.encoder.server import EncoderServer
from services.gateway.server import GatewayServer
from services.language.engine.config import EngineConfig
from services.language.prefix_moves import FETCH_TIMEOUT_S
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from services.proto import common_pb2, language_pb2, language_pb2_grpc
from services.runtime.grpc_server import channel
from services.triton.launcher import TritonServer
from tests.processes import epd_process
from tests.reference import hf_greedy, on_a_thread
from tests.stack import MODEL, start_broker, start_encoder, start_gateway, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

PICTURE = random_image(112, 112, seed=11)
URL = "data:image/png;base64," + base64.b64encode(encode_image(PICTURE)).decode()
QUESTION = "Describe the picture in a few words, please, and say what colours it has."
HOLDER = "holder-language"
ENGINE = EngineConfig(max_model_len=1024, kv_cache_bytes=32 << 20)


def total(metric: MetricWrapperBase, label: str = "", suffix: str = "_total") -> float:
    samples = [s for m in metric.collect() for s in m.samples if s.name.endswith(suffix)]
    return sum(s.value for s in samples if not label or label in s.labels.values())


@dataclass
class Stack:
    broker: BrokerServer
    encoder: EncoderServer
    gateway: GatewayServer
    checkpoint: Path
    languages: list[LanguageServer] = field(default_factory=list)

    @property
    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.gateway.url + "/v1", api_key="none", max_retries=0)

    async def add_language(self, engine_process: bool = True) -> LanguageServer:
        language = await start_language(
            self.checkpoint, self.broker, ENGINE, engine_process=engine_process
        )
        self.languages.append(language)
        return language


@contextlib.asynccontextmanager
async def _stack(checkpoint: Path, triton: TritonServer) -> AsyncIterator[Stack]:
    """No slack in the load bound: an instance with a request in flight is past
    it while another has none. No embedding cache: only the language side's
    word keeps an image from Triton. A long heartbeat timeout: a language
    instance starting in this process holds the event loop for seconds, and its
    peers' sessions (with the chat prefixes routed to them) must outlive that."""
    broker = await start_broker(load_slack=0, heartbeat_timeout_s=60.0)
    encoder = await start_encoder(checkpoint, triton, broker, cache_bytes=0)
    gateway = await start_gateway(checkpoint, broker)
    stack = Stack(broker, encoder, gateway, checkpoint)
    try:
        yield stack
    finally:
        await gateway.stop()
        for server in (*stack.languages, encoder, broker):
            await server.stop()


def _turn_1() -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": URL}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]


def _turn_2(answer: str) -> list[dict[str, Any]]:
    return [
        *_turn_1(),
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": [{"type": "text", "text": "And what is in its corner?"}]},
    ]


async def _ask(stack: Stack, messages: list[dict[str, Any]]) -> tuple[str, int]:
    """The answer's text and the prompt tokens the instance took from its cache."""
    reply = await stack.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        timeout=60,
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens or 0


async def _reference(checkpoint: Path, messages: list[dict[str, Any]]) -> str:
    hf = [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]
    return load_tokenizer(checkpoint).decode(
        await on_a_thread(hf_greedy, checkpoint, hf, [PICTURE], 8)
    )


@contextlib.asynccontextmanager
async def _busy(stack: Stack, address: str, instance_id: str) -> AsyncIterator[None]:
    """The instance at `address` past the load bound: a request of its own in
    flight there, waiting for an image no encoder sends, until the block ends
    (then the instance is idle again)."""
    image = language_pb2.ImagePart(token_hint=64, key="never-sent")
    request = language_pb2.GenerateRequest(
        request_id=f"busy-{instance_id}-{time.monotonic_ns()}",
        messages=[
            language_pb2.ChatMessage(role="user", content=[language_pb2.ContentPart(image=image)])
        ],
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    call = language_pb2_grpc.LanguageStub(channel(address)).Generate(request, timeout=60)
    waiting = asyncio.ensure_future(call.read())
    registry = stack.broker.broker.registry

    def busy() -> bool:  # its heartbeat says so
        session = registry.get(instance_id)
        return session is not None and session.load.num_requests >= 1

    await until(busy, 10)
    try:
        yield
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await waiting


def _requests_logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "epd.requests"]  # type: ignore[attr-defined]


def _whole(language: LanguageServer) -> bool:
    return (
        not language.receiver.transfers
        and language.pool.allocator.num_used_blocks == 0
        and language.engine.load.kv_pages_used == 0
    )


async def test_a_turn_routed_away_from_its_busy_holder_moves_with_its_kv(
    tiny_checkpoint: Path, triton: TritonServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd.requests")
    async with _stack(tiny_checkpoint, triton) as stack:
        holder = await stack.add_language()
        first, _ = await _ask(stack, _turn_1())  # the only instance: the holder
        assert first == await _reference(tiny_checkpoint, _turn_1())
        mover = await stack.add_language()
        await until(lambda: len(stack.broker.broker.registry.sessions()) == 3, 30)
        triton_requests = total(stack.encoder.metrics.triton_seconds, suffix="_count")
        written = total(stack.encoder.metrics.write_bytes)

        async with _busy(stack, holder.grpc.address, holder.instance_id):
            second, cached = await _ask(stack, _turn_2(first))
        assert second == await _reference(tiny_checkpoint, _turn_2(first))

        # the mover fetched the pages once, the holder sent them once
        assert total(mover.metrics.prefix_fetches, "fetched") == 1
        assert total(holder.metrics.prefix_served, "sent") == 1
        pages = total(mover.metrics.prefix_fetch_pages)
        assert pages > 0 and total(holder.metrics.prefix_served_pages) == pages
        # ... and computed none of them: they are the turn's cache hits
        assert cached == pages * ENGINE.page_size
        prompt = total(mover.metrics.prompt_tokens)
        logged = _requests_logged(caplog)[-1]
        assert logged["language"] == mover.instance_id
        assert logged["prefix_from"] == holder.instance_id
        assert logged["cached_tokens"] == cached
        # what it computed: the rest (the prompt's last token counts as a generated one)
        assert prompt == logged["prompt_tokens"] - cached - 1
        # the image's tokens were among them: not encoded, not sent
        assert total(mover.metrics.media_tokens_held) > 0
        assert total(stack.encoder.metrics.triton_seconds, suffix="_count") == triton_requests
        assert total(stack.encoder.metrics.write_bytes) == written
        await until(lambda: all(_whole(language) for language in stack.languages), 10)


@pytest.mark.parametrize("fault", ["stalled", "killed"])
async def test_a_holder_that_stalls_or_dies_costs_the_fetch_not_the_turn(
    tiny_checkpoint: Path, triton: TritonServer, tmp_path: Path, fault: str
) -> None:
    """The holder, `epd language` in a process of its own, is stopped (SIGSTOP)
    once it is busy and before turn 2 is routed; "killed" kills it (SIGKILL)
    while the mover's fetch waits. Turn 2 answers HF's tokens either way, its
    pages computed on the mover: after the fetch's deadline when the holder
    stalls, at once when it dies. Nothing leaks on the mover."""
    async with _stack(tiny_checkpoint, triton) as stack:
        args = [
            "language", "--checkpoint", str(tiny_checkpoint), "--model-name", MODEL,
            "--port", "0", "--broker", stack.broker.address, "--instance-id", HOLDER,
            "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-mb", "32",
            "--engine-process", "on",
        ]  # fmt: skip
        with epd_process(args, tmp_path / "holder.log") as process:
            registry = stack.broker.broker.registry
            await until(lambda: registry.get(HOLDER) is not None, 120)
            first, _ = await _ask(stack, _turn_1())  # the only instance: the holder
            # its engine in this process: an engine process's start-up would hold this
            # event loop (and the gateway's streams, pings unanswered) for seconds
            mover = await stack.add_language(engine_process=False)
            await until(lambda: len(registry.sessions()) == 3, 30)
            session = registry.get(HOLDER)
            assert session is not None
            async with _busy(stack, session.registration.grpc_address, HOLDER):
                os.killpg(process.pid, signal.SIGSTOP)
                answer = asyncio.ensure_future(_ask(stack, _turn_2(first)))
                peers = mover.frontend.prefix_peers
                assert peers is not None
                await until(lambda: peers.in_flight == 1, 10)
                started = time.monotonic()
                if fault == "killed":
                    os.killpg(process.pid, signal.SIGKILL)
                await until(lambda: peers.in_flight == 0, 10)
                fetch_s = time.monotonic() - started
                second, cached = await asyncio.wait_for(answer, 60)
        assert second == await _reference(tiny_checkpoint, _turn_2(first))
        assert cached == 0  # computed here after all
        assert total(mover.metrics.prefix_fetches, "failed") == 1
        assert total(mover.metrics.prefix_fetches, "fetched") == 0
        if fault == "killed":  # the dead holder's connection resets: no wait for the deadline
            assert fetch_s < FETCH_TIMEOUT_S / 2, fetch_s
        else:  # a stalled holder answers nothing: the fetch's deadline ends it
            assert fetch_s > FETCH_TIMEOUT_S / 2, fetch_s
        await until(lambda: _whole(mover), 10)
