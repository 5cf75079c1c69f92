"""Every plane of a pool crosses every transport bit-exact: the embeddings and
the deepstack features, in several parts (a receive pool smaller than the
request, so the rest comes through resumes).

Real broker, real language server (on the tiny checkpoint with deepstack levels
named in its vision config, so its receive pool has both planes), and the
encoder's real send buffer, SenderDriver and writers in this process: the
features are random tensors, as no Qwen2.5-VL tower makes deepstack features.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from services import env
from services.broker.client import BrokerLink
from services.broker.server import BrokerServer
from services.encoder.cache import ImageEmbedding
from services.encoder.send_buffer import SendBuffer
from services.encoder.sender_driver import SenderDriver
from services.model.spec import load_spec
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.transports.ends import writers
from services.wire.messages import Heartbeat, ImageGrid, Register, Role
from services.wire.transport import Transport
from tests.stack import start_broker, start_language

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
    "transport", [Transport.SHM, Transport.NIXL, Transport.GRPC], ids=lambda t: t.name.lower()
)
async def test_embeddings_and_deepstack_arrive_bit_exact_through_resume(
    deepstack_checkpoint: Path, broker: BrokerServer, transport: Transport
) -> None:
    language = await start_language(
        deepstack_checkpoint,
        broker,
        transports=(transport,),
        embedding_pool_tokens=1024,
        default_allocate_tokens=1024,
    )
    hidden = load_spec(deepstack_checkpoint).text.hidden_size
    layout = PoolLayout(16, 256, embedding_planes(hidden, LEVELS))
    assert language.pool.layout.planes == layout.planes
    source = EmbeddingPool.in_host_memory(layout)
    buffer = SendBuffer(source)
    encoder_id = f"planes-encoder-{transport.name.lower()}"
    host = env.HOST_ID.get()  # the language server's: shm needs the same host
    sender = SenderDriver(
        buffer, lambda m: link.send(m), writers([transport], encoder_id, source, 30), host
    )
    link = BrokerLink(
        broker.address,
        Register(Role.ENCODER, encoder_id, "-", host, (transport,), "epd-test"),
        sender.on_message,
        Heartbeat,
    )
    try:
        await link.start(wait_s=10)
        peer = await sender.peer(language.instance_id, wait_s=10)
        grid = ImageGrid(1, 50, 200)  # 2500 tokens: three parts through a 1024-token pool
        planes = tuple(torch.randn(grid.num_tokens(2), p.width) for p in layout.planes)
        request_id = f"planes-{transport.name}"
        broker.broker.rendezvous.route(request_id, encoder_id, language.instance_id)
        await language.receiver.expect(request_id, 0)
        held = await buffer.hold(request_id, [ImageEmbedding(planes, grid)], 5)
        await sender.start(request_id, peer, held, [grid])
        meta = await language.receiver.wait(request_id)
        assert meta.planes == layout.planes
        got = await language.receiver.take(request_id)
        assert len(got) == 2
        assert all(torch.equal(g, p) for g, p in zip(got, planes, strict=True))
        pairing = broker.broker.rendezvous.describe(request_id)
        assert pairing is not None and pairing.num_resumes == 2
        language.pool.allocator.check_integrity()
        assert language.pool.allocator.num_used_blocks == 0
    finally:
        await sender.close()
        await link.close()
        await language.stop()
