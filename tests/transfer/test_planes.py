"""Every plane of a pool crosses every transport bit-exact: the embeddings and
the deepstack features, in several parts (a receive pool smaller than the
request, so the rest comes through resumes).

Real broker, real language server (on the tiny checkpoint with deepstack levels
named in its vision config, so its receive pool has both planes), and the
encoder's real send buffer, SenderDriver and writers in this process: the
features are random tensors, as no Qwen2.5-VL tower makes deepstack features.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from services.broker.client import BrokerLink
from services.broker.server import BrokerServer
from services.encoder.cache import ImageEmbedding
from services.encoder.send_buffer import SendBuffer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.model.spec import load_spec
from services.runtime import env
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.sender_driver import SenderDriver
from services.transfer.transports.base import Writer
from services.transfer.transports.ends import writers
from services.wire.messages import EmbeddingMeta, Heartbeat, MediaGrid, Register, Role
from services.wire.transport import Transport
from tests.stack import start_broker, start_language
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")

LEVELS = 3


@pytest.fixture(scope="module")
def deepstack_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deepstack") / "tiny"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = list(range(LEVELS))
    (folder / "config.json").write_text(json.dumps(config))
    assert load_spec(folder).vision.deepstack_levels == LEVELS
    return folder


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def broker() -> AsyncIterator[BrokerServer]:
    server = await start_broker()
    yield server
    await server.stop()


@pytest.mark.parametrize(
    ("transport", "device"),
    [
        (Transport.SHM, "cpu"),
        (Transport.NIXL, "cpu"),
        (Transport.GRPC, "cpu"),
        pytest.param(Transport.NIXL, "cuda", marks=pytest.mark.gpu, id="nixl-into-gpu"),
        pytest.param(Transport.GRPC, "cuda", marks=pytest.mark.gpu, id="grpc-into-gpu"),
    ],
    ids=["shm", "nixl", "grpc", "nixl-into-gpu", "grpc-into-gpu"],
)
async def test_embeddings_and_deepstack_arrive_bit_exact_through_resume(
    deepstack_checkpoint: Path, broker: BrokerServer, transport: Transport, device: str
) -> None:
    """On "cuda" the receive pool is GPU memory: NIXL registers it as VRAM, the
    gRPC stream's parts are copied into it (a GPU host without NIXL)."""
    language = await start_language(
        deepstack_checkpoint,
        broker,
        EngineConfig(max_model_len=2048, kv_cache_bytes=64 << 20, device=device),
        transports=(transport,),
        embedding_pool_tokens=1024,
        default_allocate_tokens=1024,
    )
    assert language.pool.tensors[0].device.type == device
    hidden = load_spec(deepstack_checkpoint).text.hidden_size
    layout = PoolLayout(16, 256, embedding_planes(hidden, LEVELS))
    assert language.pool.layout.planes == layout.planes
    source = EmbeddingPool.in_host_memory(layout)
    encoder_id = f"planes-encoder-{transport.name.lower()}-{device}"
    try:
        async with _encoder(
            broker, encoder_id, source, writers([transport], encoder_id, source, 30)
        ) as sender:
            grid = MediaGrid(1, 50, 200)  # 2500 tokens: three parts through a 1024-token pool
            planes = tuple(torch.randn(grid.num_tokens(2), p.width) for p in layout.planes)
            request_id = f"planes-{transport.name}-{device}"
            meta = await _send(broker, language, sender, encoder_id, request_id, grid, planes)
            assert meta.planes == layout.planes
            got = list((await language.receiver.take(request_id)).values())  # in plane order
            assert len(got) == 2
            assert all(torch.equal(g.cpu(), p) for g, p in zip(got, planes, strict=True))
            pairing = broker.broker.rendezvous.describe(request_id)
            assert pairing is not None and pairing.num_resumes == 2
            language.pool.allocator.check_integrity()
            # a GPU pool's blocks come back once the copy out of them ran (staging)
            await until(lambda: language.pool.allocator.num_used_blocks == 0)
    finally:
        await language.stop()


