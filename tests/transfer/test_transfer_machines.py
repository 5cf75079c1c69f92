"""The three transfer state machines together, with no server: the encoder's
Sender, the broker's Rendezvous and the language side's Receiver, wired the
way their drivers wire them, driven by hypothesis through random
interleavings, dropped and duplicated messages, slow and failed writes and
dead instances. Each run twice: as an embedding transfer (encoder to language
instance) and as a KV transfer (E/P/D: a prefill instance's pages into a
decode instance's, which keeps them: every part's pages allocated whole,
handed to the request at the end, which frees them). Whatever happens:

- every block of both pools is freed exactly once (the real BlockAllocator
  raises on a double free) and all are free once the dust settles; a send
  buffer is not freed while a write still reads it;
- no write lands in a receive block after it was freed (or given to another
  request): the quarantine holds blocks while a write can still land;
- every request ends on both sides, exactly once, and the language side never
  has embeddings the encoder did not finish sending.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.broker.rendezvous import Rendezvous
from services.transfer import receiver as rx
from services.transfer import sender as tx
from services.transfer.allocator import BlockAllocator
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.state import TransferState
from services.wire.messages import (
    Abort,
    EmbeddingMeta,
    FirstToken,
    KvMeta,
    PeerLost,
    Prealloc,
    Released,
    Resume,
    TransferDone,
    kv_transfer_id,
)
from services.wire.transport import Transport

E, L = "encoder-0", "language-0"
TOKENS = {"a": 3, "b": 9, "c": 14, "d": 30, "e": 10, "f": 12}  # d: several parts of the pool
# Embedding transfers only: the first tokens the language side does not want (its
# prefix cache holds their KV): all of e's, the first of f's.
SKIPS = {"e": 10, "f": 7}
RECEIVE_BLOCKS, RECEIVE_BLOCK_SIZE = 5, 4  # 20 tokens
SEND_BLOCKS, SEND_BLOCK_SIZE = 22, 4  # room for all at once
TIMEOUT_S, QUARANTINE_S, WRITE_TIMEOUT_S = 10.0, 15.0, 8.0  # a write gives up before quarantine


@dataclass
class World:
    kv: bool = False  # E/P/D's KV transfer: E is a prefill instance, L a decode instance
    now: float = 0.0
    e_alive: bool = True
    l_alive: bool = True
    to_broker: deque[tuple[str, Any]] = field(default_factory=deque)
    to_e: deque[Any] = field(default_factory=deque)
    to_l: deque[Any] = field(default_factory=deque)
    waiting: deque[rx.Allocate] = field(default_factory=deque)  # for receive blocks
    writes: dict[str, tuple[tx.Write, float]] = field(default_factory=dict)  # in flight
    confirms: deque[rx.Confirm] = field(default_factory=deque)
    owner: dict[int, str] = field(default_factory=dict)  # receive block -> its request
    send_blocks: dict[str, list[int]] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)  # by the encoder
    expected: set[str] = field(default_factory=set)  # by the language side
    e_outcome: dict[str, bool] = field(default_factory=dict)  # request -> succeeded
    l_outcome: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clock = lambda: self.now  # noqa: E731
        self.sender = tx.Sender(TIMEOUT_S, clock)
        self.broker = Rendezvous(ttl_s=TIMEOUT_S, history_s=1e9, clock=clock)
        layout = PoolLayout(RECEIVE_BLOCKS, RECEIVE_BLOCK_SIZE, embedding_planes(8))
        self.receiver = rx.Receiver(
            layout, 8, TIMEOUT_S, QUARANTINE_S, clock=clock, keeps_blocks=self.kv
        )
        self.receive_pool = BlockAllocator(RECEIVE_BLOCKS, RECEIVE_BLOCK_SIZE)
        self.send_pool = BlockAllocator(SEND_BLOCKS, SEND_BLOCK_SIZE)
        # each request's transfer id (a KV transfer's: the request's + "/kv") and tokens
        self.tokens = {self.id(r): n for r, n in TOKENS.items()}

    def id(self, request: str) -> str:
        return kv_transfer_id(request) if self.kv else request

    def skip(self, request_id: str) -> int:
        return 0 if self.kv else SKIPS.get(request_id, 0)

    # -- the drivers: carrying out each machine's actions ----------------------------

    def on_sender(self, actions: list[tx.Action]) -> None:
        for action in actions:
            if isinstance(action, tx.Send):
                self.to_broker.append((E, action.message))
            elif isinstance(action, tx.Write):
                assert action.request_id not in self.writes, "two writes of one request"
                self.writes[action.request_id] = (action, self.now)
            elif isinstance(action, tx.Free):
                self.send_pool.free(self.send_blocks.pop(action.request_id))
            elif isinstance(action, tx.Preallocated):
                assert action.skip_tokens == self.skip(action.request_id)
            else:
                assert action.request_id not in self.e_outcome, "a request ended twice"
                self.e_outcome[action.request_id] = isinstance(action, tx.Succeed)

    def on_receiver(self, actions: list[rx.Action]) -> None:
        for action in actions:
            if isinstance(action, rx.Send):
                self.to_broker.append((L, action.message))
            elif isinstance(action, rx.Allocate):
                self.waiting.append(action)
            elif isinstance(action, rx.Free):
                for block in action.blocks:
                    del self.owner[block]
                self.receive_pool.free(list(action.blocks))
            elif isinstance(action, rx.Stage):
                assert not self.kv, "a KV receiver stages nothing"
                assert all(self.owner[b] == action.request_id for b in action.blocks)
            elif isinstance(action, rx.Keep):  # the request decodes in them, then frees them
                assert self.kv, "an embedding receiver keeps nothing"
                need = -(-self.tokens[action.request_id] // RECEIVE_BLOCK_SIZE)
                assert len(action.blocks) == need, "the pages do not hold the prompt exactly"
                self.on_receiver([rx.Free(action.blocks)])
            elif isinstance(action, rx.Confirm):
                self.confirms.append(action)
            elif isinstance(action, (rx.Succeed, rx.Fail)):
                assert action.request_id not in self.l_outcome, "a request ended twice"
                self.l_outcome[action.request_id] = isinstance(action, rx.Succeed)

    def to_instances(self, deliveries: list[tuple[str, Any]]) -> None:
        for target, message in deliveries:
            if target == E and self.e_alive:
                self.to_e.append(message)
            elif target == L and self.l_alive:
                self.to_l.append(message)

    # -- events -----------------------------------------------------------------------

    def start(self, request_id: str) -> None:
        if not self.e_alive or request_id in self.send_blocks or request_id in self.e_outcome:
            return
        blocks = self.send_pool.allocate(self.tokens[request_id])
        assert blocks is not None
        self.send_blocks[request_id] = blocks
        self.started.add(request_id)
        self.broker.route(request_id, E, L)
        self.on_sender(self.sender.start(self.meta(request_id)))

    def meta(self, request_id: str) -> EmbeddingMeta | KvMeta:
        tokens = self.tokens[request_id]
        if self.kv:
            return KvMeta(
                request_id,
                L,
                tokens,
                embedding_planes(8),
                torch.float32,
                SEND_BLOCK_SIZE,
                tuple(range(tokens)),
                (FirstToken(7),),
                transport=Transport.SHM,
            )
        return EmbeddingMeta(
            request_id, L, tokens, (), embedding_planes(8), torch.float32, transport=Transport.SHM
        )

    def expect(self, request_id: str, exact_hint: bool) -> None:
        if not self.l_alive or request_id in self.receiver.transfers:
            return
        if request_id in self.l_outcome:
            return
        self.broker.route(request_id, E, L)
        self.expected.add(request_id)
        hint = self.tokens[request_id] if exact_hint else 0
        self.on_receiver(self.receiver.expect(request_id, hint, self.skip(request_id)))

    def _fits(self) -> bool:
        """The first waiting request can be given blocks now (KV: all it asks for)."""
        if not self.waiting or not self.receive_pool.num_free_blocks or not self.l_alive:
            return False
        return not self.kv or self.receive_pool.can_allocate(self.waiting[0].num_tokens)

    def allocate(self) -> None:
        """Hands free receive blocks to the first waiting request, if any fit."""
        if not self._fits():
            return
        action = self.waiting.popleft()
        free_tokens = self.receive_pool.num_free_blocks * RECEIVE_BLOCK_SIZE
        blocks = self.receive_pool.allocate(min(action.num_tokens, free_tokens))
        assert blocks is not None
        for block in blocks:
            self.owner[block] = action.request_id
        self.on_receiver(self.receiver.allocated(action.request_id, blocks))

    def land(self, request_id: str, ok: bool) -> None:
        """The write in flight ends: in the receiver's memory, or failed."""
        if request_id not in self.writes or not self.e_alive:
            return
        write, _ = self.writes.pop(request_id)
        assert request_id in self.send_blocks, "the send buffer was freed while a write read it"
        if not ok:
            self.on_sender(self.sender.write_failed(request_id, "connection reset"))
            return
        assert write.start >= self.skip(request_id), "a skipped token was written"
        if self.l_alive:
            for block in write.dst_blocks:
                assert self.owner.get(block) == request_id, (
                    f"{request_id}: a write landed in block {block}, "
                    f"which is {self.owner.get(block) or 'free'}'s"
                )
        self.on_sender(self.sender.written(request_id))

    def confirm(self) -> None:
        if self.confirms and self.l_alive:
            c = self.confirms.popleft()
            self.on_receiver(self.receiver.arrived(c.request_id, c.sent_tokens))

    def deliver(self, queue: str, fate: str) -> None:
        """The next message on a stream: delivered, dropped, or delivered twice."""
        messages: deque[Any] = getattr(self, queue)
        if not messages:
            return
        message = messages[0] if fate == "twice" else messages.popleft()
        if fate == "drop":
            return
        if queue == "to_broker":
            self.to_instances(self.to_broker_handler(*message))
        elif queue == "to_e":
            self.on_sender(self.sender_handler(message))
        else:
            self.on_receiver(self.receiver_handler(message))

    def to_broker_handler(self, source: str, message: Any) -> list[tuple[str, Any]]:
        alive = self.e_alive if source == E else self.l_alive
        if not alive:
            return []
        b = self.broker
        if isinstance(message, EmbeddingMeta | KvMeta):
            if not self.l_alive:  # the broker's registry no longer knows it
                return [(source, Abort(message.request_id, "not registered"))]
            return b.on_meta(source, message)
        if isinstance(message, Prealloc):
            return b.on_prealloc(source, message)
        if isinstance(message, TransferDone):
            return b.on_transfer_done(source, message)
        if isinstance(message, Resume):
            return b.on_resume(source, message)
        if isinstance(message, Abort):
            return b.on_abort(source, message)
        assert isinstance(message, Released)
        return b.on_released(source, message)

    def sender_handler(self, message: Any) -> list[tx.Action]:
        s = self.sender
        if isinstance(message, Prealloc):
            return s.on_prealloc(message)
        if isinstance(message, Resume):
            return s.on_resume(message)
        if isinstance(message, Abort):
            return s.on_abort(message)
        assert isinstance(message, PeerLost)
        return s.on_peer_lost(message)

    def receiver_handler(self, message: Any) -> list[rx.Action]:
        r = self.receiver
        if isinstance(message, EmbeddingMeta | KvMeta):
            return r.on_meta(message)
        if isinstance(message, TransferDone):
            return r.on_done(message)
        if isinstance(message, Abort):
            return r.on_abort(message)
        if isinstance(message, Released):
            return r.on_released(message)
        assert isinstance(message, PeerLost)
        return r.on_peer_lost(message)

    def caller_leaves(self, request_id: str, side: str) -> None:
        if side == "e" and self.e_alive:
            self.on_sender(self.sender.abort(request_id, "the encode caller went away"))
        elif side == "l" and self.l_alive:
            self.on_receiver(self.receiver.release(request_id, "the client went away"))

    def take(self, request_id: str) -> None:
        inbound = self.receiver.transfers.get(request_id)
        if self.l_alive and inbound is not None and inbound.state is TransferState.SUCCESS:
            self.on_receiver(self.receiver.take(request_id))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        while self.kv and self.waiting and not self._fits() and self.l_alive:
            # KV pages are waited for all at once, up to the pool wait (shorter than a tick)
            action = self.waiting.popleft()
            self.on_receiver(self.receiver.allocation_failed(action.request_id, "no pages"))
        for request_id, (_, started) in list(self.writes.items()):
            if self.now - started > WRITE_TIMEOUT_S:  # the writer's own deadline
                self.land(request_id, ok=False)
        if self.e_alive:
            self.on_sender(self.sender.tick())
        self.to_instances(self.broker.expire())
        if self.l_alive:
            self.on_receiver(self.receiver.tick())

    def replace_encoder(self) -> None:
        """A new encoder process under the dead one's name: a fresh sender; what
        the dead one held in its send buffers went with it."""
        assert not self.e_alive
        self.sender = tx.Sender(TIMEOUT_S, lambda: self.now)
        for blocks in self.send_blocks.values():
            self.send_pool.free(blocks)
        self.send_blocks.clear()
        self.e_alive = True

    def kill(self, instance: str) -> None:
        """kill -9: its writes stop where they are, its streams and messages are gone."""
        if instance == E and self.e_alive:
            self.e_alive = False
            self.writes.clear()
            self.to_e.clear()
        elif instance == L and self.l_alive:
            self.l_alive = False
            self.to_l.clear()
            self.waiting.clear()
            self.confirms.clear()
        else:
            return
        self.to_broker = deque(m for m in self.to_broker if m[0] != instance)
        self.to_instances(self.broker.on_instance_lost(instance))

    def next_event(self, choice: int) -> tuple[Any, ...]:
        """What happens next, from what could: mostly progress (requests start and
        finish), sometimes a fault (a message dropped or doubled, a write that
        fails, a caller that leaves, a stall), rarely a death."""
        progress: list[tuple[Any, ...]] = [("tick", 0.5)]
        faults: list[tuple[Any, ...]] = [("tick", 12.0)]
        for request_id in self.tokens:
            if request_id not in self.started and self.e_alive:
                progress.append(("start", request_id))
            if request_id not in self.expected and self.l_alive:
                progress.append(("expect", request_id, ord(request_id[0]) % 2 == 0))
            inbound = self.receiver.transfers.get(request_id)
            if inbound is not None and inbound.state is TransferState.SUCCESS:
                progress.append(("take", request_id))
            if request_id in self.sender.transfers:
                faults.append(("caller_leaves", request_id, "e"))
            if inbound is not None:
                faults.append(("caller_leaves", request_id, "l"))
        for queue in ("to_broker", "to_e", "to_l"):
            if getattr(self, queue):
                progress += [("deliver", queue, "once")] * 3
                faults += [("deliver", queue, "drop"), ("deliver", queue, "twice")]
        for request_id in self.writes:
            progress.append(("land", request_id, True))
            faults.append(("land", request_id, False))
        if self.confirms:
            progress.append(("confirm",))
        if self.waiting:
            progress.append(("allocate",))
        kind, pick = choice % 400, choice // 400
        if kind == 0:
            return ("kill", E if pick % 2 else L)
        options = faults if kind < 32 else progress
        return options[pick % len(options)]

    # -- the end --------------------------------------------------------------------

    def settle(self) -> None:
        """Everything in flight goes through, then time passes every deadline."""
        for _ in range(200):
            for request_id in self.tokens:  # a caller takes what arrived
                self.take(request_id)
            busy = (
                bool(self.to_broker or self.to_e or self.to_l or self.writes or self.confirms)
                or self._fits()
            )
            if not busy:
                e_done = not self.e_alive or not (self.sender.transfers or self.sender.closing)
                r = self.receiver
                l_done = not self.l_alive or not (r.transfers or r.quarantine or self.waiting)
                if e_done and l_done:
                    return
                self.tick(QUARANTINE_S + TIMEOUT_S)
                continue
            while self.to_broker:
                self.deliver("to_broker", "once")
            while self.to_e:
                self.deliver("to_e", "once")
            while self.to_l:
                self.deliver("to_l", "once")
            for request_id in list(self.writes):
                self.land(request_id, ok=True)
            while self.confirms:
                self.confirm()
            self.allocate()
        raise AssertionError("the machines never settled")


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=150), st.booleans())
def test_random_interleavings_free_every_block_once_and_end_every_request(
    choices: list[int], kv: bool
) -> None:
    world = World(kv)
    for choice in choices:
        name, *args = world.next_event(choice)
        getattr(world, name)(*args)
    world.settle()

    if world.e_alive:
        assert not world.sender.transfers and not world.sender.closing
        assert world.started <= set(world.e_outcome), "a request never ended"
        assert not world.send_blocks, "a send buffer was never freed"
        assert world.send_pool.num_free_blocks == SEND_BLOCKS
        world.send_pool.check_integrity()
    if world.l_alive:
        assert not world.receiver.transfers and not world.receiver.quarantine
        assert world.expected <= set(world.l_outcome), "a request never ended"
        assert not world.owner, f"receive blocks never freed: {world.owner}"
        assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS
        world.receive_pool.check_integrity()
    for request_id, succeeded in world.l_outcome.items():
        if succeeded:  # the language side has it all: the encoder sent it all
            assert world.e_outcome.get(request_id) is True or not world.e_alive


