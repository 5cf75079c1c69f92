"""The broker over real gRPC: attach streams, heartbeats, eviction, PeerLost,
routing, reconnects after a restart, and the grpcurl view by reflection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch

from services.broker.server import BrokerServer
from services.proto import broker_pb2, broker_pb2_grpc, common_pb2
from services.runtime.grpc_server import channel
from services.runtime.ports import free_port
from services.wire.convert import wrap
from services.wire.messages import (
    CacheReport,
    EmbeddingMeta,
    Heartbeat,
    InstanceJoined,
    MediaGrid,
    PeerLost,
    Plane,
    Prealloc,
    ShmPool,
)
from services.wire.transport import Transport
from tests.broker.peers import Peer, attach, encoder, language, wait_for
from tests.reflection import call_json, list_services
from tests.stack import broker_stub, start_broker

pytestmark = pytest.mark.asyncio(loop_scope="session")
PLANES = (Plane("embeddings", 8),)


@pytest_asyncio.fixture(loop_scope="session")
async def broker() -> AsyncIterator[BrokerServer]:
    server = await start_broker(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    yield server
    await server.stop()


async def test_encoders_learn_about_language_instances(broker: BrokerServer) -> None:
    lang = await attach(broker, language("L1"))
    enc = await attach(broker, encoder("E1"))
    lang2 = await attach(broker, language("L2"))
    await wait_for(lambda: len(enc.of(InstanceJoined)) == 2)
    joined = {m.instance.registration.instance_id for m in enc.of(InstanceJoined)}
    assert joined == {"L1", "L2"}
    assert enc.of(InstanceJoined)[0].instance.registration.pool.shm == ShmPool(("seg",))
    for peer in (lang, enc, lang2):
        await peer.link.close()


async def route(broker: BrokerServer, request_id: str) -> None:
    """Route the request as the gateway does: the broker then hears its metadata
    only from the encoder it picked, and its preallocation only from the language side."""
    reply = await broker_stub(broker).Route(
        broker_pb2.RouteRequest(request_id=request_id, needs_encoder=True)
    )
    assert (reply.encoder_id, reply.language_id) == ("E", "L")


async def test_rendezvous_relays_over_the_streams(broker: BrokerServer) -> None:
    lang = await attach(broker, language("L"))
    enc = await attach(broker, encoder("E"))
    await wait_for(lambda: enc.of(InstanceJoined))
    await route(broker, "r1")
    enc.link.send(EmbeddingMeta("r1", "L", 64, (MediaGrid(1, 16, 16),), PLANES, torch.float32))
    lang.link.send(Prealloc("r1", (3,), 256))
    await wait_for(lambda: lang.of(EmbeddingMeta) and enc.of(Prealloc))
    assert lang.of(EmbeddingMeta)[0].encoder_instance_id == "E"
    assert enc.of(Prealloc)[0].language_instance_id == "L"
    for peer in (lang, enc):
        await peer.link.close()


async def test_silent_instance_is_evicted_and_its_peers_hear_peer_lost(
    broker: BrokerServer,
) -> None:
    lang = await attach(broker, language("L"))
    broker.broker.rendezvous.route("r2", "silent", "L")
    # A raw stream that registers, announces a request, then never heartbeats.
    outgoing: asyncio.Queue[broker_pb2.PeerMessage | None] = asyncio.Queue()
    for message in (
        encoder("silent"),
        EmbeddingMeta("r2", "L", 64, (MediaGrid(1, 16, 16),), PLANES, torch.float32),
    ):
        outgoing.put_nowait(wrap(broker_pb2.PeerMessage, message))

    async def requests() -> AsyncIterator[broker_pb2.PeerMessage]:
        while (m := await outgoing.get()) is not None:
            yield m

    stream = broker_stub(broker).Attach(requests())
    await wait_for(lambda: broker.broker.registry.get("silent") is not None)
    lang.link.send(Prealloc("r2", (1,), 256))
    await wait_for(lambda: lang.of(EmbeddingMeta))
    await wait_for(lambda: lang.of(PeerLost), timeout_s=3)
    assert lang.of(PeerLost)[0].instance_id == "silent"
    assert lang.of(PeerLost)[0].request_ids == ("r2",)
    assert broker.broker.registry.get("silent") is None
    stream.cancel()
    await lang.link.close()


async def test_a_broker_held_up_evicts_no_one_for_its_own_silence(broker: BrokerServer) -> None:
    """The broker's process does not run for longer than the heartbeat timeout
    (here its event loop is blocked; a stopped process or a starved one alike):
    the heartbeats that waited in its sockets meanwhile are not read as silence,
    so no instance is evicted on waking. One that is really silent still is."""
    registry = broker.broker.registry
    lang = await attach(broker, language("L-held"))
    enc = await attach(broker, encoder("E-held"))
    await wait_for(lambda: enc.of(InstanceJoined))
    sessions = {name: registry.get(name) for name in ("L-held", "E-held")}

    async def registers_then_says_nothing() -> AsyncIterator[broker_pb2.PeerMessage]:
        yield wrap(broker_pb2.PeerMessage, encoder("quiet"))
        await asyncio.Event().wait()

    quiet = broker_stub(broker).Attach(registers_then_says_nothing())
    await wait_for(lambda: registry.get("quiet") is not None)
    time.sleep(2.5 * broker.config.heartbeat_timeout_s)  # noqa: ASYNC251 (the point: a stall)
    await asyncio.sleep(broker.config.heartbeat_timeout_s / 2)
    assert {name: registry.get(name) for name in sessions} == sessions  # not evicted, not anew
    lost = {m.instance_id for m in lang.of(PeerLost) + enc.of(PeerLost)}
    assert not lost & set(sessions), lost
    await wait_for(lambda: registry.get("quiet") is None, timeout_s=3)
    quiet.cancel()
    for peer in (lang, enc):
        await peer.link.close()


async def test_route_picks_the_least_loaded_compatible_pair(broker: BrokerServer) -> None:
    peers = [
        await attach(broker, language("busy"), load=9),
        await attach(broker, language("idle"), load=1),
        await attach(broker, language("other-model", model="x"), load=0),
        await attach(broker, encoder("far", host="h2", transports=(Transport.SHM,)), load=0),
        await attach(broker, encoder("near"), load=5),
    ]
    await asyncio.sleep(0.3)  # heartbeats carry the loads
    stub = broker_stub(broker)
    reply = await stub.Route(broker_pb2.RouteRequest(request_id="q", model="m", needs_encoder=True))
    assert (reply.language_id, reply.encoder_id) == ("idle", "near")
    assert reply.transport == common_pb2.TRANSPORT_SHM
    text_only = await stub.Route(broker_pb2.RouteRequest(model="m", needs_encoder=False))
    assert text_only.encoder_id == "" and text_only.language_id in ("idle", "busy")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Route(broker_pb2.RouteRequest(model="nope", needs_encoder=True))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no language instance serves model 'nope'" in info.value.details()
    for peer in peers:
        await peer.link.close()


async def test_route_prefers_the_encoder_whose_cache_holds_the_images(
    broker: BrokerServer,
) -> None:
    peers = [
        await attach(broker, language("L-cache")),
        await attach(broker, encoder("cold")),
        warm := await attach(broker, encoder("warm")),
    ]
    warm.link.send(CacheReport(added=("k1", "k2"), full=True))
    registry = broker.broker.registry
    await wait_for(lambda: registry.get("warm").cached == {"k1", "k2"})  # type: ignore[union-attr]
    stub = broker_stub(broker)

    async def encoder_for(*keys: str) -> str:
        await asyncio.sleep(0.15)  # a heartbeat: what was routed since no longer counts as load
        reply = await stub.Route(
            broker_pb2.RouteRequest(model="m", needs_encoder=True, media_hashes=keys)
        )
        return reply.encoder_id

    assert [await encoder_for("k2") for _ in range(3)] == ["warm"] * 3
    warm.link.send(CacheReport(evicted=("k2",)))
    await wait_for(lambda: registry.get("warm").cached == {"k1"})  # type: ignore[union-attr]
    new = {await encoder_for("k2", "k1"), await encoder_for("k1")}
    assert new == {"warm"}  # still holds k1
    # Nobody holds k9: every repeat goes where its rendezvous hash says.
    assert len({await encoder_for("k9") for _ in range(4)}) == 1
    for peer in peers:
        await peer.link.close()


async def test_the_planners_signals_are_metrics(broker: BrokerServer) -> None:
    """What `--encoders auto` reads, exported for an autoscaler too."""
    lang = await attach(broker, language("L-metrics"))
    busy = await attach(broker, encoder("busy-enc"))
    idle = await attach(broker, encoder("idle-enc"))
    busy.load = Heartbeat(queue_depth=3, encode_seconds=0.4)
    idle.load = Heartbeat(queue_depth=1)
    metrics = broker.broker.metrics

    def value(gauge: Any) -> float:
        return float(gauge.collect()[0].samples[0].value)

    await wait_for(lambda: value(metrics.encoder_queue_depth) == 4)
    assert value(metrics.encode_seconds) == pytest.approx(0.4)  # the idle one is left out
    stub = broker_stub(broker)
    await stub.Route(broker_pb2.RouteRequest(model="m", needs_encoder=False))
    listed = await stub.ListInstances(broker_pb2.ListInstancesRequest())
    assert listed.routed_text >= 1
    for peer in (lang, busy, idle):
        await peer.link.close()


async def test_route_can_ignore_caches() -> None:
    """The baselines: round-robin takes turns whatever the caches hold."""
    server = await start_broker(heartbeat_interval_s=0.1, encoder_routing="round-robin")
    peers = [await attach(server, language("L-rr"))]
    peers += [await attach(server, encoder(f"rr-{i}")) for i in range(3)]
    peers[1].link.send(CacheReport(added=("k1",), full=True))
    await wait_for(lambda: server.broker.registry.get("rr-0").cached == {"k1"})  # type: ignore[union-attr]
    stub = broker_stub(server)
    chosen = [
        (
            await stub.Route(
                broker_pb2.RouteRequest(model="m", needs_encoder=True, media_hashes=["k1"])
            )
        ).encoder_id
        for _ in range(6)
    ]
    assert len(set(chosen[:3])) == 3 and chosen[3:] == chosen[:3]  # each in turn, k1 or not
    for peer in peers:
        await peer.link.close()
    await server.stop()


@pytest.mark.parametrize("peer_cache", [True, False])
async def test_the_route_names_the_encoder_that_holds_or_encodes_an_item(peer_cache: bool) -> None:
    """An item another encoder holds, or was routed first and is encoding, comes
    with that encoder's id and address (the routed one fetches it from there);
    none for an item the routed encoder holds or encodes itself, for one whose
    holder left, and with --no-peer-cache none at all."""
    server = await start_broker(
        heartbeat_interval_s=0.1, encoder_routing="round-robin", peer_cache=peer_cache
    )
    peers = [await attach(server, language("L-peer"))]
    peers += [await attach(server, encoder(f"pc-{i}")) for i in range(3)]
    peers[1].link.send(CacheReport(added=("held",), full=True))
    await wait_for(lambda: server.broker.registry.get("pc-0").cached == {"held"})  # type: ignore[union-attr]
    stub = broker_stub(server)

    async def route(*keys: str) -> tuple[str, list[str], list[str]]:
        request = broker_pb2.RouteRequest(model="m", needs_encoder=True, media_hashes=keys)
        reply = await stub.Route(request)
        return reply.encoder_id, list(reply.holder_ids), list(reply.holder_addresses)

    first, second, third = [await route("held", "new") for _ in range(3)]
    if not peer_cache:
        assert [first[1:], second[1:], third[1:]] == [([], [])] * 3
        assert server.broker.metrics.peer_items._value.get() == 0
    else:
        # round-robin: pc-1, pc-2, pc-0; "new" is claimed by the first that encodes it
        assert [r[0] for r in (first, second, third)] == ["pc-1", "pc-2", "pc-0"]
        assert first[1:] == (["pc-0", ""], ["pc-0:1", ""])
        assert second[1:] == (["pc-0", "pc-1"], ["pc-0:1", "pc-1:1"])
        assert third[1:] == (["", "pc-1"], ["", "pc-1:1"])
        assert server.broker.metrics.peer_items._value.get() == 4
        await peers[2].link.close()  # pc-1 leaves: its claim names nobody
        await wait_for(lambda: server.broker.registry.get("pc-1") is None)
        encoder_id, holders, _ = await route("new")
        assert holders == [""] and encoder_id != "pc-1"
    for peer in peers:
        await peer.link.close()
    await server.stop()


@pytest.mark.parametrize(
    ("routing", "moves"), [("prefix", True), ("least-loaded", True), ("prefix", False)]
)
async def test_a_conversation_s_turns_go_where_its_earlier_turns_went(
    routing: str, moves: bool
) -> None:
    """With prefix routing the next turn (its prefixes extend the last turn's)
    goes to the instance that served the last one, while that one is within the
    load bound, and moves with the turns once it is not; by load alone it goes to
    the least loaded. Where a turn goes elsewhere than the instance sent most of
    its chat, the route names that one (its KV pages move), unless moves are off."""
    server = await start_broker(
        heartbeat_interval_s=0.1, language_routing=routing, prefix_moves=moves
    )
    peers = [await attach(server, language(n), load=load) for n, load in (("A", 3), ("B", 2))]
    await asyncio.sleep(0.3)  # heartbeats carry the loads
    stub = broker_stub(server)

    async def turn(*prefixes: str) -> Any:
        request = broker_pb2.RouteRequest(model="m", prefix_hashes=list(prefixes))
        return await stub.Route(request)

    def holder(reply: Any) -> tuple[str, str, int]:
        return reply.prefix_holder_id, reply.prefix_holder_address, reply.prefix_holder_depth

    first = await turn("c1")
    assert (first.language_id, first.prefix_depth) == ("B", 0)  # the least loaded
    assert holder(first) == ("", "", 0)
    peers[1].load = Heartbeat(num_requests=3)  # as busy as A: within the bound (2 x 3 + 2)
    await asyncio.sleep(0.3)
    second = await turn("c1", "c1-2", "c1-3")
    if routing == "least-loaded":
        assert (second.language_id, second.prefix_depth) == ("A", 0)  # first of the tied
        assert holder(second) == ("B", "B:1", 1)  # B was sent the chat's first message
    else:
        assert (second.language_id, second.prefix_depth) == ("B", 1)
        assert holder(second) == ("", "", 0)
        peers[1].load = Heartbeat(num_requests=30)  # past the bound: the chat moves, and stays
        await asyncio.sleep(0.3)
        third = await turn("c1", "c1-2", "c1-3", "c1-4", "c1-5")
        assert (third.language_id, third.prefix_depth) == ("A", 0)
        assert holder(third) == (("B", "B:1", 3) if moves else ("", "", 0))
        peers[1].load = Heartbeat(num_requests=3)
        await asyncio.sleep(0.3)
        fourth = await turn("c1", "c1-2", "c1-3", "c1-4", "c1-5", "c1-6", "c1-7")
        assert (fourth.language_id, fourth.prefix_depth) == ("A", 5)
        assert holder(fourth) == ("", "", 0)  # B holds less of it than A
    assert server.broker.metrics.prefix_moves._value.get() == (
        int(moves) if routing == "prefix" else 1
    )
    for peer in peers:
        await peer.link.close()
    await server.stop()


async def test_a_route_waits_for_an_instance_that_attaches_and_no_longer() -> None:
    """After a broker restart the instances attach again within a moment: a Route
    in that moment waits for them (route_wait_s), then answers UNAVAILABLE, marked
    as the broker's own answer (the gateway asks again only a broker it cannot reach)."""
    server = await start_broker(heartbeat_interval_s=0.1, route_wait_s=1.5)
    stub = broker_stub(server)
    asked = asyncio.ensure_future(stub.Route(broker_pb2.RouteRequest(model="m")))
    await asyncio.sleep(0.5)
    assert not asked.done()
    peer = await attach(server, language("late"))
    assert (await asked).language_id == "late"
    await peer.link.close()
    await wait_for(lambda: server.broker.registry.get("late") is None)
    started = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Route(broker_pb2.RouteRequest(model="m"))
    waited = asyncio.get_running_loop().time() - started
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and 1.4 < waited < 3
    assert ("epd-route", "answered") in tuple(info.value.trailing_metadata() or ())
    await server.stop()


async def test_route_needs_a_shared_transport(broker: BrokerServer) -> None:
    peers = [
        await attach(broker, language("shm-only-lang", host="h1", shm=True)),
        await attach(broker, encoder("remote-enc", host="h9", transports=(Transport.SHM,))),
    ]
    await asyncio.sleep(0.2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await broker_stub(broker).Route(broker_pb2.RouteRequest(model="m", needs_encoder=True))
    assert "shares a transport" in info.value.details()
    for peer in peers:
        await peer.link.close()


async def test_first_message_must_be_register(broker: BrokerServer) -> None:
    async def requests() -> AsyncIterator[broker_pb2.PeerMessage]:
        yield broker_pb2.PeerMessage(heartbeat=broker_pb2.Heartbeat())

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in broker_stub(broker).Attach(requests()):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_instances_reattach_after_a_broker_restart() -> None:
    port = free_port()
    first = await start_broker(port=port)
    peer = Peer(first.address, language("survivor"))
    await peer.link.start()
    await first.stop()
    await wait_for(lambda: not peer.link.attached.is_set())
    second = await start_broker(port=port)
    try:
        await wait_for(lambda: peer.link.attached.is_set(), timeout_s=10)
        assert peer.link.num_attachments == 2
        assert second.broker.registry.get("survivor") is not None
    finally:
        await peer.link.close()
        await second.stop()


async def test_grpcurl_view_by_reflection(broker: BrokerServer) -> None:
    peer = await attach(broker, language("L-json"))
    services = await asyncio.to_thread(list_services, broker.address)
    assert "epd.v1.Broker" in services
    assert "grpc.health.v1.Health" in services
    reply = await asyncio.to_thread(
        call_json, broker.address, "epd.v1.Broker/ListInstances", {"role": "ROLE_LANGUAGE"}
    )
    ids = [i["registration"]["instanceId"] for i in reply["instances"]]
    assert ids == ["L-json"]
    assert reply["instances"][0]["registration"]["pool"]["blockSize"] == 256
    health = await asyncio.to_thread(
        call_json, broker.address, "grpc.health.v1.Health/Check", {"service": "epd.v1.Broker"}
    )
    assert health["status"] == "SERVING"
    with pytest.raises(grpc.RpcError) as info:
        await asyncio.to_thread(
            call_json, broker.address, "epd.v1.Broker/DescribeRequest", {"requestId": "nope"}
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    await peer.link.close()


async def test_describe_request_shows_the_phase(broker: BrokerServer) -> None:
    lang = await attach(broker, language("L"))
    enc = await attach(broker, encoder("E"))
    await wait_for(lambda: enc.of(InstanceJoined))
    await route(broker, "r9")
    lang.link.send(Prealloc("r9", (1,), 256))
    await wait_for(lambda: broker.broker.rendezvous.describe("r9") is not None)
    stub = broker_pb2_grpc.BrokerStub(channel(broker.address))
    waiting = await stub.DescribeRequest(broker_pb2.DescribeRequestRequest(request_id="r9"))
    assert waiting.phase == broker_pb2.RequestDescription.PHASE_WAITING
    assert waiting.has_prealloc and not waiting.has_meta
    enc.link.send(EmbeddingMeta("r9", "L", 64, (MediaGrid(1, 16, 16),), PLANES, torch.float32))
    await wait_for(lambda: lang.of(EmbeddingMeta))
    paired = await stub.DescribeRequest(broker_pb2.DescribeRequestRequest(request_id="r9"))
    assert paired.phase == broker_pb2.RequestDescription.PHASE_TRANSFERRING
    assert paired.encoder_id == "E" and paired.language_id == "L" and paired.total_tokens == 64
    for peer in (lang, enc):
        await peer.link.close()