@contextlib.asynccontextmanager
async def _encoder(
    broker: BrokerServer,
    encoder_id: str,
    source: EmbeddingPool,
    by_transport: Mapping[Transport, Writer],
) -> AsyncIterator[SenderDriver]:
    """The encoder's send buffer and SenderDriver over these writers, in this
    process, attached to the broker on the language server's host (shm needs it)."""
    host = env.HOST_ID.get()
    sender = SenderDriver(SendBuffer(source), lambda m: link.send(m), by_transport, host)
    link = BrokerLink(
        broker.address,
        Register(Role.ENCODER, encoder_id, "-", host, tuple(by_transport), "epd-test"),
        sender.on_message,
        Heartbeat,
    )
    try:
        await link.start(wait_s=10)
        yield sender
    finally:
        await sender.close()
        await link.close()


async def _send(
    broker: BrokerServer,
    language: LanguageServer,
    sender: SenderDriver,
    encoder_id: str,
    request_id: str,
    grid: MediaGrid,
    planes: tuple[torch.Tensor, ...],
) -> EmbeddingMeta:
    """One request's embeddings from the encoder side to the language server, routed
    as the broker would; the metadata once every token is in."""
    peer = await sender.peer(language.instance_id, wait_s=10)
    broker.broker.rendezvous.route(request_id, encoder_id, language.instance_id)
    await language.receiver.expect(request_id, 0)
    image = ImageEmbedding(planes, grid)
    held = await sender.buffer.hold(request_id, image.num_tokens, 5)
    sender.buffer.write(request_id, 0, image)
    await sender.start(peer, sender.buffer.meta(held, peer.instance_id, [grid]))
    return await language.receiver.wait(request_id)


class _UnmappableShm:
    """An shm writer whose segment cannot be opened, as in a container without the
    receiver's IPC namespace (the one stand-in here: the real failure needs two
    namespaces)."""

    transport = Transport.SHM

    async def write(self, peer: Register, source: EmbeddingPool, part: object) -> None:
        raise FileNotFoundError("[Errno 2] No such file or directory: '/epd-pool-embeddings'")

    async def forget(self, instance_id: str) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_mapping_that_fails_falls_back_to_grpc_and_stays_off(
    deepstack_checkpoint: Path, broker: BrokerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The failed part goes again over gRPC and arrives bit-exact; the next request
    to that language instance is announced over gRPC from the start."""
    language = await start_language(
        deepstack_checkpoint, broker, transports=(Transport.SHM, Transport.GRPC)
    )
    hidden = load_spec(deepstack_checkpoint).text.hidden_size
    layout = PoolLayout(16, 256, embedding_planes(hidden, LEVELS))
    source = EmbeddingPool.in_host_memory(layout)
    encoder_id = "fallback-encoder"
    grpc_writer = writers([Transport.GRPC], encoder_id, source, 30)[Transport.GRPC]
    by_transport = {Transport.SHM: _UnmappableShm(), Transport.GRPC: grpc_writer}
    try:
        async with _encoder(broker, encoder_id, source, by_transport) as sender:
            peer = await sender.peer(language.instance_id, wait_s=10)
            assert sender.transport_to(peer) is Transport.SHM
            for i in range(2):
                grid = MediaGrid(1, 20, 20)
                planes = tuple(torch.randn(grid.num_tokens(2), p.width) for p in layout.planes)
                request_id = f"fallback-{i}"
                meta = await _send(broker, language, sender, encoder_id, request_id, grid, planes)
                assert meta.transport is (Transport.SHM if i == 0 else Transport.GRPC)
                got = list((await language.receiver.take(request_id)).values())  # in plane order
                assert all(torch.equal(g, p) for g, p in zip(got, planes, strict=True))
            assert "shm write to" in caplog.text and "this part goes over grpc" in caplog.text
            assert sender.buffer.pool.allocator.num_used_blocks == 0
        assert language.pool.allocator.num_used_blocks == 0
    finally:
        await language.stop()