def test_one_request_in_several_parts_arrives_whole() -> None:
    """The plain path, step by step: d (30 tokens) through a 20-token pool."""
    world = World()
    world.start("d")
    world.expect("d", exact_hint=True)
    world.settle()
    assert world.e_outcome == {"d": True} and world.l_outcome == {"d": True}
    assert world.broker.describe("d").num_resumes == 1  # type: ignore[union-attr]


def test_a_request_whose_tokens_are_all_held_is_done_without_blocks_or_writes() -> None:
    """e: the language side's prefix cache holds all of it: its preallocation
    has no blocks, the encoder writes nothing and both sides succeed."""
    world = World()
    world.start("e")
    world.expect("e", exact_hint=True)
    prealloc = next(m for _, m in world.to_broker if isinstance(m, Prealloc))
    assert prealloc.block_ids == () and prealloc.skip_tokens == 10
    world.settle()
    assert world.e_outcome == {"e": True} and world.l_outcome == {"e": True}
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS


def test_held_tokens_are_not_preallocated_and_the_rest_arrive_after_them() -> None:
    """f: its first 7 tokens are held; the blocks are for the 5 after them,
    which are written from token 7 (World.land asserts none before it)."""
    world = World()
    world.start("f")
    world.expect("f", exact_hint=True)
    (allocate,) = world.waiting
    assert allocate.num_tokens == 5
    write = _until_writing(world, "f")
    assert (write.start, write.count) == (7, 5)
    world.settle()
    assert world.e_outcome == {"f": True} and world.l_outcome == {"f": True}


