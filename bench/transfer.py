"""Data-plane bandwidth per transport and control-plane time per request.

    .venv/bin/python -m bench.transfer [--mib 16] [--repeats 7] [--requests 300]

The broker and a language instance run as their own processes (`epd broker`,
`epd language`), as deployed; this process is the encoder side, with the real
SenderDriver, send buffer and writers.

Bandwidth: a one-image request whose embeddings are `mib` MiB, sent with each
transport into the language instance's receive pool (preallocated for all of
it, so one part); the write is timed where the encoder does it, against a
single-thread memcpy (ctypes.memmove) of the same bytes in the same run;
median of `repeats`.

Control plane: a 64-token image, from the encoder announcing it
(EmbeddingMeta) until its last TransferDone is on the wire: meta -> broker
-> pairing with the language side's Prealloc -> Prealloc relayed -> write ->
TransferDone. p50/p99 over `requests`.

Peer fetch: the same `mib` MiB from another encoder's embedding cache over
`Encoder.Fetch` (what the peers' cache does instead of an encode; both encoders
in this process, the call over loopback gRPC), against the memcpy; median of
`repeats`, bit-exact.

Prefix fetch: a chat's KV pages fetched from another language instance
(`Language.FetchPrefix`, what a turn that moves does instead of its prefill;
the small demo in its dtype here, the holder's engine in a child process,
loopback gRPC), against prefilling the same number of pages on the same idle
instance; the crossover is the fewest pages a fetch beats. Medians of `repeats`.

`--across-hosts` (root: network namespaces, tests/multihost/hosts.py): the
broker and the language instance on one namespace host, this process on
another; NIXL and the gRPC stream against a raw TCP stream of the same bytes
between the same two hosts, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from services.broker.client import BrokerLink
from services.broker.instance import InstanceConfig
from services.encoder.cache import ImageEmbedding
from services.encoder.config import EncoderConfig
from services.encoder.metrics import EncoderMetrics
from services.encoder.peers import Peers
from services.encoder.send_buffer import SendBuffer
from services.encoder.server import EncoderServer
from services.language.config import LanguageConfig
from services.language.engine.config import EngineConfig
from services.language.engine.kv_cache import kv_page_bytes, kv_planes, prefix_digests
from services.language.engine.request import new_request
from services.language.metrics import LanguageMetrics
from services.language.prefix_moves import MoveCost, PageShape, PrefixPeers
from services.language.server import LanguageServer
from services.loadgen.stats import percentile
from services.model.demo import cached_demo_checkpoint
from services.model.spec import load_spec
from services.proto import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    language_pb2,
    language_pb2_grpc,
)
from services.runtime import env
from services.runtime.grpc_server import channel, metrics_registry
from services.runtime.ports import free_port
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.sender_driver import SenderDriver
from services.transfer.transports.base import Part, Writer
from services.transfer.transports.grpc_stream import GrpcWriter
from services.transfer.transports.nixl import NixlWriter
from services.transfer.transports.shm import ShmWriter
from services.wire.dtypes import resolve_dtype
from services.wire.messages import Heartbeat, MediaGrid, Register, Role
from services.wire.request import SamplingParams
from services.wire.transport import Transport

HIDDEN = 128  # the tiny demo model's embedding width (float32: 512 bytes a token)
GOALS = {Transport.SHM: 0.9, Transport.NIXL: 0.7, Transport.GRPC: 0.3}  # vs memcpy
ACROSS_HOSTS_GOALS = {Transport.NIXL: 0.8, Transport.GRPC: 0.5}  # vs a raw TCP stream


@dataclass
class TimedWriter:
    """The real writer, with the duration of every write recorded."""

    writer: Writer
    seconds: list[float] = field(default_factory=list)

    @property
    def transport(self) -> Transport:
        return self.writer.transport

    async def write(self, peer: Register, source: EmbeddingPool, part: Part) -> None:
        started = time.perf_counter()
        await self.writer.write(peer, source, part)
        self.seconds.append(time.perf_counter() - started)

    async def forget(self, instance_id: str) -> None:
        await self.writer.forget(instance_id)

    async def close(self) -> None:
        await self.writer.close()


# A TCP sink on the other host: each round reads a length and that many bytes,
# then answers one byte (so the sender times the whole transfer).
TCP_SINK = """
import socket, struct, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conn, _ = server.accept()
view = memoryview(bytearray(64 << 20))
while header := conn.recv(8, socket.MSG_WAITALL):
    left = struct.unpack("!Q", header)[0]
    while left:
        left -= conn.recv_into(view[: min(left, len(view))])
    conn.sendall(b"k")
