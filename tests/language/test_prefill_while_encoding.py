"""Prefill while the images arrive, through the real services: Triton, the
broker, the encoder sending each image as Triton returns it, the language
instance prefilling up to the first image still missing. The test holds each
image at Triton's door until the prompt before it is prefilled, so the
overlap is not left to chance, and the tokens still equal HF generate()'s."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from services.broker.server import BrokerServer
from services.encoder.pipeline import VIDEO_PART
from services.encoder.server import EncoderServer
from services.encoder.triton_client import VitOutput
from services.language.engine.async_engine import AsyncEngine
from services.language.engine.engine import LLMEngine
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image, random_video
from services.model.processor import ImageTokenRule
from services.model.video import VideoRule, load_video, probe
from services.proto import common_pb2, encoder_pb2, language_pb2
from services.triton.launcher import TritonServer
from services.wire.convert import to_proto
from services.wire.transport import Transport
from tests.reference import HfVideo, chat, hf_greedy, hf_greedy_videos, on_a_thread
from tests.stack import backend, encoder_stub, language_stub, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(
    tiny_checkpoint: Path, triton: TritonServer
) -> AsyncIterator[tuple[BrokerServer, EncoderServer, LanguageServer]]:
    async with backend(tiny_checkpoint, triton) as servers:
        yield servers


def hinted(checkpoint: Path, text: str, images: list[bytes]) -> list[language_pb2.ChatMessage]:
    """A user message with the images' token and grid hints, as the gateway sends it."""
    rule = ImageTokenRule.from_checkpoint(checkpoint)
    parts = []
    for data in images:
        width, height = Image.open(io.BytesIO(data)).size
        grid = rule.grid(height, width)
        part = language_pb2.ImagePart(
            token_hint=grid.num_tokens(rule.merge_size),
            grid_hint=common_pb2.MediaGrid(t=grid.t, h=grid.h, w=grid.w),
        )
        parts.append(language_pb2.ContentPart(image=part))
    parts.append(language_pb2.ContentPart(text=text))
    return [language_pb2.ChatMessage(role="user", content=parts)]


def computed_tokens(language: LanguageServer, request_id: str) -> int:
    """How much of the request's prompt the engine has computed (0: not there)."""
    assert isinstance(language.engine, AsyncEngine)
    choices = language.engine.engine.requests.get(request_id)
    return choices[0].num_computed_tokens if choices else 0


async def generate(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    checkpoint: Path,
    request_id: str,
    text: str,
    images: list[bytes],
    max_tokens: int,
) -> list[language_pb2.GenerateResponse]:
    """What the gateway does: Encode and Generate at once."""
    broker, encoder, language = stack
    broker.broker.rendezvous.route(request_id, encoder.instance_id, language.instance_id)
    encode = encoder_stub(encoder).Encode(
        encoder_pb2.EncodeRequest(
            request_id=request_id, images=images, language_instance_id=language.instance_id
        )
    )

    async def stream() -> list[language_pb2.GenerateResponse]:
        call = language_stub(language).Generate(
            language_pb2.GenerateRequest(
                request_id=request_id,
                messages=hinted(checkpoint, text, images),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
            )
        )
        return [r async for r in call]

    responses, _ = await asyncio.gather(stream(), encode)
    return responses