def _until_writing(world: World, request_id: str) -> tx.Write:
    for _ in range(20):
        if request_id in world.writes:
            return world.writes[request_id][0]
        for queue in ("to_broker", "to_e", "to_l"):
            world.deliver(queue, "once")
        world.allocate()
    raise AssertionError(f"{request_id} never started writing")


def test_blocks_given_up_mid_write_stay_quarantined_until_released() -> None:
    world = World()
    world.start("b")
    world.expect("b", exact_hint=True)
    write = _until_writing(world, "b")
    world.caller_leaves("b", "l")  # the client leaves while the encoder writes
    assert world.l_outcome == {"b": False}
    assert world.receiver.quarantine["b"].blocks == list(write.dst_blocks)
    world.deliver("to_broker", "once")  # L's Abort reaches E ...
    world.deliver("to_e", "once")
    assert world.e_outcome == {"b": False}  # ... whose caller hears at once,
    assert world.sender.closing and not world.to_broker  # but Released waits for the write
    world.land("b", ok=True)
    assert [m for _, m in world.to_broker] == [Released("b")]
    world.deliver("to_broker", "once")
    world.deliver("to_l", "once")
    assert not world.receiver.quarantine and not world.owner


def test_an_encoder_lost_before_anything_landed_leaves_the_preallocation_waiting() -> None:
    world = World()
    world.start("a")
    world.expect("a", exact_hint=True)
    _until_writing(world, "a")
    blocks = list(world.receiver.transfers["a"].blocks)
    world.kill(E)  # its write never lands; the broker tells L: PeerLost, not Abort
    assert [type(m) for m in world.to_l] == [PeerLost]
    world.deliver("to_l", "once")
    inbound = world.receiver.transfers["a"]
    assert inbound.meta is None and inbound.blocks == blocks and inbound.num_failovers == 1
    assert "a" not in world.l_outcome


