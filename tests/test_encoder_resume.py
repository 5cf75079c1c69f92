"""An encoder killed (SIGKILL, a real process) after part of a request's images
landed: the language instance keeps what landed, the broker gives the rest to
another encoder, which starts at the first image not wholly landed and sends
from the token the language instance asks for. Through the whole stack with the
official client: the request answers 200 with HF generate()'s tokens (float32),
and every block, send buffer and pin comes back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from PIL import Image

from services.broker.placement import hrw_weight
from services.broker.server import BrokerServer
from services.encoder.pipeline import VIDEO_PART
from services.encoder.server import EncoderServer
from services.gateway.server import GatewayServer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image, random_video
from services.model.tokenizer import load_tokenizer
from services.model.video import VideoRule, load_video
from services.transfer.receiver import Action
from services.triton.launcher import TritonServer
from services.wire.messages import media_key
from services.wire.transport import Transport
from tests.processes import epd_process
from tests.reference import HfVideo, hf_greedy, hf_greedy_videos, on_a_thread
from tests.stack import MODEL, start_broker, start_encoder, start_gateway, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

DOOMED = "doomed-encoder"
NUM_IMAGES = 6
SIDE = 560  # 400 tokens an image on the tiny demo


class Stack:
    def __init__(
        self,
        broker: BrokerServer,
        encoder: EncoderServer,
        language: LanguageServer,
        gateway: GatewayServer,
    ) -> None:
        self.broker, self.encoder, self.language, self.gateway = broker, encoder, language, gateway


async def _language(
    checkpoint: Path, broker: BrokerServer, transport: Transport = Transport.SHM
) -> LanguageServer:
    return await start_language(
        checkpoint,
        broker,
        transports=(transport,),
        engine=EngineConfig(max_model_len=4096, kv_cache_bytes=64 << 20),
        # receive blocks for one image at a time: each image lands as a part of
        # its own, whatever the encoder has ready, and the next waits for a Resume
        embedding_pool_tokens=400,
        embedding_block_size=400,
    )


def _doomed(checkpoint: Path, broker: BrokerServer, triton: TritonServer) -> list[str]:
    """`epd encoder` as a process of its own, to be killed, its cache off."""
    return [
        "encoder", "--checkpoint", str(checkpoint), "--model-name", MODEL,
        "--port", "0", "--broker", broker.address, "--triton", triton.config.grpc_url,
        "--instance-id", DOOMED, "--cache-mb", "0",
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def _stack(
    checkpoint: Path, triton: TritonServer, transport: Transport
) -> AsyncIterator[Stack]:
    """A broker, the surviving encoder, a language instance that receives over
    `transport` and a gateway."""
    broker = await start_broker()
    encoder = await start_encoder(checkpoint, triton, broker, cache_bytes=0)
    language = await _language(checkpoint, broker, transport)
    gateway = await start_gateway(checkpoint, broker)
    yield Stack(broker, encoder, language, gateway)
    await gateway.stop()
    for server in (language, encoder, broker):
        await server.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[Stack]:
    async with _stack(tiny_checkpoint, triton, Transport.SHM) as built:
        yield built


@dataclass(frozen=True)
class Case:
    """A request's vision items (their bytes and content parts), the tokens that
    must have landed when the encoder is killed, and HF's greedy tokens."""

    items: list[bytes]
    parts: list[dict[str, Any]]
    kill_at: int
    total: int
    expected: list[int]


TEXT = "Compare these."


def _on_doomed(survivor: str, make: Callable[[int], list[bytes]]) -> list[bytes]:
    """Items whose first one the broker places on the doomed encoder (the highest
    rendezvous weight: neither encoder holds any of them)."""
    for seed in range(1000):
        items = make(seed)
        key = media_key(items[0])
        if hrw_weight(key, DOOMED) > hrw_weight(key, survivor):
            return items
    raise AssertionError("no seed places the request on the doomed encoder")