"""


def tcp_gbps(prefix: Sequence[str], address: str, nbytes: int, repeats: int) -> float:
    """A raw TCP stream of nbytes to a sink on the other host (`prefix`), median."""
    port = free_port()
    sink = subprocess.Popen([*prefix, sys.executable, "-c", TCP_SINK, str(port)])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = socket.create_connection((address, port), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        payload, times = b"\1" * nbytes, []
        with conn:
            for _ in range(repeats + 1):
                started = time.perf_counter()
                conn.sendall(struct.pack("!Q", nbytes))
                conn.sendall(payload)
                conn.recv(1)
                times.append(time.perf_counter() - started)
        return nbytes / statistics.median(times[1:]) / 1e9
    finally:
        sink.kill()
        sink.wait(10)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """Single-thread memmove with the transports' access pattern: one source
    buffer, destinations alternating between the two halves of a pool twice
    its size (the receiver allocates from alternate halves)."""
    src = bytearray(b"\1" * nbytes)
    dst = bytearray(b"\2" * (2 * nbytes))
    src_ptr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_ptr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        ctypes.memmove(dst_ptr + (i % 2) * nbytes, src_ptr, nbytes)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:]) / 1e9


@contextlib.contextmanager
def process(*args: str, prefix: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """An `epd` command (on another host: `prefix` is its `ip netns exec`, and the
    host's id is its namespace's)."""
    host = {env.HOST_ID.name: prefix[-1]} if prefix else {}
    child = subprocess.Popen(
        [*prefix, sys.executable, "-m", "services.launcher.cli", "--log-level", "WARNING", *args],
        env={**os.environ, **host},
    )
    try:
        yield child
    finally:
        child.terminate()
        child.wait(30)


class EncoderSide:
    """A Sender with one transport, attached to the broker as an encoder."""

    def __init__(self, broker: str, writer: Writer, buffer_tokens: int, host_id: str) -> None:
        self.writer = TimedWriter(writer)
        self.buffer = SendBuffer(
            EmbeddingPool.in_host_memory(
                PoolLayout(buffer_tokens // 256, 256, embedding_planes(HIDDEN))
            )
        )
        self.sender = SenderDriver(
            self.buffer, lambda m: self.link.send(m), {writer.transport: self.writer}, host_id
        )
        self.link = BrokerLink(
            broker,
            Register(
                Role.ENCODER,
                f"bench-{writer.transport.name.lower()}",
                "-",
                host_id,
                (writer.transport,),
                "bench",
            ),
            self.sender.on_message,
            Heartbeat,
        )

    @classmethod
    def with_nixl(cls, broker: str, buffer_tokens: int, host_id: str) -> EncoderSide:
        side = cls(broker, ShmWriter(), buffer_tokens, host_id)  # placeholder writer, replaced:
        nixl = NixlWriter("bench-nixl", side.buffer.pool)
        side.writer = TimedWriter(nixl)
        side.sender.writers = {Transport.NIXL: side.writer}
        side.link.registration = Register(
            Role.ENCODER, "bench-nixl", "-", host_id, (Transport.NIXL,), "bench"
        )
        return side

    async def send(
        self,
        stubs: Stubs,
        peer: Register,
        request_id: str,
        grid: MediaGrid,
    ) -> float:
        """One request through everything; the sender's time from meta to last TransferDone.
        Routed first, as the gateway does: the broker takes embedding metadata only
        from the encoder a request was routed to (this side, the only one attached)."""
        route = await stubs.broker.Route(
            broker_pb2.RouteRequest(request_id=request_id, model="bench", needs_encoder=True)
        )
        assert route.encoder_id == self.link.registration.instance_id, route
        tokens = grid.num_tokens(2)
        generate = stubs.language.Generate(
            language_pb2.GenerateRequest(
                request_id=request_id,
                messages=[
                    language_pb2.ChatMessage(
                        role="user",
                        content=[
                            language_pb2.ContentPart(
                                # No hint: the language side preallocates its default
                                # (all of it, as configured below), receives, then refuses
                                # the prompt as longer than its small context: the
                                # transfer is measured and no prefill runs.
                                image=language_pb2.ImagePart(token_hint=0)
                            ),
                        ],
                    )
                ],
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
        )
        reading = asyncio.ensure_future(_drain(generate))
        image = ImageEmbedding((torch.randn(tokens, HIDDEN),), grid)
        held = await self.buffer.hold(request_id, image.num_tokens, 30)
        self.buffer.write(request_id, 0, image)
        started = time.perf_counter()
        await self.sender.start(peer, self.buffer.meta(held, peer.instance_id, [grid]))
        elapsed = time.perf_counter() - started
        with contextlib.suppress(grpc.aio.AioRpcError):
            await reading  # INVALID_ARGUMENT once the embeddings are in (see above)
        return elapsed


@dataclass
class Stubs:
    broker: broker_pb2_grpc.BrokerStub
    language: language_pb2_grpc.LanguageStub

    async def no_encoder(self) -> None:
        """Until the broker has seen the last encoder side go (5 s at most)."""
        request = broker_pb2.ListInstancesRequest(role=common_pb2.ROLE_ENCODER)
        for _ in range(500):
            if not (await self.broker.ListInstances(request)).instances:
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("the broker still lists an encoder side after 5 s")


async def _drain(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass


async def run(args: argparse.Namespace) -> None:  # Long: the two processes' flags
    folder = cached_demo_checkpoint("tiny")
    tokens = args.mib * 1024 * 1024 // (HIDDEN * 4)
    broker_port, language_port = free_port(), free_port()
    # across hosts (--peer NAMESPACE=ADDRESS): the broker and the language instance
    # on the peer host, listening on its address
    peer, address = args.peer.split("=") if args.peer else ("", "127.0.0.1")
    prefix = ("ip", "netns", "exec", peer) if peer else ()
    listen = ("--host", "0.0.0.0") if peer else ()
    advertise = ("--advertise-host", address) if peer else ()
    broker = f"{address}:{broker_port}"
    with (
        process("broker", "--port", str(broker_port), *listen, prefix=prefix),
        process(
            "language",
            *listen,
            *advertise,
            "--checkpoint",
            str(folder),
            "--model-name",
            "bench",
            "--port",
            str(language_port),
            "--broker",
            broker,
            "--transports",
            "shm,nixl,grpc",
            "--embedding-pool-tokens",
            str(2 * tokens),
            "--max-model-len",
            "32",
            "--kv-cache-mb",
            "8",
            "--default-allocate-tokens",
            str(tokens),
            "--instance-id",
            "bench-language",
            "--dtype",  # the embeddings this bench sends: not auto's bfloat16 on such a CPU
            "float32",
            prefix=prefix,
        ),
    ):
        # The channels are held here: with the cluster token, a call starts in a task.
        channels = channel(broker), channel(f"{address}:{language_port}")
        stubs = Stubs(
            broker_pb2_grpc.BrokerStub(channels[0]),
            language_pb2_grpc.LanguageStub(channels[1]),
        )
        nbytes = tokens * HIDDEN * 4
        if peer:
            baseline, against = tcp_gbps(prefix, address, nbytes, args.repeats), "TCP"
        else:
            baseline, against = memcpy_gbps(nbytes, args.repeats), "memcpy"
        print(
            f"data plane: {args.mib} MiB per request (one part), median of {args.repeats}; "
            + (f"raw TCP stream to {address}" if peer else "single-thread memcpy")
            + f" {baseline:.2f} GB/s"
        )
        print(f"{'transport':<10} {'GB/s':>7} {'vs ' + against:>10} {'goal':>6}")
        host = env.HOST_ID.get()
        goals = ACROSS_HOSTS_GOALS if peer else GOALS
        sides = {
            Transport.SHM: lambda: EncoderSide(broker, ShmWriter(), 2 * tokens, host),
            Transport.NIXL: lambda: EncoderSide.with_nixl(broker, 2 * tokens, host),
            Transport.GRPC: lambda: EncoderSide(broker, GrpcWriter("bench-grpc"), 2 * tokens, host),
        }
        grid = MediaGrid(1, 2 * 128, tokens * 4 // 256)  # tokens = h * w / 4
        for transport, make in sides.items():
            if transport not in goals:
                continue
            side = make()
            await side.link.start(wait_s=60)
            peer = await side.sender.peer("bench-language", wait_s=60)
            for i in range(args.repeats + 1):  # the first sets up connections and mappings
                await side.send(stubs, peer, f"bw-{transport.name}-{i}", grid)
            rate = nbytes / statistics.median(side.writer.seconds[1:]) / 1e9
            name, goal = transport.name.lower(), goals[transport]
            print(f"{name:<10} {rate:>7.2f} {rate / baseline:>9.2f}x {goal:>5.1f}x", flush=True)
            if transport is Transport.SHM:
                await control_plane(stubs, side, peer, args.requests)
            await side.sender.close()
            await side.link.close()
            await stubs.no_encoder()


async def peer_fetch(mib: int, repeats: int) -> None:
    """An embedding of `mib` MiB fetched from another encoder's cache."""
    folder = cached_demo_checkpoint("tiny")
    holder = EncoderServer(
        EncoderConfig(
            checkpoint=folder,
            model_name="bench",
            instance=InstanceConfig(Role.ENCODER, port=0),
            triton_url=f"127.0.0.1:{free_port()}",  # none: the item is put in its cache
            cache_bytes=2 * mib * 2**20,
        )
    )
    await holder.start()
    tokens = mib * 2**20 // (HIDDEN * 4)
    entry = ImageEmbedding((torch.randn(tokens, HIDDEN),), MediaGrid(1, 2, 2 * tokens))
    holder.pipeline.cache.put("bench-item", entry)
    peers = Peers(EncoderMetrics(metrics_registry()))
    seconds = []
    try:
        for _ in range(repeats + 1):  # the first connects
            started = time.perf_counter()
            got = await peers.fetch(holder.grpc.address, "bench-item")
            seconds.append(time.perf_counter() - started)
            assert got is not None and torch.equal(got.planes[0], entry.planes[0])
    finally:
        await peers.close()
        await holder.stop()
    rate = entry.nbytes / statistics.median(seconds[1:]) / 1e9
    print(
        f"peer fetch: {mib} MiB from another encoder's cache in "
        f"{statistics.median(seconds[1:]) * 1e3:.1f} ms, {rate:.2f} GB/s, "
        f"{rate / memcpy_gbps(entry.nbytes, repeats):.2f}x memcpy"
    )


