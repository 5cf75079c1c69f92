"""The rendezvous as pure logic: both arrival orders, relays, aborts, expiry,
and a property-based run over random interleavings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.broker.rendezvous import FailoverError, Phase, Rendezvous
from services.wire.messages import (
    Abort,
    EmbeddingMeta,
    MediaGrid,
    PeerLost,
    Plane,
    Prealloc,
    Released,
    Resume,
    TransferDone,
)
from services.wire.transport import Transport

E, E2, L = "enc", "enc-2", "lang"


def meta(rid: str = "r", total: int = 100) -> EmbeddingMeta:
    return EmbeddingMeta(
        rid, L, total, (MediaGrid(1, 20, 20),), (Plane("embeddings", 8),), torch.float32
    )


def prealloc(rid: str = "r", tokens: int = 64) -> Prealloc:
    return Prealloc(rid, (0, 1), tokens)


def routed(*request_ids: str, **kwargs: object) -> Rendezvous:
    """A rendezvous with each request routed to (E, L), as the gateway's Route does."""
    r = Rendezvous(**kwargs)  # type: ignore[arg-type]
    for rid in request_ids or ("r",):
        r.route(rid, E, L)
    return r


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_meta_first_then_prealloc_pairs() -> None:
    r = routed()
    assert r.on_meta(E, meta()) == []
    assert r.describe("r").phase is Phase.WAITING
    out = r.on_prealloc(L, prealloc())
    targets = {t: type(m) for t, m in out}
    assert targets == {L: EmbeddingMeta, E: Prealloc}
    relayed_meta = next(m for t, m in out if t == L)
    assert isinstance(relayed_meta, EmbeddingMeta) and relayed_meta.encoder_instance_id == E
    relayed_prealloc = next(m for t, m in out if t == E)
    assert isinstance(relayed_prealloc, Prealloc) and relayed_prealloc.language_instance_id == L
    assert r.describe("r").phase is Phase.TRANSFERRING


def test_prealloc_first_then_meta_pairs() -> None:
    r = routed()
    assert r.on_prealloc(L, prealloc()) == []
    out = r.on_meta(E, meta())
    assert {t for t, _ in out} == {E, L}


def test_parts_resume_and_done() -> None:
    r = routed()
    r.on_meta(E, meta(total=100))
    r.on_prealloc(L, prealloc(tokens=64))
    assert r.on_transfer_done(E, TransferDone("r", 64, 100, Transport.SHM))[0][0] == L
    assert r.on_resume(L, Resume("r", (3,), 64, 64))[0][0] == E
    out = r.on_transfer_done(E, TransferDone("r", 100, 100, Transport.SHM))
    assert out[0][0] == L
    p = r.describe("r")
    assert p.phase is Phase.DONE and p.num_resumes == 1 and p.sent_tokens == 100


def test_abort_reaches_the_other_side_and_late_halves() -> None:
    r = routed()
    r.on_prealloc(L, prealloc())
    # The encoder was not given the blocks: no write can land in them, the language
    # side may reuse them at once; the encoder stops what it was doing.
    out = r.on_abort(L, Abort("r", "client left"))
    assert out == [(E, Abort("r", "client left")), (L, Released("r"))]
    out = r.on_meta(E, meta())
    assert out == [(E, Abort("r", "client left"))]


def test_unmatched_half_expires_and_is_aborted() -> None:
    clock = Clock()
    r = routed(ttl_s=5, history_s=10, clock=clock)
    r.on_meta(E, meta())
    clock.now = 6
    out = r.expire()
    # The metadata named its target, so both sides hear of it.
    assert sorted((t, type(m)) for t, m in out) == [(E, Abort), (L, Abort)]
    assert r.describe("r").phase is Phase.ABORTED
    clock.now = 20
    r.expire()
    assert r.describe("r") is None


