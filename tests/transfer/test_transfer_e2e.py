"""Embeddings from the encoder into the language pool, with every real part:
tritonserver, the broker, the encoder and language gRPC servers, shared
memory, NIXL agents, gRPC streams."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.broker.server import BrokerServer
from services.encoder.pipeline import VIDEO_PART
from services.encoder.server import EncoderServer
from services.language.server import LanguageServer
from services.layers.vision_tower import fuse_vision_tower
from services.loadgen.synthetic import encode_image, random_image, random_video
from services.model.checkpoint import load_vision_tower
from services.model.spec import load_spec
from services.proto import broker_pb2, encoder_pb2
from services.transfer.state import TransferFailedError
from services.triton.launcher import TritonServer
from services.wire.transport import Transport
from tests.embeddings import tower_embeddings
from tests.processes import epd_process
from tests.stack import (
    broker_stub,
    encoder_stub,
    encoder_stub_at,
    start_broker,
    start_encoder,
    start_language,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def broker() -> AsyncIterator[BrokerServer]:
    server = await start_broker()
    yield server
    await server.stop()


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def encoder(
    tiny_checkpoint: Path, triton: TritonServer, broker: BrokerServer
) -> AsyncIterator[EncoderServer]:
    server = await start_encoder(tiny_checkpoint, triton, broker, send_buffer_tokens=32768)
    yield server
    await server.stop()


async def language_with(
    checkpoint: Path, broker: BrokerServer, transports: tuple[Transport, ...], **overrides: object
) -> LanguageServer:
    return await start_language(checkpoint, broker, transports=transports, **overrides)


def images(n: int, seed: int, size: tuple[int, int] | None = None, fmt: str = "PNG") -> list[bytes]:
    sizes = [size or (224 + 28 * i, 196 + 14 * i) for i in range(n)]
    return [
        encode_image(random_image(w, h, seed=seed * 10 + i), fmt) for i, (w, h) in enumerate(sizes)
    ]


async def receive(
    broker: BrokerServer,
    language: LanguageServer,
    encoder: EncoderServer,
    request_id: str,
    data: list[bytes],
    hint: int,
    meta_first: bool = False,
) -> torch.Tensor:
    """Preallocates on L and encodes on E (in either order); returns what landed in L."""
    encode = encode_into(broker, encoder, language, request_id, data)
    if meta_first:

        def meta_waiting() -> bool:
            pairing = broker.broker.rendezvous.describe(request_id)
            return pairing is not None and pairing.meta is not None and pairing.prealloc is None

        await _wait_until(meta_waiting, 5)
    await language.receiver.expect(request_id, hint)
    await encode  # Encode answers once the embeddings have landed
    await language.receiver.wait(request_id)
    embeddings = (await language.receiver.take(request_id))["embeddings"]
    return embeddings


def encode_into(
    broker: BrokerServer,
    encoder: EncoderServer | tuple[str, str],
    language: LanguageServer | str,
    request_id: str,
    data: list[bytes],
) -> asyncio.Future[encoder_pb2.EncodeReply]:
    """Routes the request to this pair, as the gateway's Route does, then encodes on
    the encoder (a server, or its (instance id, address)); started now."""
    if isinstance(encoder, EncoderServer):
        encoder_id, stub = encoder.instance_id, encoder_stub(encoder)
    else:
        encoder_id, stub = encoder[0], encoder_stub_at(encoder[1])
    target = language.instance_id if isinstance(language, LanguageServer) else language
    broker.broker.rendezvous.route(request_id, encoder_id, target)
    return asyncio.ensure_future(
        stub.Encode(
            encoder_pb2.EncodeRequest(
                request_id=request_id, images=data, language_instance_id=target
            )
        )
    )


def assert_pools_full(language: LanguageServer, encoder: EncoderServer) -> None:
    language.pool.allocator.check_integrity()
    encoder.buffer.pool.allocator.check_integrity()
    assert language.pool.allocator.num_used_blocks == 0
    assert encoder.buffer.pool.allocator.num_used_blocks == 0
    assert not language.receiver.transfers
    assert not encoder.sender.transfers


@pytest.mark.parametrize(
    "transport", [Transport.SHM, Transport.NIXL, Transport.GRPC], ids=lambda t: t.name.lower()
)
@pytest.mark.parametrize("num_images", [1, 3])
async def test_embeddings_arrive_bit_exact(
    tiny_checkpoint: Path,
    broker: BrokerServer,
    encoder: EncoderServer,
    transport: Transport,
    num_images: int,
) -> None:
    language = await language_with(tiny_checkpoint, broker, (transport,))
    try:
        data = images(num_images, seed=int(transport) * 7 + num_images)
        got = await receive(
            broker, language, encoder, f"exact-{transport.name}-{num_images}", data, hint=0
        )
        assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))
        pairing = broker.broker.rendezvous.describe(f"exact-{transport.name}-{num_images}")
        assert pairing is not None and pairing.phase.name == "DONE"
        await asyncio.sleep(0.05)  # the encoder frees its buffer on its own TransferDone
        assert_pools_full(language, encoder)
    finally:
        await language.stop()


@pytest.mark.parametrize("meta_first", [False, True], ids=["prealloc-first", "meta-first"])
async def test_both_arrival_orders(
    tiny_checkpoint: Path, broker: BrokerServer, encoder: EncoderServer, meta_first: bool
) -> None:
    language = await language_with(tiny_checkpoint, broker, (Transport.SHM,))
    try:
        data = images(2, seed=40 + meta_first)
        got = await receive(broker, language, encoder, f"order-{meta_first}", data, 0, meta_first)
        assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))
    finally:
        await language.stop()


async def test_each_image_arrives_as_its_own_part_while_the_next_is_encoded(
    tiny_checkpoint: Path, broker: BrokerServer, encoder: EncoderServer
) -> None:
    """The encoder sends each image as soon as Triton has encoded it: the
    language side takes them part by part, in order, each before the encode of
    the last has ended, and together they are the tower's embeddings, bit-exact."""
    language = await language_with(tiny_checkpoint, broker, (Transport.SHM,))
    try:
        data = images(3, seed=61)
        request_id = "one-by-one"
        encode = encode_into(broker, encoder, language, request_id, data)
        await language.receiver.expect(request_id, 0)
        parts, early = [], 0
        async for meta, planes in language.receiver.parts(request_id):
            assert len(meta.grids) == 3
            parts.append(planes["embeddings"])
            early += not encode.done()
        await encode
        assert len(parts) == 3  # one a part: each image ends one
        assert early >= 2  # the first ones arrived while the encode went on
        assert torch.equal(torch.cat(parts), tower_embeddings(tiny_checkpoint, data))
        await asyncio.sleep(0.05)
        assert_pools_full(language, encoder)
    finally:
        await language.stop()