PAGES = (1, 4, 16, 64)  # prefix sizes the crossover is measured at


async def prefix_fetch(repeats: int) -> None:
    """Pages fetched from another language instance against their prefill there
    (a completion's time to its first token, less a one-token call's)."""
    folder = cached_demo_checkpoint("small")
    spec = load_spec(folder)
    dtype = resolve_dtype("auto")
    engine = EngineConfig(max_model_len=2048, kv_cache_bytes=512 << 20, dtype=dtype)
    holder = LanguageServer(
        LanguageConfig(
            folder,
            "bench",
            instance=InstanceConfig(Role.LANGUAGE, port=0),
            engine=engine,
            engine_process=True,
        )
    )
    await holder.start()
    stub = language_pb2_grpc.LanguageStub(channel(holder.grpc.address))
    page_bytes = kv_page_bytes(spec.text, engine.page_size, dtype)
    cost = MoveCost(engine.page_size, page_bytes, prefill_s_per_token=1.0)  # fetch any size
    widths = tuple(plane.width for plane in kv_planes(spec.text))
    shape = PageShape(engine.page_size, dtype, widths)
    peers = PrefixPeers(shape, cost, LanguageMetrics(metrics_registry()))
    rows = []
    try:
        # a call's own time (one prompt token): what a turn that moves pays too
        alone = [await _first_token_s(stub, f"call-{i}", [100 + i]) for i in range(repeats + 1)]
        call_s = statistics.median(alone[1:])
        for pages in PAGES:
            tokens = pages * engine.page_size + 1  # the last token is never a page's
            prefill, fetch = [], []
            for i in range(repeats + 1):  # the first warms up
                prompt = [100 + (7 * i + 13 * t + pages) % 900 for t in range(tokens)]
                prefill.append(await _first_token_s(stub, f"p{pages}-{i}", prompt))
                request = new_request("x", prompt, SamplingParams(max_tokens=1), spec)
                digests = prefix_digests(request, engine.page_size)
                started = time.perf_counter()
                got = await peers.fetch(holder.grpc.address, digests)
                fetch.append(time.perf_counter() - started)
                assert got is not None and got.num_pages == pages
            prefill_s = statistics.median(prefill[1:]) - call_s
            rows.append((pages, prefill_s, statistics.median(fetch[1:])))
    finally:
        await peers.close()
        await holder.stop()
    print(f"prefix fetch ({dtype}, {page_bytes // 1024} KiB a page) vs their prefill, idle:")
    for pages, prefill_s, fetch_s in rows:
        print(
            f"  {pages:>3} pages: fetch {fetch_s * 1e3:7.1f} ms   prefill {prefill_s * 1e3:7.1f} ms"
        )
    crossover = next((p for p, prefill_s, fetch_s in rows if fetch_s < prefill_s), None)
    print(f"  crossover: {crossover if crossover else f'more than {PAGES[-1]}'} pages")


