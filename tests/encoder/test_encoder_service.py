"""The encoder service against a real tritonserver, over real gRPC."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from bench.report import process_cpu
from services.encoder.cache import ImageEmbedding
from services.encoder.server import EncoderServer
from services.encoder.triton_client import IN_USE, TritonUnavailableError, VitClient, unregister
from services.loadgen.synthetic import encode_image, random_image
from services.media.limits import ImageLimits
from services.model.spec import load_spec
from services.proto import broker_pb2, common_pb2, encoder_pb2
from services.runtime import env
from services.runtime.grpc_server import channel
from services.runtime.ports import free_port
from services.transfer.embedding_pool import tensor_from_bytes
from services.transfer.shared_memory import SHM_DIR
from services.triton.launcher import TritonConfig, TritonServer
from services.wire.messages import MediaGrid, media_key
from tests.bad_images import gif, png_header_only, truncated_png
from tests.embeddings import tower_embeddings
from tests.stack import broker_stub, encoder_stub, start_broker, start_encoder
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMITS = ImageLimits(max_images=8, max_image_bytes=2_000_000, max_image_pixels=2000 * 2000)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def encoder(tiny_checkpoint: Path, triton: TritonServer) -> AsyncIterator[EncoderServer]:
    server = await start_encoder(tiny_checkpoint, triton, limits=LIMITS)
    yield server
    await server.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def encoder_without_shm(
    tiny_checkpoint: Path, triton: TritonServer
) -> AsyncIterator[EncoderServer]:
    server = await start_encoder(tiny_checkpoint, triton, limits=LIMITS, triton_shared_memory=False)
    yield server
    await server.stop()


def images(n: int, seed: int) -> list[bytes]:
    sizes = [
        (224, 224),
        (300, 200),
        (150, 420),
        (64, 64),
        (500, 333),
        (96, 700),
        (333, 500),
        (128, 256),
    ]
    return [
        encode_image(random_image(w, h, seed=seed * 100 + i)) for i, (w, h) in enumerate(sizes[:n])
    ]


@pytest.mark.parametrize("num_images", [1, 3, 8])
@pytest.mark.parametrize("shm", [True, False], ids=["triton-shm", "triton-grpc"])
async def test_embeddings_equal_the_vision_tower(
    tiny_checkpoint: Path,
    encoder: EncoderServer,
    encoder_without_shm: EncoderServer,
    num_images: int,
    shm: bool,
) -> None:
    data = images(num_images, seed=num_images + (10 if shm else 20))
    reply = await encoder_stub(encoder if shm else encoder_without_shm).Encode(
        encoder_pb2.EncodeRequest(request_id="r", images=data)
    )
    expected = tower_embeddings(tiny_checkpoint, data)
    got = tensor_from_bytes(reply.data[0], torch.float32, reply.planes[0].width)
    assert reply.total_tokens == expected.shape[0] == got.shape[0]
    assert len(reply.grids) == num_images
    assert torch.equal(got, expected)


async def test_bfloat16_tower_and_embeddings(tiny_checkpoint: Path) -> None:
    """Triton's tower in bfloat16 ($EPD_VIT_DTYPE from `--dtype`), embeddings
    shipped in bfloat16: equal to the in-process tower in bfloat16."""
    config = TritonConfig(
        checkpoint=tiny_checkpoint,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        dtype="bfloat16",
    )
    with TritonServer(config) as triton:
        server = await start_encoder(tiny_checkpoint, triton, dtype=torch.bfloat16)
        try:
            data = images(3, seed=77)
            reply = await encoder_stub(server).Encode(encoder_pb2.EncodeRequest(images=data))
        finally:
            await server.stop()
    expected = tower_embeddings(tiny_checkpoint, data, torch.bfloat16)
    assert reply.dtype == common_pb2.DTYPE_BFLOAT16
    got = tensor_from_bytes(reply.data[0], torch.bfloat16, reply.planes[0].width)
    assert torch.equal(got, expected)


async def test_concurrent_requests_are_batched_by_triton(
    encoder: EncoderServer, triton: TritonServer
) -> None:
    inferences, executions = await _inferences_and_executions(encoder, triton, seed=300)
    assert inferences == 8
    assert executions < inferences


async def test_one_request_a_forward_where_the_tower_shares_cores(
    tiny_checkpoint: Path,
) -> None:
    """configs/shared-cpu.pbtxt (`epd serve` on one host's shared cores): concurrent
    requests each get a forward of their own, and the embeddings their own."""
    config = TritonConfig(
        checkpoint=tiny_checkpoint,
        model_config_name="shared-cpu",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    with TritonServer(config) as triton:
        server = await start_encoder(tiny_checkpoint, triton, limits=LIMITS)
        try:
            counts = await _inferences_and_executions(server, triton, seed=310)
            data = images(1, seed=310)
            reply = await encoder_stub(server).Encode(encoder_pb2.EncodeRequest(images=data))
        finally:
            await server.stop()
    assert counts == (8, 8)
    got = tensor_from_bytes(reply.data[0], torch.float32, reply.planes[0].width)
    assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))


async def _inferences_and_executions(
    encoder: EncoderServer, triton: TritonServer, seed: int
) -> tuple[int, int]:
    """8 one-image Encode calls at once: how many inferences and executions
    Triton counted for them."""
    before = triton.statistics()
    stub = encoder_stub(encoder)
    replies = await asyncio.gather(
        *(stub.Encode(encoder_pb2.EncodeRequest(images=images(1, seed=seed + i))) for i in range(8))
    )
    assert all(r.total_tokens > 0 for r in replies)
    after = await _statistics(triton, before["inference_count"] + 8)
    inferences = after["inference_count"] - before["inference_count"]
    return inferences, after["execution_count"] - before["execution_count"]


async def _statistics(triton: TritonServer, inferences: int) -> dict[str, Any]:
    """Triton's statistics once they count `inferences` (at most 10 s): Triton
    counts an execution once its execute() returns, which may be after the
    response went out, so its statistics catch up within moments."""
    deadline = time.monotonic() + 10
    while True:
        statistics = triton.statistics()
        if statistics["inference_count"] >= inferences or time.monotonic() > deadline:
            return statistics
        await asyncio.sleep(0.05)


async def test_repeated_image_is_served_from_the_cache(
    encoder: EncoderServer, triton: TritonServer
) -> None:
    stub = encoder_stub(encoder)
    data = images(2, seed=400)
    start = triton.statistics()["inference_count"]
    first = await stub.Encode(encoder_pb2.EncodeRequest(images=data))
    before = (await _statistics(triton, start + 2))["inference_count"]  # one an image
    again = await stub.Encode(encoder_pb2.EncodeRequest(images=data[::-1]))
    await asyncio.sleep(0.5)  # what Triton would count of it, it has counted by now
    assert triton.statistics()["inference_count"] == before
    assert first.cached_images == 0
    assert again.cached_images == 2
    # The same embeddings, in the new order.
    hidden = first.planes[0].width
    a = tensor_from_bytes(first.data[0], torch.float32, hidden)
    b = tensor_from_bytes(again.data[0], torch.float32, hidden)
    n0 = first.grids[0].t * first.grids[0].h * first.grids[0].w // 4
    assert torch.equal(a[:n0], b[b.shape[0] - n0 :])


BAD_REQUESTS = [
    ([b"garbage"], "image 0: not a valid image"),
    ([images(1, 1)[0], truncated_png()], "image 1: corrupt or truncated image"),
    ([gif()], "image 0: format GIF is not supported"),
    ([png_header_only(0, 16)], "image 0: not a valid image"),
    (
        [png_header_only(3000, 3000)],
        "image 0: 3000x3000 = 9000000 pixels exceeds the limit of 4000000",
    ),
    ([png_header_only(60000, 60000)], "image 0: declared size exceeds the limit of 4000000 pixels"),
    ([b"\x89PNG" + bytes(2_100_000)], "image 0: 2100004 bytes exceeds the limit of 2000000 bytes"),
    ([encode_image(random_image(1000, 2))], "image 0: image aspect ratio 1000x2 exceeds 200:1"),
    (images(1, 2) * 9, "too many images: 9 > limit of 8"),
    ([], "no images to encode"),
]


@pytest.mark.parametrize(("data", "message"), BAD_REQUESTS)
async def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    encoder: EncoderServer, data: list[bytes], message: str
) -> None:
    stub = encoder_stub(encoder)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(encoder_pb2.EncodeRequest(images=data))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    ok = await stub.Encode(encoder_pb2.EncodeRequest(images=images(1, seed=500)))
    assert ok.total_tokens > 0


async def test_triton_down_is_unavailable_within_a_bounded_time(tiny_checkpoint: Path) -> None:
    server = await start_encoder(
        tiny_checkpoint, None, triton_url=f"127.0.0.1:{free_port()}", triton_timeout_s=5.0
    )
    try:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await encoder_stub(server).Encode(encoder_pb2.EncodeRequest(images=images(1, seed=600)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Triton" in info.value.details()
        assert time.monotonic() - started < 6.0
    finally:
        await server.stop()


TRACEPARENT = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}


@pytest.mark.parametrize("shm", [True, False], ids=["triton-shm", "triton-grpc"])
async def test_a_traced_infer_goes_over_http_with_the_same_embeddings(
    tiny_checkpoint: Path, triton: TritonServer, monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    """Triton's gRPC server misreads a request's traceparent (triton_client.py's
    docstring): an infer made under a trace goes to its HTTP endpoint instead,
    through the same shared-memory regions, with the same embeddings bit for bit."""
    http_url = f"127.0.0.1:{triton.config.http_port}"
    vit = VitClient(
        triton.config.grpc_url,
        hidden_size=load_spec(tiny_checkpoint).vision.out_hidden_size,
        shared_memory=shm,
        http_url=http_url,
    )
    assert vit._http is not None
    over_http = []
    infer = vit._http.infer

    async def counted(*args: Any, **kwargs: Any) -> Any:
        over_http.append(kwargs["headers"]["traceparent"])
        return await infer(*args, **kwargs)

    monkeypatch.setattr(vit._http, "infer", counted)
    pixels = torch.rand(32, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0)).numpy()
    grids = np.array([[1, 4, 8]], dtype=np.int64)
    try:
        plain = await vit.infer(pixels, grids)
        assert over_http == []
        monkeypatch.setattr("services.runtime.tracing.outgoing", lambda: dict(TRACEPARENT))
        traced = await vit.infer(pixels, grids)
        assert over_http == [TRACEPARENT["traceparent"]]
        assert torch.equal(traced.planes[0], plain.planes[0])
    finally:
        await vit.close()


async def test_a_traced_infer_that_cannot_reach_triton_is_unavailable(
    tiny_checkpoint: Path, triton: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    vit = VitClient(
        triton.config.grpc_url,
        hidden_size=load_spec(tiny_checkpoint).vision.out_hidden_size,
        http_url=f"127.0.0.1:{free_port()}",
    )
    monkeypatch.setattr("services.runtime.tracing.outgoing", lambda: dict(TRACEPARENT))
    try:
        with pytest.raises(TritonUnavailableError, match="Triton at"):
            await vit.infer(np.zeros((16, 3 * 2 * 14 * 14), np.float32), np.array([[1, 4, 4]]))
    finally:
        await vit.close()


async def test_health_and_metrics(encoder: EncoderServer) -> None:
    import urllib.request

    health = health_pb2_grpc.HealthStub(channel(encoder.address))
    reply = await health.Check(health_pb2.HealthCheckRequest(service="epd.v1.Encoder"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    url = f"http://127.0.0.1:{encoder.grpc.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in (
        "epd_encoder_requests_total",
        "epd_encoder_images_total",
        "epd_encoder_image_tokens_total",
        "epd_encoder_cache_hits_total",
        "epd_encoder_triton_seconds_bucket",
        "epd_encoder_send_buffer_bytes",
    ):
        assert name in text


async def test_cancelled_encodes_under_a_burst_leave_the_slots_whole(
    tiny_checkpoint: Path, encoder: EncoderServer
) -> None:
    """More concurrent encodes than Triton slots, of growing sizes, half of them
    abandoned by their callers midway: afterwards every slot is back, the regions
    on /dev/shm are the slots' own, and encodes stay exact."""
    stub = encoder_stub(encoder)
    vit = encoder.vit
    sizes = [(64 + 40 * i, 48 + 30 * (i % 7)) for i in range(24)]
    data = [encode_image(random_image(w, h, seed=700 + i)) for i, (w, h) in enumerate(sizes)]
    calls = [stub.Encode(encoder_pb2.EncodeRequest(images=[d])) for d in data]

    async def abandon(call: Any, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        call.cancel()

    await asyncio.gather(
        *(abandon(call, 0.01 * i) for i, call in enumerate(calls) if i % 2),
        *(call for i, call in enumerate(calls) if not i % 2),
        return_exceptions=True,
    )
    for _ in range(200):
        if vit._slots.qsize() == len(vit._all_slots):
            break
        await asyncio.sleep(0.05)
    assert vit._slots.qsize() == len(vit._all_slots)
    assert len(list(SHM_DIR.glob(vit.shm_prefix + "*"))) <= 2 * len(vit._all_slots)
    again = [images(3, seed=710 + i)[: 1 + i % 3] for i in range(10)]
    replies = await asyncio.gather(
        *(stub.Encode(encoder_pb2.EncodeRequest(images=d)) for d in again)
    )
    for data, reply in zip(again, replies, strict=True):
        got = tensor_from_bytes(reply.data[0], torch.float32, reply.planes[0].width)
        assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))


