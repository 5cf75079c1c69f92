"""The shm writer closes a peer's mapping only once no copy into it runs: a
write cancelled mid-copy, its peer lost right after, does not crash the process
(a decode instance dying during a KV hand-off did: SIGSEGV in the copy). The
scenario runs in a child process, which a failure kills."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import torch

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout
from services.transfer.transports.base import Part
from services.transfer.transports.shm import ShmWriter
from services.wire.messages import Plane, PoolDescriptor, Register, Role, ShmPool

BLOCKS, BLOCK_SIZE, WIDTH = 64, 256, 4096  # 256 MiB a pool: a copy takes a while


async def _cancel_mid_copy_then_forget() -> None:
    layout = PoolLayout(BLOCKS, BLOCK_SIZE, (Plane("embeddings", WIDTH),), torch.float32)
    source = EmbeddingPool.in_host_memory(layout)
    target = EmbeddingPool.in_shared_memory(layout)
    pool = PoolDescriptor(
        BLOCKS, BLOCK_SIZE, layout.planes, layout.dtype, shm=ShmPool(target.shm_names)
    )
    peer = Register(Role.LANGUAGE, "decode-0", "d:1", "h", pool.transports, "m", pool)
    writer = ShmWriter()
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
        target.close()


def main() -> None:
    asyncio.run(_cancel_mid_copy_then_forget())
    print("whole")


def test_a_write_cancelled_mid_copy_and_its_peer_forgotten_crash_nothing() -> None:
    child = subprocess.run(
        [sys.executable, "-c", "from tests.transfer.test_shm_writer import main; main()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (child.returncode, child.stdout) == (0, "whole\n"), child.stderr[-2000:]
