"""A writer lets go of a peer only once no write into it runs: a write
cancelled mid-copy, its peer lost right after, does not crash the process (a
decode instance dying during a KV hand-off did: SIGSEGV in the shm copy). The
shm writer closes the peer's mapping only after the copy's thread is done with
it; NIXL (1.5) fails a transfer whose remote agent was removed under it, so its
polling thread ends with an error, not a crash. The scenario runs in a child
process, which a failure kills. The gRPC stream writer's peer is a process
that dies with the first chunk in: the write fails at once with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import grpc
import pytest
import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout
from services.transfer.transports.base import Part
from services.transfer.transports.grpc_stream import GrpcWriter
from services.transfer.transports.nixl import NixlReceiver, NixlWriter, nixl_available
from services.transfer.transports.shm import ShmWriter
from services.wire.messages import GrpcPool, Plane, PoolDescriptor, Register, Role, ShmPool

BLOCKS, BLOCK_SIZE, WIDTH = 64, 256, 4096  # 256 MiB a pool: a copy takes a while


async def _cancel_mid_copy_then_forget(transport: str) -> None:
    layout = PoolLayout(BLOCKS, BLOCK_SIZE, (Plane("embeddings", WIDTH),), torch.float32)
    source = EmbeddingPool.in_host_memory(layout)
    if transport == "shm":
        target = EmbeddingPool.in_shared_memory(layout)
        endpoint = {"shm": ShmPool(target.shm_names)}
        writer: ShmWriter | NixlWriter = ShmWriter()
    else:
        target = EmbeddingPool.in_host_memory(layout)
        receiver = NixlReceiver("epd-decode-0", target)
        receiver.start(busy=lambda: True)
        endpoint = {"nixl": receiver.endpoint()}
        writer = NixlWriter("prefill-0", source)
    pool = PoolDescriptor(BLOCKS, BLOCK_SIZE, layout.planes, layout.dtype, **endpoint)
    peer = Register(Role.LANGUAGE, "decode-0", "d:1", "h", pool.transports, "m", pool)
    everything = list(range(BLOCKS))
    try:
        for _ in range(5):
            part = Part("r", everything, 0, BLOCKS * BLOCK_SIZE, everything)
            writing = asyncio.ensure_future(writer.write(peer, source, part))
            await asyncio.sleep(0.002)  # the copy has started on its thread
            writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writing
            await writer.forget(peer.instance_id)  # the peer is lost
        await writer.close()
    finally:
        if transport == "nixl":
            receiver.close()
        target.close()


def main(transport: str) -> None:
    asyncio.run(_cancel_mid_copy_then_forget(transport))
    print("whole")


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_a_write_cancelled_mid_copy_and_its_peer_forgotten_crash_nothing(transport: str) -> None:
    if transport == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed")
    script = f"from tests.transfer.test_writers_mid_write import main; main({transport!r})"
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # (NIXL logs to stdout; it refuses a transfer whose remote agent went, and says so)
    assert (child.returncode, child.stdout[-6:]) == (0, "whole\n"), child.stderr[-2000:]


# A PushEmbeddings server that dies, the whole process at once, as its first chunk lands.
DYING_PEER = """
import asyncio, os, grpc

async def push(chunks, context):
    async for _ in chunks:
        os._exit(0)

async def main():
    server = grpc.aio.server()
    handler = grpc.stream_unary_rpc_method_handler(push)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("epd.v1.Language", {"PushEmbeddings": handler})]
    )
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


async def test_a_grpc_write_whose_peer_dies_mid_stream_fails_at_once() -> None:
    peer_process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DYING_PEER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert peer_process.stdout is not None
        port = int(await peer_process.stdout.readline())
        layout = PoolLayout(BLOCKS, BLOCK_SIZE, (Plane("embeddings", WIDTH),), torch.float32)
        source = EmbeddingPool.in_host_memory(layout)
        grpc_pool = GrpcPool(f"127.0.0.1:{port}")
        pool = PoolDescriptor(BLOCKS, BLOCK_SIZE, layout.planes, layout.dtype, grpc=grpc_pool)
        peer = Register(Role.LANGUAGE, "language-0", "l:1", "h", pool.transports, "m", pool)
        writer = GrpcWriter("encoder-0", timeout_s=60)
        everything = list(range(BLOCKS))
        part = Part("r", everything, 0, BLOCKS * BLOCK_SIZE, everything)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await writer.write(peer, source, part)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 10  # not the writer's 60 s timeout
        assert await asyncio.wait_for(peer_process.wait(), 10) == 0  # it died where made to
        await writer.forget(peer.instance_id)
        await writer.close()
    finally:
        if peer_process.returncode is None:
            peer_process.kill()
            await peer_process.wait()