def test_a_lost_encoder_leaves_its_requests_waiting_for_another() -> None:
    """Nothing had landed: the language side hears PeerLost once for both, keeps
    its preallocations, and the next encoder's meta pairs with them."""
    r = routed("a", "b")
    for rid in ("a", "b"):
        r.on_meta(E, meta(rid))
        r.on_prealloc(L, prealloc(rid))
    out = r.on_instance_lost(E)
    assert len(out) == 1
    target, message = out[0]
    assert target == L and isinstance(message, PeerLost) and set(message.request_ids) == {"a", "b"}
    assert sorted(r.active_requests(L)) == ["a", "b"]
    assert r.describe("a").phase is Phase.WAITING and r.describe("a").num_failovers == 1
    r.reroute("a", E, E2, L)
    out = r.on_meta(E2, meta("a"))
    assert {t: type(m) for t, m in out} == {L: EmbeddingMeta, E2: Prealloc}


@pytest.mark.parametrize("resume_first", [True, False])
def test_a_lost_encoder_mid_transfer_is_resumed_by_the_next_from_where_it_stopped(
    resume_first: bool,
) -> None:
    """64 of 100 tokens landed, then the encoder died: the language side hears
    PeerLost and offers blocks for the rest (its Resume, before or after the next
    encoder's meta); the next encoder is given them as a preallocation that skips
    the 64 tokens, and never the stale first one."""
    r = routed()
    r.on_meta(E, meta(total=100))
    r.on_prealloc(L, prealloc(tokens=64))
    r.on_transfer_done(E, TransferDone("r", 64, 100, Transport.SHM))
    resume = Resume("r", (5, 6), 64, 64)
    if not resume_first:
        r.on_resume(L, resume)
    assert r.on_instance_lost(E) == [(L, PeerLost(E, ("r",)))]
    assert r.describe("r").phase is Phase.WAITING
    r.reroute("r", "", E2, L)
    if resume_first:
        assert r.on_meta(E2, meta(total=100)) == []  # the offer still starts at 0
        out = r.on_resume(L, resume)
    else:
        out = r.on_meta(E2, meta(total=100))
    offered = {t: m for t, m in out}
    assert isinstance(offered[L], EmbeddingMeta) and offered[L].encoder_instance_id == E2
    assert offered[E2] == Prealloc("r", (5, 6), 64, L, skip_tokens=64)
    r.on_transfer_done(E2, TransferDone("r", 100, 100, Transport.SHM))
    assert r.describe("r").phase is Phase.DONE and r.describe("r").num_failovers == 1


def test_a_lost_language_instance_aborts_and_tells_the_encoder() -> None:
    r = routed()
    r.on_meta(E, meta())
    r.on_prealloc(L, prealloc())
    assert r.on_instance_lost(L) == [(E, PeerLost(L, ("r",)))]
    assert r.describe("r").phase is Phase.ABORTED


def test_reroute_moves_the_request_and_refuses_the_old_encoders_meta() -> None:
    r = Rendezvous()
    r.route("r", E, L)
    r.on_prealloc(L, prealloc())
    r.on_meta(E, meta())  # paired: L has E's meta
    out = r.reroute("r", E, E2, L)
    assert out == [(L, PeerLost(E, ("r",)))]
    assert r.on_meta(E, meta()) == [(E, Abort("r", f"the request is on encoder {E2}"))]
    out = r.on_meta(E2, meta())
    assert {t: type(m) for t, m in out} == {L: EmbeddingMeta, E2: Prealloc}
    relayed = next(m for t, m in out if t == L)
    assert isinstance(relayed, EmbeddingMeta) and relayed.encoder_instance_id == E2


def test_reroute_is_refused_for_a_kv_transfer() -> None:
    """A KV transfer's pages are on its prefill instance alone: no failover."""
    r = Rendezvous()
    r.route("r/kv", E, L)
    r.on_meta(E, meta("r/kv"))
    r.on_prealloc(L, prealloc("r/kv"))
    with pytest.raises(FailoverError, match="its KV is on its prefill instance") as info:
        r.reroute("r/kv", E, E2, L)
    assert sorted(t for t, _ in info.value.deliveries) == [E, L]
    assert r.describe("r/kv").phase is Phase.ABORTED