def _images_case(checkpoint: Path, survivor: str, landed_images: int) -> Case:
    def make(seed: int) -> list[bytes]:  # other pictures for each case: none is cached
        first = 10_000 * landed_images + 100 * seed
        return [encode_image(random_image(SIDE, SIDE, seed=first + i)) for i in range(NUM_IMAGES)]

    items = _on_doomed(survivor, make)
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in items]
    parts = [{"type": "image_url", "image_url": {"url": _url(d, "image/png")}} for d in items]
    hf = [{"role": "user", "content": [*({"type": "image"} for _ in items), _text()]}]
    expected = hf_greedy(checkpoint, hf, pictures, 8)
    return Case(items, parts, landed_images * 400, NUM_IMAGES * 400, expected)


def _video_case(checkpoint: Path, survivor: str) -> Case:
    """A clip of several parts (VIDEO_PART temporal patches each)."""

    def make(seed: int) -> list[bytes]:
        return [random_video(num_frames=50, width=SIDE, height=SIDE, fps=10, seed=seed)]

    items = _on_doomed(survivor, make)
    pixels, grid = load_video(items[0], VideoRule.from_checkpoint(checkpoint))
    parts = [{"type": "video_url", "video_url": {"url": _url(items[0], "video/mp4")}}]
    hf = [{"role": "user", "content": [{"type": "video"}, _text()]}]
    expected = hf_greedy_videos(checkpoint, hf, [], [HfVideo.of(pixels, grid)], 8)
    total = grid.num_tokens(2)
    first_part = total // grid.t * VIDEO_PART
    assert total > first_part
    return Case(items, parts, first_part, total, expected)


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _text() -> dict[str, Any]:
    return {"type": "text", "text": TEXT}


def _stop_when_landed(
    language: LanguageServer, pid: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stops the encoder's process (SIGSTOP) the moment the language instance
    takes `tokens` as landed, so that it sends nothing more. That is where the
    receiver's state machine marks a part arrived: over NIXL a part's
    TransferDone is confirmed later (its notification is polled for), and by
    then the encoder may be writing the next part."""
    machine = language.receiver.machine
    arrive = machine.arrived

    def arrived(request_id: str, sent_tokens: int) -> list[Action]:
        actions = arrive(request_id, sent_tokens)
        if _landed(language) >= tokens:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGSTOP)
        return actions

    monkeypatch.setattr(machine, "arrived", arrived)


def _landed(language: LanguageServer) -> int:
    """The tokens landed of the one request the language instance receives."""
    transfers = list(language.receiver.transfers.values())
    return transfers[0].part_start if transfers else 0


@pytest.mark.parametrize("case", ["1 of 6 images", "3 of 6 images", "5 of 6 images", "video"])
async def test_a_request_whose_encoder_dies_midway_is_finished_by_another(
    stack: Stack,
    tiny_checkpoint: Path,
    triton: TritonServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    await _killed_midway(stack, tiny_checkpoint, triton, tmp_path, monkeypatch, case)


@pytest.mark.parametrize("transport", [Transport.NIXL, Transport.GRPC], ids=lambda t: t.name)
async def test_the_rest_comes_over_every_transport(
    tiny_checkpoint: Path,
    triton: TritonServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    transport: Transport,
) -> None:
    """3 of 6 images landed over NIXL or the gRPC stream, then the encoder was
    killed: as over shared memory, another sends the rest and the answer is HF's."""
    async with _stack(tiny_checkpoint, triton, transport) as stack:
        await _killed_midway(stack, tiny_checkpoint, triton, tmp_path, monkeypatch, "3 of 6 images")


async def _killed_midway(
    stack: Stack,
    tiny_checkpoint: Path,
    triton: TritonServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """The request of `case`, its encoder killed once the case's part landed."""
    survivor = stack.encoder.instance_id
    if case == "video":
        c = await on_a_thread(_video_case, tiny_checkpoint, survivor)
    else:
        c = await on_a_thread(_images_case, tiny_checkpoint, survivor, int(case[0]))
    messages: list[dict[str, Any]] = [{"role": "user", "content": [*c.parts, _text()]}]
    client = AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key="none", max_retries=0)
    args = _doomed(tiny_checkpoint, stack.broker, triton)
    survivor_infers = _infers(stack.encoder)
    with epd_process(args, tmp_path / "encoder.log") as process:
        registry = stack.broker.broker.registry
        await until(lambda: registry.get(DOOMED) is not None, 60)
        _stop_when_landed(stack.language, process.pid, c.kill_at, monkeypatch)
        answer = asyncio.ensure_future(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                logprobs=True,  # each token's text, special ones too: compared one by one
                extra_body={"ignore_eos": True},
            )
        )
        await until(lambda: _landed(stack.language) >= c.kill_at or answer.done(), 60)
        os.killpg(process.pid, signal.SIGKILL)  # stopped as the part landed: now killed
        landed = _landed(stack.language)
        reply = await asyncio.wait_for(answer, 120)
    assert c.kill_at <= landed < c.total, "the kill came after the request's last item"
    tokenizer = load_tokenizer(tiny_checkpoint)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == [tokenizer.decode([t]) for t in c.expected]
    encoded = _infers(stack.encoder) - survivor_infers
    if case != "video":  # the survivor encoded the images not wholly landed, not those that had
        assert encoded == NUM_IMAGES - landed // 400
    else:
        assert encoded > 0
    await until(lambda: not stack.language.receiver.transfers, 10)
    language, encoder = stack.language, stack.encoder
    assert language.pool.allocator.num_used_blocks == 0
    assert not language.receiver.quarantine
    assert encoder.buffer.pool.allocator.num_used_blocks == 0 and not encoder.sender.transfers
    assert language.engine.load.kv_pages_used == 0


