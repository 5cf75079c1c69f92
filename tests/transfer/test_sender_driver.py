"""A transfer whose announcement cannot reach the broker ends as it starts, and
says so to both of its waiters: the Encode waiting for the data to land, and
the one waiting for the receiver's first preallocation (which asks after the
transfer already ended: in CI's test_the_broker_frozen a KeyError there was an
HTTP 500).

Real broker, real BrokerLink (attached, then cut off by the broker's stop), the
encoder's real send buffer, SenderDriver and writers; the language instance is
a registration only, as nothing is written to it.
"""

from __future__ import annotations

import pytest
import torch

from services.broker.client import BrokerLink
from services.encoder.cache import ImageEmbedding
from services.encoder.send_buffer import SendBuffer
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.sender import Failure
from services.transfer.sender_driver import SenderDriver, TransferError
from services.transfer.transports.ends import writers
from services.wire.messages import Heartbeat, MediaGrid, Register, Role
from services.wire.transport import Transport
from tests.broker.peers import language
from tests.stack import start_broker
from tests.until import until

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_transfer_that_cannot_announce_itself_fails_both_waiters_and_frees_its_blocks() -> (
    None
):
    broker = await start_broker()
    layout = PoolLayout(16, 64, embedding_planes(8, 0))
    buffer = SendBuffer(EmbeddingPool.in_host_memory(layout))
    transports = (Transport.SHM, Transport.GRPC)
    sender = SenderDriver(
        buffer,
        lambda m: link.send(m),
        writers(transports, "cut-off-encoder", buffer.pool, 5),
        "h1",
    )
    link = BrokerLink(
        broker.address,
        Register(Role.ENCODER, "cut-off-encoder", "-", "h1", transports, "m"),
        sender.on_message,
        Heartbeat,
    )
    try:
        await link.start(wait_s=10)
        await broker.stop()
        await until(lambda: not link.attached.is_set())

        grid = MediaGrid(1, 8, 8)
        held = await buffer.hold("cut-off", grid.num_tokens(2), 5)
        buffer.write("cut-off", 0, ImageEmbedding((torch.randn(held.num_tokens, 8),), grid))
        peer = language("language-1")
        done = sender.start(peer, buffer.meta(held, peer.instance_id, [grid]))

        with pytest.raises(TransferError, match="broker unavailable") as failed:
            await done
        assert failed.value.failure is Failure.UNAVAILABLE
        with pytest.raises(TransferError, match="ended unpreallocated") as failed:
            await sender.preallocated("cut-off")
        assert failed.value.failure is Failure.ABORTED
        assert buffer.pool.allocator.num_used_blocks == 0
        assert sender.transfers == {}
    finally:
        await sender.close()
        await link.close()