def test_released_reaches_the_language_side_after_an_abort() -> None:
    r = routed()
    r.on_meta(E, meta())
    r.on_prealloc(L, prealloc())
    r.on_abort(L, Abort("r", "client left"))
    assert r.on_released(E, Released("r")) == [(L, Released("r"))]
    assert r.on_released(E2, Released("r")) == []  # not this request's encoder


def test_mismatched_target_aborts_both() -> None:
    r = Rendezvous()
    r.route("r", E, "")
    r.on_prealloc("other-lang", prealloc())
    out = r.on_meta(E, meta())
    assert {t for t, _ in out} == {E, "other-lang"}
    assert all(isinstance(m, Abort) for _, m in out)


def test_only_the_routed_pair_is_heard() -> None:
    """Another encoder's metadata, another language instance's preallocation and
    a stranger's abort change nothing; the routed pair still pairs."""
    r = routed()
    assert r.on_meta(E2, meta()) == [(E2, Abort("r", f"the request is on encoder {E}"))]
    refused = r.on_prealloc("other-lang", prealloc())
    assert [(t, type(m)) for t, m in refused] == [("other-lang", Abort)]
    assert r.on_abort(E2, Abort("r", "x")) == []
    assert r.on_meta(E, meta()) == []
    assert {t for t, _ in r.on_prealloc(L, prealloc())} == {E, L}


def test_metadata_for_a_request_never_routed_is_refused() -> None:
    r = Rendezvous()
    assert r.on_meta(E, meta()) == [(E, Abort("r", "the request was not routed to this encoder"))]
    assert r.describe("r") is None
    assert r.on_abort(L, Abort("r", "x")) == [(L, Released("r"))]


EVENTS = st.sampled_from(
    [
        "meta",
        "meta_2",
        "prealloc",
        "done",
        "resume",
        "abort_e",
        "abort_l",
        "lost_e",
        "lost_l",
        "reroute",
        "tick",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), EVENTS), max_size=40))
def test_random_interleavings_keep_the_invariants(events: list[tuple[int, str]]) -> None:
    """Whatever the order: deliveries only go to the pair, a finished request
    never comes back to life, and every request ends finished or still pending."""
    clock = Clock()
    r = routed("0", "1", "2", "3", ttl_s=3, history_s=1000, clock=clock)
    sent = {rid: 0 for rid in map(str, range(4))}
    finished: set[str] = set()
    for index, event in events:
        rid = str(index)
        if event in ("meta", "meta_2"):
            out = r.on_meta(E if event == "meta" else E2, meta(rid, 100))
        elif event == "prealloc":
            out = r.on_prealloc(L, prealloc(rid, 64))
        elif event == "done":
            sent[rid] = min(100, sent[rid] + 64)
            out = r.on_transfer_done(E, TransferDone(rid, sent[rid], 100, Transport.GRPC))
        elif event == "resume":
            out = r.on_resume(L, Resume(rid, (1,), sent[rid], 64))
        elif event in ("abort_e", "abort_l"):
            out = r.on_abort(E if event == "abort_e" else L, Abort(rid, "x"))
        elif event in ("lost_e", "lost_l"):
            out = r.on_instance_lost(E if event == "lost_e" else L)
        elif event == "reroute":
            try:
                out = r.reroute(rid, E, E2, L)
            except FailoverError as exc:
                out = exc.deliveries
        else:
            clock.now += 2
            out = r.expire()
        assert all(target in (E, E2, L) for target, _ in out)
        for rid_, pairing in ((k, r.describe(k)) for k in sent):
            if pairing is None:
                continue
            if rid_ in finished:
                assert pairing.phase.is_finished, f"{rid_} came back to life"
            if pairing.phase.is_finished:
                finished.add(rid_)
            if pairing.phase is Phase.TRANSFERRING:
                assert pairing.meta is not None and pairing.prealloc is not None
                assert pairing.meta.encoder_instance_id == pairing.encoder_id