def _infers(encoder: EncoderServer) -> float:
    """The Triton requests an encoder made (one an image)."""
    (metric,) = encoder.metrics.triton_seconds.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_count"))


async def test_with_no_encoder_left_the_error_names_the_encoders(
    tiny_checkpoint: Path, triton: TritonServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only encoder dies after the first image landed: the request ends in a
    bounded time with a 503 that says no encoder is left (not that the language
    instance is missing), and the language instance gives back every block."""
    broker = await start_broker()
    language = await _language(tiny_checkpoint, broker)
    gateway = await start_gateway(tiny_checkpoint, broker)
    args = _doomed(tiny_checkpoint, broker, triton)
    pictures = [encode_image(random_image(SIDE, SIDE, seed=90_000 + i)) for i in range(3)]
    parts = [{"type": "image_url", "image_url": {"url": _url(p, "image/png")}} for p in pictures]
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    try:
        with epd_process(args, tmp_path / "encoder.log") as process:
            await until(lambda: broker.broker.registry.get(DOOMED) is not None, 60)
            _stop_when_landed(language, process.pid, 400, monkeypatch)
            answer = asyncio.ensure_future(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": [*parts, _text()]}],  # type: ignore[list-item]
                    max_tokens=8,
                )
            )
            await until(lambda: _landed(language) >= 400, 60)
            os.killpg(process.pid, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as info:
                await asyncio.wait_for(answer, 60)
        assert info.value.status_code == 503
        assert "encoder" in info.value.message and "language" not in info.value.message
        # the blocks the lost encoder was given wait in quarantine for the broker's
        # Released (its answer to the language side's Abort: no encoder holds them),
        # not for the quarantine's 15 s
        pool = language.pool.allocator
        await until(lambda: not language.receiver.transfers and not pool.num_used_blocks, 10)
        assert not language.receiver.quarantine
    finally:
        await gateway.stop()
        for server in (language, broker):
            await server.stop()