async def _first_token_s(
    stub: language_pb2_grpc.LanguageStub, request_id: str, prompt: list[int]
) -> float:
    """A completion's time to its first token: its prompt's prefill, and a call."""
    request = language_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    started = time.perf_counter()
    async for _ in stub.Generate(request):
        break
    return time.perf_counter() - started


async def control_plane(stubs: Stubs, side: EncoderSide, peer: Register, requests: int) -> None:
    small = MediaGrid(1, 16, 16)
    for i in range(20):
        await side.send(stubs, peer, f"warm-{i}", small)
    latencies = [1000 * await side.send(stubs, peer, f"cp-{i}", small) for i in range(requests)]
    print(
        f"control plane: meta -> broker -> prealloc relayed -> write -> TransferDone, "
        f"64-token image, shm, {requests} requests"
    )
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(f"  p50 {p50:.2f} ms   p99 {p99:.2f} ms   (goal p50 <= 2 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--across-hosts", action="store_true", help="between two network-namespace hosts"
    )
    parser.add_argument("--peer", default="", help=argparse.SUPPRESS)  # NAMESPACE=ADDRESS
    args = parser.parse_args()
    if not args.across_hosts:
        asyncio.run(run(args))
        asyncio.run(peer_fetch(args.mib, args.repeats))
        asyncio.run(prefix_fetch(args.repeats))
        return
    from tests.multihost.hosts import make_network, remove_network

    network = make_network(2)
    here, there = network.hosts
    try:  # this benchmark again, on one host, against the other
        subprocess.run(
            [
                *("ip", "netns", "exec", here.name, sys.executable, "-m", "bench.transfer"),
                *("--mib", str(args.mib), "--repeats", str(args.repeats)),
                *("--peer", f"{there.name}={there.address}"),
            ],
            check=True,
            # UCX would see one machine and share memory between the namespaces:
            # across hosts NIXL goes over the network, here TCP
            env={**os.environ, env.HOST_ID.name: here.name, "UCX_TLS": "tcp"},
        )
    finally:
        remove_network(network)


if __name__ == "__main__":
    main()