def token_ids(responses: list[language_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def pil(data: list[bytes]) -> list[Any]:
    return [Image.open(io.BytesIO(d)).convert("RGB") for d in data]


@pytest.mark.parametrize("num_images", [1, 4])
async def test_each_image_waits_until_the_prompt_before_it_is_prefilled_and_the_tokens_equal_hf(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    num_images: int,
) -> None:
    _, encoder, language = stack
    request_id = f"while-encoding-{num_images}"
    progress: list[int] = []
    infer = encoder.pipeline.vit.infer

    async def held(pixels: np.ndarray, grids: np.ndarray) -> VitOutput:
        # Triton sees one image at a time; it goes in once the engine has computed
        # more of the prompt than when the last one came (the text before it)
        assert len(grids) == 1
        last = progress[-1] if progress else 0
        await until(lambda: computed_tokens(language, request_id) > last, 20)
        progress.append(computed_tokens(language, request_id))
        return await infer(pixels, grids)

    monkeypatch.setattr(encoder.pipeline.vit, "infer", held)
    images = [
        encode_image(random_image(150 + 28 * i, 130 + 14 * i, seed=900 + 10 * num_images + i))
        for i in range(num_images)
    ]
    text = "Describe the pictures." if num_images > 1 else "Describe this image."
    responses = await generate(stack, tiny_checkpoint, request_id, text, images, 12)
    assert len(progress) == num_images
    assert progress == sorted(set(progress))  # more of the prompt before each image
    expected = await on_a_thread(
        hf_greedy, tiny_checkpoint, chat(text, num_images), pil(images), 12
    )
    assert token_ids(responses) == expected
    await until(lambda: not language.receiver.transfers and not encoder.sender.transfers)
    assert language.pool.allocator.num_used_blocks == 0
    await until(lambda: encoder.buffer.pool.allocator.num_used_blocks == 0)


async def test_a_grid_unlike_its_hint_is_received_whole_and_still_equals_hf(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer], tiny_checkpoint: Path
) -> None:
    """A caller's grid hint that the encoder does not bear out (the same token
    count, another shape): the streamed request is dropped unsampled and the
    request runs on the real grid, as without hints."""
    broker, encoder, language = stack
    image = encode_image(random_image(224, 168, seed=990))
    request_id = "unlike-its-hint"
    messages = hinted(tiny_checkpoint, "Describe this image.", [image])
    grid = messages[0].content[0].image.grid_hint
    grid.h, grid.w = grid.w, grid.h  # a transposed grid: as many tokens, other positions
    broker.broker.rendezvous.route(request_id, encoder.instance_id, language.instance_id)
    encode = encoder_stub(encoder).Encode(
        encoder_pb2.EncodeRequest(
            request_id=request_id, images=[image], language_instance_id=language.instance_id
        )
    )
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id=request_id,
            messages=messages,
            sampling=common_pb2.SamplingParams(max_tokens=10),
        )
    )
    responses = [r async for r in call]
    await encode
    expected = await on_a_thread(
        hf_greedy, tiny_checkpoint, chat("Describe this image.", 1), pil([image]), 10
    )
    assert token_ids(responses) == expected


def engine_idle(language: LanguageServer) -> bool:
    assert isinstance(language.engine, AsyncEngine)
    return not language.engine.engine.requests and language.engine.load.kv_pages_used == 0


@pytest.mark.parametrize("fault", ["never-arrives", "client-leaves"])
async def test_a_request_whose_second_image_never_comes_ends_and_frees_what_it_prefilled(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """The first image lands and is prefilled, the second is held at Triton's
    door: at the receive deadline the request fails (UNAVAILABLE, naming the
    embeddings), or the client leaves; either way its KV pages, its receive
    blocks and the encoder's send buffer come back, and the next request runs."""
    broker, encoder, _ = stack
    language = await start_language(
        tiny_checkpoint, broker, transports=(Transport.SHM,), transfer_timeout_s=2.0
    )
    gate = asyncio.Event()
    infer = encoder.pipeline.vit.infer
    calls = 0

    async def second_held(pixels: np.ndarray, grids: np.ndarray) -> VitOutput:
        nonlocal calls
        calls += 1
        if calls == 2:
            await gate.wait()
        return await infer(pixels, grids)

    monkeypatch.setattr(encoder.pipeline.vit, "infer", second_held)
    request_id = f"held-{fault}"
    seed = 970 + 10 * (fault == "client-leaves")  # images no earlier encode cached
    images = [encode_image(random_image(140, 112, seed=seed + i)) for i in range(2)]
    try:
        pair = (broker, encoder, language)
        call = asyncio.ensure_future(
            generate(pair, tiny_checkpoint, request_id, "Compare them.", images, 8)
        )
        await until(lambda: calls == 2 and computed_tokens(language, request_id) > 0, 5)
        started = time.monotonic()
        if fault == "client-leaves":
            call.cancel()
        with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)) as raised:
            await call
        if fault == "never-arrives":
            assert isinstance(raised.value, grpc.aio.AioRpcError)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "image embeddings" in (raised.value.details() or "")
            assert time.monotonic() - started < 10
        await until(lambda: engine_idle(language) and not language.receiver.transfers)
        await until(lambda: language.pool.allocator.num_used_blocks == 0, 20)
        gate.set()
        await until(lambda: encoder.buffer.pool.allocator.num_used_blocks == 0, 20)
        monkeypatch.setattr(encoder.pipeline.vit, "infer", infer)
        responses = await generate(pair, tiny_checkpoint, f"{request_id}-next", "Hi", images, 4)
        assert len(token_ids(responses)) == 4
    finally:
        gate.set()
        await language.stop()