async def test_a_video_arrives_in_parts_equal_to_the_whole_videos_encode(
    tiny_checkpoint: Path, broker: BrokerServer, encoder: EncoderServer
) -> None:
    """A video goes to Triton a few temporal patches at a time, each part sent as
    it comes; together they are what the tower makes of the whole clip, bit-exact
    (it attends within a temporal patch)."""
    language = await language_with(tiny_checkpoint, broker, (Transport.SHM,))
    try:
        video = random_video(num_frames=40, width=112, height=84, fps=10, seed=62)
        request_id = "video-in-parts"
        broker.broker.rendezvous.route(request_id, encoder.instance_id, language.instance_id)
        encode = encoder_stub(encoder).Encode(
            encoder_pb2.EncodeRequest(
                request_id=request_id,
                images=[video],
                video_indices=[0],
                language_instance_id=language.instance_id,
            )
        )
        await language.receiver.expect(request_id, 0)
        parts = [p["embeddings"] async for _, p in language.receiver.parts(request_id)]
        await encode
        (pre,) = await encoder.preprocessor.preprocess([(0, video)], {0})
        assert pre.grid.t > VIDEO_PART and len(parts) == -(-pre.grid.t // VIDEO_PART)
        spec = load_spec(tiny_checkpoint)
        with torch.no_grad():
            tower = load_vision_tower(tiny_checkpoint, spec, dtype=torch.float32)
            fuse_vision_tower(tower)
            grid = torch.tensor([[pre.grid.t, pre.grid.h, pre.grid.w]])
            whole = tower(torch.from_numpy(pre.pixel_values), grid_thw=grid).pooler_output
        assert torch.equal(torch.cat(parts), whole)
    finally:
        await language.stop()


@pytest.fixture(scope="module")
def big_request(tiny_checkpoint: Path) -> tuple[list[bytes], torch.Tensor]:
    """Eight 980x980 images: 8 x 35 x 35 = 9800 embedding tokens, and their embeddings."""
    data = images(8, seed=77, size=(980, 980), fmt="JPEG")
    return data, tower_embeddings(tiny_checkpoint, data)


@pytest.mark.parametrize(
    ("transport", "pool_tokens", "allocate", "num_resumes"),
    [
        # 9800 tokens into a 4096-token preallocation: one resume for the rest...
        (Transport.SHM, 32768, 4096, 1),
        (Transport.NIXL, 32768, 4096, 1),
        # ...and with a 1024-token pool, ten parts of at most 1024 tokens.
        (Transport.SHM, 1024, 4096, 9),
        (Transport.GRPC, 2048, 4096, 4),
    ],
    ids=["shm-4096", "nixl-4096", "shm-tight-pool", "grpc-tight-pool"],
)
async def test_large_embedding_completes_through_resume(
    tiny_checkpoint: Path,
    broker: BrokerServer,
    encoder: EncoderServer,
    big_request: tuple[list[bytes], torch.Tensor],
    transport: Transport,
    pool_tokens: int,
    allocate: int,
    num_resumes: int,
) -> None:
    language = await language_with(
        tiny_checkpoint,
        broker,
        (transport,),
        embedding_pool_tokens=pool_tokens,
        default_allocate_tokens=allocate,
    )
    # parts end where the receiver's blocks run out, not also where an image ends
    encoder.pipeline.one_by_one = False
    try:
        request_id = f"big-{transport.name}-{pool_tokens}"
        data, expected = big_request
        got = await receive(broker, language, encoder, request_id, data, hint=0)
        assert got.shape[0] == 9800
        assert torch.equal(got, expected)
        pairing = broker.broker.rendezvous.describe(request_id)
        assert pairing is not None and pairing.num_resumes == num_resumes
        await asyncio.sleep(0.05)
        assert_pools_full(language, encoder)
    finally:
        encoder.pipeline.one_by_one = True
        await language.stop()


async def test_unknown_target_is_not_found(encoder: EncoderServer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await encoder_stub(encoder).Encode(
            encoder_pb2.EncodeRequest(
                request_id="x", images=images(1, 5), language_instance_id="nobody"
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_abort_from_the_language_side_frees_the_encoder(
    tiny_checkpoint: Path,
    broker: BrokerServer,
    encoder: EncoderServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The language side aborts while the encoder's write is in flight (held
    until then, so that the order is certain): the encode fails at once, and
    the blocks come back once the write is over."""
    language = await language_with(tiny_checkpoint, broker, (Transport.SHM,))
    writer = encoder.sender.writers[Transport.SHM]
    write, gate = writer.write, asyncio.Event()

    async def held(*args: Any) -> None:
        await gate.wait()
        await write(*args)

    monkeypatch.setattr(writer, "write", held)
    try:
        encode = encode_into(broker, encoder, language, "aborted", images(1, 9))
        await _wait_until(lambda: "aborted" in encoder.sender.transfers, 5)
        await language.receiver.expect("aborted", 0)
        await _wait_until(lambda: encoder.sender.transfers["aborted"].writing > 0, 5)
        language.receiver.release("aborted", "client went away")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await encode
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "client went away" in info.value.details()
        gate.set()
        await _wait_until(
            lambda: not encoder.sender.num_closing and language.pool.allocator.num_used_blocks == 0,
            5,
        )
        assert_pools_full(language, encoder)
    finally:
        await language.stop()


def has_meta(broker: BrokerServer, request_id: str) -> bool:
    pairing = broker.broker.rendezvous.describe(request_id)
    return pairing is not None and pairing.meta is not None


async def _wait_until(condition: object, timeout_s: float) -> None:
    assert callable(condition)
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def encoder_process_args(
    checkpoint: Path, broker: BrokerServer, triton: TritonServer, instance_id: str
) -> list[str]:
    """`epd encoder` on a free port, attached to the test broker and Triton."""
    return [
        "encoder", "--checkpoint", str(checkpoint), "--model-name", "demo-tiny",
        "--port", "0", "--broker", broker.address, "--triton", triton.config.grpc_url,
        "--instance-id", instance_id,
    ]  # fmt: skip


async def test_a_killed_encoder_fails_over_to_another(
    tiny_checkpoint: Path,
    triton: TritonServer,
    broker: BrokerServer,
    encoder: EncoderServer,
    tmp_path: Path,
) -> None:
    """The encoder announced the embeddings and the language side took its meta,
    then it died before any data moved: the language side forgets that meta and
    keeps its blocks, the broker moves the request to another encoder, and the
    embeddings arrive exact."""
    language = await language_with(
        tiny_checkpoint, broker, (Transport.SHM,), transfer_timeout_s=30.0
    )
    args = encoder_process_args(tiny_checkpoint, broker, triton, "doomed-encoder")
    data = images(1, 11)
    try:
        with epd_process(args, tmp_path / "encoder.log") as process:
            await _wait_until(lambda: broker.broker.registry.get("doomed-encoder") is not None, 60)
            address = broker.broker.registry.get("doomed-encoder").registration.grpc_address
            first = encode_into(broker, ("doomed-encoder", address), language, "orphan", data)
            await _wait_until(lambda: has_meta(broker, "orphan"), 5)
            os.killpg(process.pid, signal.SIGSTOP)  # it will never see the preallocation
            await language.receiver.expect("orphan", 0)
            await _wait_until(lambda: language.receiver.transfers["orphan"].meta is not None, 5)
            os.killpg(process.pid, signal.SIGKILL)
            await _wait_until(lambda: broker.broker.registry.get("doomed-encoder") is None, 10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await first
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await _wait_until(lambda: language.receiver.transfers["orphan"].meta is None, 5)
        blocks = list(language.receiver.transfers["orphan"].blocks)
        route = await broker_stub(broker).Route(
            broker_pb2.RouteRequest(
                request_id="orphan",
                model="demo-tiny",
                needs_encoder=True,
                language_id=language.instance_id,
                failed_encoder_id="doomed-encoder",
            )
        )
        assert route.encoder_id == encoder.instance_id
        await encode_into(broker, encoder, language, "orphan", data)
        await language.receiver.wait("orphan")
        assert language.receiver.transfers["orphan"].blocks == blocks  # the same preallocation
        got = (await language.receiver.take("orphan"))["embeddings"]
        assert torch.equal(got, tower_embeddings(tiny_checkpoint, data))
        assert broker.broker.rendezvous.describe("orphan").num_failovers == 1
        language.pool.allocator.check_integrity()
    finally:
        await language.stop()


async def test_killed_language_frees_the_encoder_buffer(
    tiny_checkpoint: Path, broker: BrokerServer, encoder: EncoderServer, tmp_path: Path
) -> None:
    args = [
        "language",
        "--checkpoint",
        str(tiny_checkpoint),
        "--model-name",
        "demo-tiny",
        "--port",
        "0",
        "--broker",
        broker.address,
        "--instance-id",
        "doomed-language",
        "--kv-cache-mb",
        "64",
        "--max-model-len",
        "2048",
    ]
    with epd_process(args, tmp_path / "language.log") as process:
        await _wait_until(lambda: "doomed-language" in encoder.sender.peers, 60)
        encode = encode_into(broker, encoder, "doomed-language", "stranded", images(1, 12))
        await _wait_until(lambda: has_meta(broker, "stranded"), 5)
        assert encoder.buffer.pool.allocator.num_used_blocks > 0
        os.killpg(process.pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await encode
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "doomed-language was lost" in info.value.details()
        await _wait_until(lambda: encoder.buffer.pool.allocator.num_used_blocks == 0, 10)
    assert "stranded" not in encoder.sender.transfers
    assert "doomed-language" not in encoder.sender.peers
    encoder.buffer.pool.allocator.check_integrity()


async def test_hung_encoder_times_out_on_the_language_side(
    tiny_checkpoint: Path, triton: TritonServer, broker: BrokerServer, tmp_path: Path
) -> None:
    language = await language_with(
        # Shorter than the broker's heartbeat timeout: the language side gives up first.
        tiny_checkpoint,
        broker,
        (Transport.SHM,),
        transfer_timeout_s=0.8,
    )
    args = encoder_process_args(tiny_checkpoint, broker, triton, "frozen-encoder")
    try:
        with epd_process(args, tmp_path / "encoder.log") as process:
            await _wait_until(lambda: broker.broker.registry.get("frozen-encoder") is not None, 60)
            address = broker.broker.registry.get("frozen-encoder").registration.grpc_address
            encode = encode_into(
                broker, ("frozen-encoder", address), language, "hung", images(1, 13)
            )
            await _wait_until(lambda: has_meta(broker, "hung"), 5)
            os.killpg(process.pid, signal.SIGSTOP)  # alive, but answers nothing
            await language.receiver.expect("hung", 0)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TransferFailedError, match="did not arrive within"):
                await asyncio.wait_for(language.receiver.wait("hung"), 10)
            assert asyncio.get_running_loop().time() - started < 5
            # It may still write into them: quarantined until the broker declares it lost.
            assert language.receiver.num_quarantined_blocks > 0
            await _wait_until(lambda: language.pool.allocator.num_used_blocks == 0, 10)
            encode.cancel()
    finally:
        await language.stop()


SCENARIOS = st.lists(
    st.tuples(
        st.integers(1, 3),  # images
        st.sampled_from(["exact", "low", "none", "high"]),  # the hint
        st.sampled_from(["never", "early", "late"]),  # when the request is abandoned
    ),
    min_size=1,
    max_size=6,
)


async def test_random_load_returns_every_block(
    tiny_checkpoint: Path, broker: BrokerServer, encoder: EncoderServer
) -> None:
    """Property-based: concurrent requests with wrong hints and abandoned at random
    points, on a pool small enough to force contention and resumes; afterwards
    both pools are whole and consistent."""
    language = await language_with(
        tiny_checkpoint,
        broker,
        (Transport.SHM,),
        embedding_pool_tokens=1024,
        default_allocate_tokens=256,
        transfer_timeout_s=10.0,
    )
    data = images(3, seed=99)
    reply = await encoder_stub(encoder).Encode(encoder_pb2.EncodeRequest(images=data))
    tokens = [g.t * g.h * g.w // 4 for g in reply.grids]
    loop = asyncio.get_running_loop()
    counter = iter(range(1_000_000))

    async def one(num_images: int, hint_mode: str, abandon: str) -> None:
        request_id = f"stress-{next(counter)}"
        exact = sum(tokens[:num_images])
        hint = {"exact": exact, "low": max(1, exact // 3), "none": 0, "high": exact * 2}[hint_mode]
        encode = encode_into(broker, encoder, language, request_id, data[:num_images])
        try:
            await language.receiver.expect(request_id, hint)
            if abandon == "early":
                return
            await encode
            if abandon == "late":
                await asyncio.sleep(0.001 * num_images)
                return
            await language.receiver.wait(request_id)
            got = (await language.receiver.take(request_id))["embeddings"]
            assert got.shape[0] == exact
        finally:
            language.receiver.release(request_id, "the test abandoned it")
            encode.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await encode

    async def scenario(requests: list[tuple[int, str, str]]) -> None:
        await asyncio.gather(*(one(*r) for r in requests))
        await _wait_until(
            lambda: not encoder.sender.transfers and language.pool.allocator.num_used_blocks == 0,
            10,
        )
        assert_pools_full(language, encoder)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(SCENARIOS)
    def check(requests: list[tuple[int, str, str]]) -> None:
        asyncio.run_coroutine_threadsafe(scenario(requests), loop).result(timeout=120)

    try:
        await asyncio.to_thread(check)  # hypothesis drives the loop from a thread
    finally:
        await language.stop()


async def test_a_request_released_while_it_waits_for_blocks_leaves_none(
    tiny_checkpoint: Path, broker: BrokerServer
) -> None:
    language = await language_with(
        tiny_checkpoint, broker, (Transport.SHM,), embedding_pool_tokens=256
    )
    try:
        await language.receiver.expect("holder", 256)  # the pool's only block
        waiter = asyncio.ensure_future(language.receiver.expect("waiter", 256))
        await asyncio.sleep(0.1)
        language.receiver.release("waiter", "the client went away")
        language.receiver.release("holder", "done")
        with pytest.raises(TransferFailedError, match="the client went away"):
            await waiter
        assert language.pool.allocator.num_used_blocks == 0
        language.pool.allocator.check_integrity()
    finally:
        await language.stop()