@pytest.mark.parametrize("resume_sent", [True, False])
def test_an_encoder_lost_after_a_part_landed_is_replaced_by_one_that_sends_the_rest(
    resume_sent: bool,
) -> None:
    """d (30 tokens) comes in parts of the 20-token pool. The encoder dies once
    the first part has landed, before or after the language side's Resume for
    the rest reached the broker; a new encoder process takes the request (as
    the gateway's failover routes it): paired with that Resume, it writes from
    the landed tokens on, never before, and both sides end with every block free."""
    world = World()
    world.start("d")
    world.expect("d", exact_hint=True)
    inbound = world.receiver.transfers["d"]
    for _ in range(40):  # the first part lands and is confirmed
        if inbound.part_start:
            break
        for queue in ("to_broker", "to_e", "to_l"):
            world.deliver(queue, "once")
        world.allocate()
        for request_id in list(world.writes):
            world.land(request_id, ok=True)
        world.confirm()
    landed = inbound.part_start
    assert 0 < landed < world.tokens["d"]
    world.allocate()  # the rest's blocks: the Resume goes to the broker
    if resume_sent:
        while world.to_broker:
            world.deliver("to_broker", "once")
    world.kill(E)
    world.replace_encoder()
    world.broker.reroute("d", "", E, L)
    world.start("d")
    writes: list[tx.Write] = []
    on_sender = world.on_sender

    def recorded(actions: list[tx.Action]) -> None:
        skips = [a for a in actions if isinstance(a, tx.Preallocated)]
        assert all(a.skip_tokens == landed for a in skips), "not told where the landed end"
        writes.extend(a for a in actions if isinstance(a, tx.Write))
        on_sender([a for a in actions if not isinstance(a, tx.Preallocated)])

    world.on_sender = recorded  # type: ignore[method-assign]
    world.settle()
    assert world.l_outcome == {"d": True} and world.e_outcome == {"d": True}
    assert writes and writes[0].start == landed
    assert sum(w.count for w in writes) == world.tokens["d"] - landed
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS and not world.owner
    assert world.send_pool.num_free_blocks == SEND_BLOCKS