async def test_slots_are_made_anew_when_triton_forgets_them(
    tiny_checkpoint: Path, encoder: EncoderServer, triton: TritonServer
) -> None:
    """What a Triton restart does to the registrations."""
    import tritonclient.grpc as triton_grpc

    stub = encoder_stub(encoder)
    await stub.Encode(encoder_pb2.EncodeRequest(images=images(2, seed=720)))
    client = triton_grpc.InferenceServerClient(triton.config.grpc_url)

    def forgotten() -> bool:
        """Triton refuses a region an inference holds, and lets go of a request's
        regions just after its reply has gone out."""
        try:
            client.unregister_system_shared_memory()  # all of them
        except InferenceServerException:
            return False
        return True

    await until(forgotten)
    client.close()
    data = images(2, seed=721)
    reply = await stub.Encode(encoder_pb2.EncodeRequest(images=data))
    got = tensor_from_bytes(reply.data[0], torch.float32, reply.planes[0].width)
    assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))


async def test_a_region_is_unregistered_once_triton_lets_go_of_it(
    tiny_checkpoint: Path, triton: TritonServer
) -> None:
    """Triton refuses to unregister a region an inference holds; with patience,
    `unregister` (what a slot that grows does with its old regions) waits until
    Triton lets go of it, so nothing stays mapped at Triton."""
    vit = VitClient(
        triton.config.grpc_url,
        hidden_size=load_spec(tiny_checkpoint).vision.out_hidden_size,
        max_in_flight=1,
    )
    (slot,) = vit._all_slots
    sent = asyncio.Event()
    infer = vit._client.infer

    async def noted(*args: Any, **kwargs: Any) -> Any:
        sent.set()
        return await infer(*args, **kwargs)

    vit._client.infer = noted  # type: ignore[method-assign]
    side = 160  # seconds of work for the tiny tower
    grid = np.array([[1, side, side]])
    request = asyncio.ensure_future(vit.infer(np.zeros((side * side, 1176), np.float32), grid))
    try:
        await asyncio.wait_for(sent.wait(), 30)
        await asyncio.sleep(0.3)  # the request's way to Triton
        assert slot.input is not None and not request.done()
        with pytest.raises(InferenceServerException, match=IN_USE):
            await unregister(vit._client, slot.input.name)
        await unregister(vit._client, slot.input.name, patience_s=60)
        status = await vit._client.get_system_shared_memory_status(as_json=True)
        assert slot.input.name not in status.get("regions", {})
        (embeddings,) = (await request).planes
        assert embeddings.shape == (side * side // 4, vit.hidden_size)
    finally:
        await vit.close()


async def test_regions_triton_held_when_a_request_timed_out_are_unregistered_later(
    tiny_checkpoint: Path, triton: TritonServer
) -> None:
    """A request that times out at the client still runs in Triton, which refuses to
    unregister its regions when the slot is reset; the slot's next use unregisters
    them once Triton has let go, so their memory does not stay mapped there."""
    vit = VitClient(
        triton.config.grpc_url,
        hidden_size=load_spec(tiny_checkpoint).vision.out_hidden_size,
        max_in_flight=1,
        timeout_s=0.5,
    )
    (slot,) = vit._all_slots
    side = 160  # seconds of work for the tiny tower
    grid = np.array([[1, side, side]])
    try:
        with pytest.raises(TritonUnavailableError):
            await vit.infer(np.zeros((side * side, 1176), np.float32), grid)
        held = set(slot.held_by_triton)
        assert len(held) == 2, held  # its input and output, refused: Triton runs on
        vit.timeout_s = 60.0
        small = np.zeros((16, 1176), np.float32), np.array([[1, 4, 4]])
        for _ in range(100):
            await vit.infer(*small)
            if not slot.held_by_triton:
                break
            await asyncio.sleep(0.1)
        status = await vit._client.get_system_shared_memory_status(as_json=True)
        assert not held & set(status.get("regions", {})), "left registered at Triton"
    finally:
        await vit.close()


async def test_an_encoder_unregisters_at_triton_what_a_killed_one_left(
    tiny_checkpoint: Path, triton: TritonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed encoder's regions stay registered at Triton, mapped, their memory
    alive after their files are removed. Under a prefix that is its alone, the next
    encoder unregisters them once Triton has finished the dead one's inference, and
    keeps its own."""
    monkeypatch.setenv(env.SHM_PREFIX.name, f"epd_reclaim{secrets.token_hex(3)}_")
    hidden_size = load_spec(tiny_checkpoint).vision.out_hidden_size
    dead, successor = (
        VitClient(triton.config.grpc_url, hidden_size=hidden_size, max_in_flight=1)
        for _ in range(2)
    )

    async def registered(vit: VitClient) -> set[str]:
        status = await vit._client.get_system_shared_memory_status(as_json=True)
        return {name for name in status.get("regions", {}) if name.startswith(vit.shm_prefix)}

    async def _any(names: Awaitable[set[str]]) -> bool:
        return bool(await names)

    side = 160  # seconds of work for the tiny tower
    small = np.zeros((16, 1176), np.float32), np.array([[1, 4, 4]])
    try:
        await successor.infer(*small)
        ours = await registered(successor)
        assert len(ours) == 2
        running = asyncio.ensure_future(
            dead.infer(np.zeros((side * side, 1176), np.float32), np.array([[1, side, side]]))
        )
        await _until_async(lambda: _any(registered(dead)), 30)
        # at Triton once the tower computes it (a fixed 0.3 s fell short on a busy
        # machine: the regions were unregistered before it came)
        computed = _stub_cpu_s(triton)
        await _until_async(lambda: _stub_past(triton, computed + 0.2), 30)
        assert not await successor.reclaim(), "its inference still holds the dead one's"
        await running  # Triton finishes it; the dead one's slot stays registered
        left = await registered(dead)
        assert len(left) == 2
        assert await successor.reclaim()
        assert not await registered(dead), "left registered at Triton"
        assert await registered(successor) == ours
        (embeddings,) = (await successor.infer(*small)).planes
        assert embeddings.shape == (4, hidden_size)
    finally:
        await dead.close()
        await successor.close()


async def test_a_slot_stays_taken_while_triton_may_still_use_it(encoder: EncoderServer) -> None:
    """A caller that leaves does not hand its slot to the next request while
    Triton still reads and writes the slot's regions."""
    vit = encoder.vit
    total = len(vit._all_slots)
    big = encode_image(random_image(1400, 1400, seed=730), "JPEG")
    call = encoder_stub(encoder).Encode(encoder_pb2.EncodeRequest(images=[big]))
    for _ in range(400):
        if vit._slots.qsize() == total - 1:
            break
        await asyncio.sleep(0.005)
    call.cancel()
    await asyncio.sleep(0.05)
    assert vit._slots.qsize() == total - 1, "Triton is still running the request"
    for _ in range(600):
        if vit._slots.qsize() == total:
            break
        await asyncio.sleep(0.05)
    assert vit._slots.qsize() == total


def _count(counter: Any) -> float:
    """A Prometheus counter's value, as a scrape reads it."""
    (metric,) = counter.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_total"))


def _held_at_triton(
    pipeline: Any, monkeypatch: pytest.MonkeyPatch, first_fails: bool
) -> tuple[asyncio.Event, asyncio.Queue[int], list[Any]]:
    """Triton's calls counted (each call's number put on the queue), the first
    held until the gate opens, then sent to Triton or, `first_fails`, failed;
    the others go through (the first held too unless it fails)."""
    real, gate, asked = pipeline.vit.infer, asyncio.Event(), asyncio.Queue[int]()
    calls: list[Any] = []

    async def held(*args: Any) -> Any:
        calls.append(args)
        number = len(calls)
        asked.put_nowait(number)
        if number == 1 or not first_fails:
            await gate.wait()
        if number == 1 and first_fails:
            raise RuntimeError("Triton went away")
        return await real(*args)

    monkeypatch.setattr(pipeline.vit, "infer", held)
    return gate, asked, calls


async def test_concurrent_requests_for_a_new_image_share_one_encode(
    encoder: EncoderServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests for one new image, then a fourth with it and another, while
    the first encode is held at Triton's door: Triton is asked twice (the shared
    image once, the other image once) and all four get the one result."""
    pipeline = encoder.pipeline
    gate, asked, calls = _held_at_triton(pipeline, monkeypatch, first_fails=False)
    data = images(2, seed=7100)  # seen by no other test: not cached
    misses, shared = encoder.metrics.cache_misses, encoder.metrics.shared_encodes
    before = _count(misses), _count(shared)
    try:
        tasks = [asyncio.create_task(pipeline.encode([data[0]])) for _ in range(3)]
        assert await asyncio.wait_for(asked.get(), 30) == 1
        tasks.append(asyncio.create_task(pipeline.encode(data)))
        assert await asyncio.wait_for(asked.get(), 30) == 2
    finally:
        gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert len(calls) == 2
    first = results[0].images[0]
    assert all(r.images[0] is first for r in results)
    assert (_count(misses) - before[0], _count(shared) - before[1]) == (2, 3)
    assert not pipeline._pending


async def test_requests_waiting_on_a_failed_encode_encode_it_themselves(
    encoder: EncoderServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encode others wait for fails: its request gets the error, the others
    encode the image themselves (one of them; the other shares that) and get
    its embeddings."""
    pipeline = encoder.pipeline
    gate, asked, calls = _held_at_triton(pipeline, monkeypatch, first_fails=True)
    data = images(1, seed=7200)  # seen by no other test: not cached
    try:
        owner = asyncio.create_task(pipeline.encode(data))
        assert await asyncio.wait_for(asked.get(), 30) == 1
        waiters = [asyncio.create_task(pipeline.encode(data)) for _ in range(2)]
        await asyncio.sleep(0.1)  # both wait on the owner's encode
    finally:
        gate.set()
    with pytest.raises(RuntimeError, match="Triton went away"):
        await owner
    results = await asyncio.wait_for(asyncio.gather(*waiters), 60)
    assert len(calls) == 2
    assert torch.equal(results[0].images[0].planes[0], results[1].images[0].planes[0])
    assert not pipeline._pending


async def test_the_broker_hears_what_enters_and_leaves_the_cache(
    tiny_checkpoint: Path, triton: TritonServer
) -> None:
    """Cache reports over the real Attach stream: inserts, evictions, and the
    whole cache again after a broker restart; the heartbeat's cache figures in
    ListInstances."""
    port = free_port()
    broker = await start_broker(port=port)
    server = await start_encoder(tiny_checkpoint, triton, broker, limits=LIMITS)
    stub = encoder_stub(server)
    a, b, c = (encode_image(random_image(64, 48, seed=7300 + i)) for i in range(3))

    def held() -> set[str] | None:
        session = broker.broker.registry.get(server.instance_id)
        return None if session is None else session.cached

    try:
        await stub.Encode(encoder_pb2.EncodeRequest(images=[a]))
        await until(lambda: held() == {media_key(a)})
        server.pipeline.cache.max_bytes = 2 * server.pipeline.cache.bytes_used  # room for two
        await stub.Encode(encoder_pb2.EncodeRequest(images=[b, c]))
        await until(lambda: held() == {media_key(b), media_key(c)})  # a was evicted
        await stub.Encode(encoder_pb2.EncodeRequest(images=[b]))

        async def load() -> broker_pb2.Heartbeat:
            listed = await broker_stub(broker).ListInstances(broker_pb2.ListInstancesRequest())
            (info,) = listed.instances
            return info.load

        await _until_async(lambda: _is(load(), cached_items=2, cache_lookups=4, cache_hits=1))
        assert (await load()).queue_depth == 0

        await broker.stop()  # a new broker knows nothing: the encoder tells it everything
        broker = await start_broker(port=port)
        await until(lambda: held() == {media_key(b), media_key(c)}, timeout_s=15)
    finally:
        await server.stop()
        await broker.stop()


def _stub_cpu_s(triton: TritonServer) -> float:
    """CPU seconds of the Python backend stubs of `triton` (where the tower runs);
    each test worker has a tritonserver of its own."""
    assert triton._process is not None
    return sum(p.seconds for p in process_cpu().values() if p.parent == triton._process.pid)


async def _stub_past(triton: TritonServer, seconds: float) -> bool:
    return _stub_cpu_s(triton) > seconds


async def _until_async(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _is(load: Awaitable[broker_pb2.Heartbeat], **expected: int) -> bool:
    got = await load
    return all(getattr(got, name) == value for name, value in expected.items())


async def test_the_cache_serves_an_image_only_under_the_salt_it_was_encoded_with(
    encoder: EncoderServer,
) -> None:
    """One image under salt "a", again under "a" (a hit), under "b" and with no
    salt (each a miss: another client's cache scope), and the embeddings equal."""
    pipeline, metrics = encoder.pipeline, encoder.metrics
    data = images(1, seed=7300)  # seen by no other test: not cached
    results = []
    for salt, hit in (("a", False), ("a", True), ("b", False), ("", False)):
        hits, misses = _count(metrics.cache_hits), _count(metrics.cache_misses)
        results.append(await pipeline.encode(data, salt=salt))
        assert (_count(metrics.cache_hits) - hits, _count(metrics.cache_misses) - misses) == (
            int(hit),
            int(not hit),
        ), salt
    first = results[0].images[0]
    assert first is not None
    for result in results[1:]:
        image = result.images[0]
        assert image is not None and torch.equal(image.planes[0], first.planes[0])


def _infers(histogram: Any) -> float:
    """A Prometheus histogram's count: the Triton requests it timed."""
    (metric,) = histogram.collect()
    return next(s.value for s in metric.samples if s.name.endswith("_count"))


class _AskedSink:
    """A sink whose receiver answers which items it holds only when told to."""

    def __init__(self, may_hold: int) -> None:
        self.may_hold = may_hold
        self.landed: list[int] = []
        self.answer: asyncio.Future[frozenset[int]] = asyncio.get_running_loop().create_future()

    async def grids(self, grids: Sequence[MediaGrid]) -> None:
        pass

    def item(self, index: int, embedding: ImageEmbedding, start: int = 0) -> None:
        self.landed.append(index)

    async def held(self) -> frozenset[int]:
        return await self.answer


@pytest.mark.parametrize("held", [frozenset({0}), frozenset()])
async def test_an_item_the_receiver_cannot_hold_is_encoded_before_it_answers(
    encoder: EncoderServer, held: frozenset[int]
) -> None:
    """Two images, the route saying the receiver may hold the first: the second
    goes to Triton and lands while the receiver has not answered; the first is
    encoded after the answer only if the receiver does not hold it."""
    data = images(2, seed=7400 + len(held))  # seen by no other test: not cached
    sink = _AskedSink(may_hold=1)
    triton = encoder.metrics.triton_seconds
    before = _infers(triton)
    encoding = asyncio.create_task(encoder.pipeline.encode(data, sink=sink))
    await until(lambda: sink.landed == [1], timeout_s=30)
    assert not encoding.done() and _infers(triton) == before + 1
    sink.answer.set_result(held)
    encoded = await asyncio.wait_for(encoding, 30)
    assert (encoded.images[0] is None) == bool(held)
    assert sink.landed == [1] if held else sink.landed == [1, 0]
    assert _infers(triton) == before + 2 - len(held)