async def test_a_videos_parts_are_prefilled_as_they_come_and_the_tokens_equal_hf(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 12-frame clip goes to Triton a part at a time; each part waits until the
    engine has computed more of the prompt than before (the last part's)."""
    broker, encoder, language = stack
    request_id = "video-while-encoding"
    progress: list[int] = []
    infer = encoder.pipeline.vit.infer

    async def held(pixels: np.ndarray, grids: np.ndarray) -> VitOutput:
        last = progress[-1] if progress else 0
        await until(lambda: computed_tokens(language, request_id) > last, 20)
        progress.append(computed_tokens(language, request_id))
        return await infer(pixels, grids)

    monkeypatch.setattr(encoder.pipeline.vit, "infer", held)
    # 6 s at 2 frames a second: 6 temporal patches, 3 parts. Frames this large keep
    # the clip's time positions below where the text after it resumes: for a long
    # clip of small frames, EPD's decode positions (as vLLM's: past the prompt's
    # largest) and transformers 5's generate() part from the second token on,
    # streamed or not
    clip = random_video(num_frames=60, width=336, height=308, fps=10, seed=995)
    rule = VideoRule.from_checkpoint(tiny_checkpoint)
    pixels, grid = load_video(clip, rule)
    hint = rule.grid(probe(clip))
    assert hint == grid and grid.t >= 3 * VIDEO_PART
    part = language_pb2.VideoPart(
        token_hint=grid.num_tokens(rule.frame.merge_size), grid_hint=to_proto(grid)
    )
    content = [language_pb2.ContentPart(video=part), language_pb2.ContentPart(text="What?")]
    broker.broker.rendezvous.route(request_id, encoder.instance_id, language.instance_id)
    encode = encoder_stub(encoder).Encode(
        encoder_pb2.EncodeRequest(
            request_id=request_id,
            images=[clip],
            video_indices=[0],
            language_instance_id=language.instance_id,
        )
    )
    call = language_stub(language).Generate(
        language_pb2.GenerateRequest(
            request_id=request_id,
            messages=[language_pb2.ChatMessage(role="user", content=content)],
            sampling=common_pb2.SamplingParams(max_tokens=12),
        )
    )
    responses = [r async for r in call]
    await encode
    assert len(progress) == -(-grid.t // VIDEO_PART)
    assert progress == sorted(set(progress))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}]
    expected = await on_a_thread(
        hf_greedy_videos, tiny_checkpoint, messages, [], [HfVideo.of(pixels, grid)], 12
    )
    assert token_ids(responses) == expected


def told_encoding(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> tuple[LLMEngine, list[bool]]:
    """The language instance's engine, with whether it had been told that
    requests await their embeddings at each call of its `method`."""
    _, _, language = stack
    assert isinstance(language.engine, AsyncEngine)
    engine = language.engine.engine
    told: list[bool] = []
    call = getattr(engine, method)

    def recording(*args: Any, **kwargs: Any) -> Any:
        told.append(engine.pacing.encoding)
        return call(*args, **kwargs)

    monkeypatch.setattr(engine, method, recording)
    return engine, told


@pytest.mark.parametrize("num_images", [1, 2])
async def test_a_requests_last_embeddings_prefill_on_every_thread(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    num_images: int,
) -> None:
    """The engine is told a request no longer awaits its embeddings before their
    last part is added, so the step that prefills that part runs on all the
    threads, not on threads_while_encoding: told after it, that step ran on half
    of them beside no tower, some of the time (a one-image TTFT ~55 ms longer on
    2 cores). The parts before the last still find the engine told."""
    engine, encoding_when_added = told_encoding(stack, monkeypatch, "add_media")
    images = [encode_image(random_image(64, 64, seed=40 + i)) for i in range(num_images)]
    responses = await generate(stack, tiny_checkpoint, f"last-{num_images}", "Hi?", images, 2)
    assert token_ids(responses)
    assert encoding_when_added == [True] * (num_images - 1) + [False]
    assert not engine.pacing.encoding


async def test_a_request_is_added_to_an_engine_told_it_awaits_its_embeddings(
    stack: tuple[BrokerServer, EncoderServer, LanguageServer],
    tiny_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine learns that a request awaits its embeddings before the request
    itself, so the step that prefills the text before its first image runs on
    threads_while_encoding beside the tower: told after it, that step ran on
    every thread, the tower's cores too (on 2 cores, 8 ms became 100-300 ms)."""
    engine, encoding_when_added = told_encoding(stack, monkeypatch, "add_request")
    image = encode_image(random_image(64, 64, seed=50))
    responses = await generate(stack, tiny_checkpoint, "told-first", "Hi?", [image], 2)
    assert token_ids(responses)
    assert encoding_when_added == [True]
    assert not engine.pacing.encoding