def test_a_failed_write_aborts_both_sides_and_frees_both_pools() -> None:
    world = World()
    world.start("c")
    world.expect("c", exact_hint=True)
    _until_writing(world, "c")
    world.land("c", ok=False)
    assert world.e_outcome == {"c": False}
    world.settle()
    assert world.l_outcome == {"c": False}
    assert world.send_pool.num_free_blocks == SEND_BLOCKS
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS


def test_kv_pages_arrive_in_parts_and_are_kept_whole() -> None:
    """A KV transfer with no hint: a first part of the default size, then the rest
    all at once; the decode side keeps every page, the prefill side frees its."""
    world = World(kv=True)
    c = world.id("c")
    world.start(c)
    world.expect(c, exact_hint=False)  # 8 tokens first, then 6
    world.settle()
    assert world.e_outcome == {c: True} and world.l_outcome == {c: True}
    assert world.broker.describe(c).num_resumes == 1  # type: ignore[union-attr]
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS
    assert world.send_pool.num_free_blocks == SEND_BLOCKS


def test_a_lost_prefill_instance_aborts_its_kv_transfer() -> None:
    """No other instance holds the KV: the decode side hears Abort, not PeerLost."""
    world = World(kv=True)
    a = world.id("a")
    world.start(a)
    world.expect(a, exact_hint=True)
    _until_writing(world, a)
    world.kill(E)
    assert [type(m) for m in world.to_l] == [Abort]
    world.settle()
    assert world.l_outcome == {a: False}
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS


def test_a_decode_side_without_pages_aborts_and_the_prefill_side_frees_at_once() -> None:
    """A decode instance whose page reservation fails before it preallocated
    anything still says so: the prefill instance gives up its KV pages now, not
    at its transfer timeout (no time passes here)."""
    world = World(kv=True)
    a = world.id("a")
    world.start(a)  # the prefill side holds its part and has announced it
    world.expect(a, exact_hint=True)  # the decode side waits for pages
    world.waiting.clear()
    world.on_receiver(world.receiver.allocation_failed(a, "no free KV pages within 0.5s"))
    assert [type(m) for _, m in world.to_broker][-1] is Abort
    for _ in range(20):  # every message in flight, and nothing else: the clock stays
        for queue in ("to_broker", "to_e", "to_l"):
            _deliver_all(world, queue)
    assert world.e_outcome == {a: False} and world.l_outcome == {a: False}
    assert world.send_pool.num_free_blocks == SEND_BLOCKS
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS


def _deliver_all(world: World, queue: str) -> None:
    while getattr(world, queue):
        world.deliver(queue, "once")


def test_a_give_up_crossing_the_last_transfer_done_frees_when_it_comes() -> None:
    """The decode side gives up as the prefill side's last TransferDone is on its
    way to it (the broker saw the transfer done, so it tells no one of the
    Abort): that TransferDone, arriving after the end, says the write landed;
    the pages come back then, not after the quarantine."""
    world = World(kv=True)
    b = world.id("b")  # one part
    world.start(b)
    world.expect(b, exact_hint=True)
    _until_writing(world, b)
    world.land(b, ok=True)
    world.deliver("to_broker", "once")  # the broker relays the TransferDone: done
    world.caller_leaves(b, "l")
    assert world.receiver.quarantine
    _deliver_all(world, "to_broker")
    _deliver_all(world, "to_l")
    assert not world.receiver.quarantine and not world.owner
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS


def test_a_give_up_crossing_the_last_write_is_answered_released() -> None:
    """The decode side gives up as the prefill side finishes writing: the Abort
    reaches the prefill side after its transfer ended, and it answers Released
    (nothing more will be written), which frees the pages at once."""
    world = World(kv=True)
    b = world.id("b")
    world.start(b)
    world.expect(b, exact_hint=True)
    _until_writing(world, b)
    world.caller_leaves(b, "l")  # its Abort is ahead of the TransferDone
    world.land(b, ok=True)
    assert world.e_outcome == {b: True}
    for _ in range(3):
        for queue in ("to_broker", "to_e", "to_l"):
            _deliver_all(world, queue)
    assert not world.receiver.quarantine and not world.owner
    assert world.receive_pool.num_free_blocks == RECEIVE_BLOCKS
