"""Rendezvous: pairs an encoder's EmbeddingMeta with a language instance's
Prealloc by request id, whichever arrives first, then relays the transfer's
messages between the pair. Pure logic: every handler returns the deliveries
(instance id, message) for the caller to send.

    ROUTED --meta or prealloc--> WAITING --other half--> TRANSFERRING --last done--> DONE
       \\__________________ abort / expiry / peer lost ______________________--> ABORTED

Unmatched halves expire after `ttl_s`; an aborted request keeps a tombstone
so that a late half is answered with Abort instead of waiting forever.

E/P/D: a request's KV transfer (its id is the request's + "/kv") pairs the
prefill instance's KvMeta with the decode instance's Prealloc the same way,
the prefill instance in the encoder's place and the decode instance in the
language instance's; it never fails over (no other instance holds its KV).

Failover: until a request's embeddings have all landed, its encoder can be
replaced, because it died (on_instance_lost) or the gateway asked for another
(reroute). The encoder's meta is dropped, and the language instance hears
PeerLost for the request: it keeps what landed and the blocks it offered for
the rest, and waits for the next encoder's meta. The pairing keeps the
language side's latest offer (its Prealloc, then each Resume as a Prealloc
that skips the tokens landed before it): the next encoder is paired with it
once it starts where the landed tokens end (`sent_tokens`; a Resume still on
its way is waited for), and sends from there. A KV transfer never fails over.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from services.proto import broker_pb2
from services.wire.messages import (
    Abort,
    BrokerMessage,
    PeerLost,
    Prealloc,
    Released,
    Resume,
    TransferDone,
    TransferMeta,
    is_kv_transfer,
)
from services.wire.transport import TRANSFER_TIMEOUT_S

Delivery = tuple[str, BrokerMessage]


class FailoverError(RuntimeError):
    """The request cannot move to another encoder (a KV transfer, or it ended);
    `deliveries` abort it where it was still alive."""

    def __init__(self, reason: str, deliveries: list[Delivery] | None = None) -> None:
        super().__init__(reason)
        self.deliveries = deliveries or []


class Phase(enum.IntEnum):
    ROUTED = broker_pb2.RequestDescription.PHASE_ROUTED
    WAITING = broker_pb2.RequestDescription.PHASE_WAITING
    TRANSFERRING = broker_pb2.RequestDescription.PHASE_TRANSFERRING
    DONE = broker_pb2.RequestDescription.PHASE_DONE
    ABORTED = broker_pb2.RequestDescription.PHASE_ABORTED

    @property
    def is_finished(self) -> bool:
        return self >= Phase.DONE


@dataclass(slots=True)
class Pairing:
    request_id: str
    created: float
    updated: float
    phase: Phase = Phase.ROUTED
    encoder_id: str = ""
    language_id: str = ""
    meta: TransferMeta | None = None
    prealloc: Prealloc | None = None
    sent_tokens: int = 0
    total_tokens: int = 0
    num_resumes: int = 0
    num_failovers: int = 0
    abort_reason: str = ""
    paired: float | None = None  # when both halves were in
    trace: Any = None  # the Route call's trace context (services.runtime.tracing), carried

    def involves(self, instance_id: str) -> bool:
        return instance_id in (self.encoder_id, self.language_id)

    @property
    def can_fail_over(self) -> bool:
        """Another encoder can write what has not landed (a KV transfer: never,
        its KV is on its prefill instance alone)."""
        return not self.phase.is_finished and not is_kv_transfer(self.request_id)

    @property
    def offer_is_current(self) -> bool:
        """The language side's offer starts where the landed tokens end (or
        nothing has landed): an encoder may be given it."""
        assert self.prealloc is not None
        return self.sent_tokens == 0 or self.prealloc.skip_tokens == self.sent_tokens


class Rendezvous:
    def __init__(
        self,
        ttl_s: float = TRANSFER_TIMEOUT_S,
        history_s: float = 60.0,
        max_history: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.history_s = history_s
        self.max_history = max_history
        self._clock = clock
        self._pairings: dict[str, Pairing] = {}

    def __len__(self) -> int:
        return len(self._pairings)

    @property
    def num_active(self) -> int:
        return sum(1 for p in self._pairings.values() if not p.phase.is_finished)

    def sending(self) -> Counter[str]:
        """Unfinished requests per sender (encoder, or prefill instance): its load
        as the broker knows it at once, without waiting for a heartbeat."""
        return Counter(p.encoder_id for p in self._pairings.values() if not p.phase.is_finished)

    def describe(self, request_id: str) -> Pairing | None:
        return self._pairings.get(request_id)

    def active_requests(self, instance_id: str) -> list[str]:
        return [
            p.request_id
            for p in self._pairings.values()
            if not p.phase.is_finished and p.involves(instance_id)
        ]

    def _get(self, request_id: str) -> Pairing:
        pairing = self._pairings.get(request_id)
        if pairing is None:
            now = self._clock()
            pairing = self._pairings[request_id] = Pairing(request_id, now, now)
        pairing.updated = self._clock()
        return pairing

    def route(self, request_id: str, encoder_id: str, language_id: str) -> None:
        pairing = self._get(request_id)
        pairing.encoder_id = pairing.encoder_id or encoder_id
        pairing.language_id = pairing.language_id or language_id

    def _abort(self, pairing: Pairing, reason: str, notify: tuple[str, ...]) -> list[Delivery]:
        pairing.phase = Phase.ABORTED
        pairing.abort_reason = reason
        abort = Abort(pairing.request_id, reason)
        return [(target, abort) for target in dict.fromkeys(notify) if target]

    def _detach_encoder(self, pairing: Pairing) -> bool:
        """Drops the encoder and its meta; the preallocation stays for the next one.
        True if the language instance had been given that meta (it must forget it)."""
        told = pairing.meta is not None and pairing.prealloc is not None
        pairing.encoder_id = ""
        pairing.meta = None
        pairing.num_failovers += 1
        pairing.phase = Phase.WAITING if pairing.prealloc is not None else Phase.ROUTED
        return told and bool(pairing.language_id)

    def reroute(
        self, request_id: str, failed_encoder_id: str, encoder_id: str, language_id: str
    ) -> list[Delivery]:
        """The gateway moves a request to another encoder; FailoverError if it cannot."""
        pairing = self._pairings.get(request_id)
        if pairing is None:  # forgotten, or never routed through this broker
            self.route(request_id, encoder_id, language_id)
            return []
        if pairing.encoder_id not in ("", failed_encoder_id):
            raise FailoverError(
                f"request {request_id!r} is on encoder {pairing.encoder_id}, "
                f"not {failed_encoder_id}"
            )
        if not pairing.can_fail_over:
            reason = f"request {request_id!r} cannot move to another encoder: " + (
                "it has ended" if pairing.phase.is_finished else "its KV is on its prefill instance"
            )
            if pairing.phase.is_finished:
                raise FailoverError(reason)
            raise FailoverError(
                reason, self._abort(pairing, reason, (pairing.encoder_id, pairing.language_id))
            )
        deliveries: list[Delivery] = []
        if pairing.encoder_id and self._detach_encoder(pairing):
            lost = PeerLost(failed_encoder_id, (request_id,))
            deliveries.append((pairing.language_id, lost))
        pairing.encoder_id = encoder_id
        pairing.updated = self._clock()
        return deliveries

    def _pair(self, pairing: Pairing) -> list[Delivery]:
        """Both halves are in: each side gets the other's."""
        assert pairing.meta is not None and pairing.prealloc is not None
        pairing.phase = Phase.TRANSFERRING
        pairing.paired = self._clock()
        pairing.total_tokens = pairing.meta.total_tokens
        return [
            (pairing.language_id, pairing.meta),
            (pairing.encoder_id, pairing.prealloc),
        ]

    def on_meta(self, encoder_id: str, meta: TransferMeta) -> list[Delivery]:
        """Only from the encoder the request was routed to: any other is told no."""
        pairing = self._pairings.get(meta.request_id)
        if pairing is None or not pairing.encoder_id:
            reason = "the request was not routed to this encoder"
            return [(encoder_id, Abort(meta.request_id, reason))]
        if pairing.encoder_id != encoder_id:  # a stranger, or the encoder it moved from
            reason = f"the request is on encoder {pairing.encoder_id}"
            return [(encoder_id, Abort(meta.request_id, reason))]
        pairing.updated = self._clock()
        if pairing.phase is Phase.ABORTED:
            return [(encoder_id, Abort(meta.request_id, pairing.abort_reason))]
        if pairing.meta is not None or pairing.phase.is_finished:
            return [(encoder_id, Abort(meta.request_id, "duplicate embedding metadata"))]
        if pairing.language_id and pairing.language_id != meta.target_id:
            return self._abort(
                pairing,
                f"metadata targets {meta.target_id}, but the request is on {pairing.language_id}",
                (encoder_id, pairing.language_id),
            )
        pairing.language_id = meta.target_id
        pairing.meta = meta.relayed_from(encoder_id)
        if pairing.prealloc is None or not pairing.offer_is_current:
            pairing.phase = Phase.WAITING
            return []
        return self._pair(pairing)

    def on_prealloc(self, language_id: str, prealloc: Prealloc) -> list[Delivery]:
        pairing = self._get(prealloc.request_id)
        if pairing.language_id and pairing.language_id != language_id:
            reason = "the request was not routed to this language instance"
            return [(language_id, Abort(prealloc.request_id, reason))]
        if pairing.phase is Phase.ABORTED:
            return [(language_id, Abort(prealloc.request_id, pairing.abort_reason))]
        if pairing.prealloc is not None or pairing.phase.is_finished:
            return [(language_id, Abort(prealloc.request_id, "duplicate preallocation"))]
        if pairing.meta is not None and pairing.language_id != language_id:
            return self._abort(
                pairing,
                f"preallocation from {language_id}, but the metadata targets {pairing.language_id}",
                (language_id, pairing.encoder_id),
            )
        pairing.language_id = language_id
        pairing.prealloc = replace(prealloc, language_instance_id=language_id)
        if pairing.meta is None:
            pairing.phase = Phase.WAITING
            return []
        return self._pair(pairing)

    def _transferring(self, request_id: str, sender: str) -> Pairing | None:
        pairing = self._pairings.get(request_id)
        if (
            pairing is None
            or pairing.phase is not Phase.TRANSFERRING
            or not pairing.involves(sender)
        ):
            return None
        pairing.updated = self._clock()
        return pairing

    def on_transfer_done(self, encoder_id: str, done: TransferDone) -> list[Delivery]:
        pairing = self._transferring(done.request_id, encoder_id)
        if pairing is None:
            return [
                (encoder_id, Abort(done.request_id, "no transfer in progress for this request"))
            ]
        pairing.sent_tokens = done.sent_tokens
        pairing.total_tokens = done.total_tokens
        if done.is_last:
            pairing.phase = Phase.DONE
        return [(pairing.language_id, done)]

    def on_resume(self, language_id: str, resume: Resume) -> list[Delivery]:
        """Relayed to the encoder; kept as the language side's offer, for the next
        encoder should this one be lost (paired now if its meta waits for it)."""
        pairing = self._pairings.get(resume.request_id)
        if (
            pairing is None
            or pairing.phase.is_finished
            or pairing.phase is Phase.ROUTED
            or pairing.language_id != language_id
            or pairing.prealloc is None
        ):
            return [
                (language_id, Abort(resume.request_id, "no transfer in progress for this request"))
            ]
        pairing.updated = self._clock()
        pairing.num_resumes += 1
        pairing.prealloc = Prealloc(
            resume.request_id,
            resume.block_ids,
            resume.allocated_tokens,
            language_id,
            skip_tokens=resume.sent_tokens,
        )
        if pairing.phase is Phase.TRANSFERRING:
            return [(pairing.encoder_id, resume)]
        return self._pair(pairing) if pairing.meta is not None and pairing.offer_is_current else []

    def on_released(self, encoder_id: str, released: Released) -> list[Delivery]:
        """Relayed even after an abort: that is when the language side waits for it."""
        pairing = self._pairings.get(released.request_id)
        if pairing is None or pairing.encoder_id != encoder_id or not pairing.language_id:
            return []
        return [(pairing.language_id, released)]

    def on_abort(self, sender: str, abort: Abort) -> list[Delivery]:
        """Only from the request's own pair; a request the broker never saw has no
        encoder that could write into the sender's blocks."""
        pairing = self._pairings.get(abort.request_id)
        if pairing is None:
            return [(sender, Released(abort.request_id))]
        if pairing.phase.is_finished or not pairing.involves(sender):
            return []
        pairing.updated = self._clock()
        # No encoder was given the preallocation: nothing can write into it, and the
        # language side may reuse it at once instead of waiting for its quarantine.
        unwritten = pairing.phase is not Phase.TRANSFERRING
        others = tuple(i for i in (pairing.encoder_id, pairing.language_id) if i != sender)
        deliveries = self._abort(pairing, abort.reason or f"aborted by {sender}", others)
        if unwritten and sender == pairing.language_id:
            deliveries.append((sender, Released(abort.request_id)))
        return deliveries

    def on_instance_lost(self, instance_id: str) -> list[Delivery]:
        """The instance's unfinished requests: those of a lost encoder that can fail
        over wait for another one (their language instance hears PeerLost); the
        others are aborted (the encoder of a lost language instance hears PeerLost,
        the language instance of a lost encoder hears Abort)."""
        deliveries: list[Delivery] = []
        lost: dict[str, list[str]] = {}  # peer -> its requests that hear PeerLost
        reason = f"instance {instance_id} was lost"
        for pairing in self._pairings.values():
            if pairing.phase.is_finished or not pairing.involves(instance_id):
                continue
            if pairing.encoder_id != instance_id:  # a lost language instance
                self._abort(pairing, reason, ())
                if pairing.encoder_id:
                    lost.setdefault(pairing.encoder_id, []).append(pairing.request_id)
            elif not pairing.can_fail_over:
                deliveries += self._abort(pairing, reason, (pairing.language_id,))
            elif self._detach_encoder(pairing):
                lost.setdefault(pairing.language_id, []).append(pairing.request_id)
        return deliveries + [(p, PeerLost(instance_id, tuple(ids))) for p, ids in lost.items()]

    def expire(self) -> list[Delivery]:
        """Aborts pairings idle for ttl_s; forgets finished ones after history_s."""
        now = self._clock()
        deliveries: list[Delivery] = []
        finished: list[tuple[float, str]] = []
        for request_id, pairing in list(self._pairings.items()):
            if pairing.phase.is_finished:
                if now - pairing.updated > self.history_s:
                    del self._pairings[request_id]
                else:
                    finished.append((pairing.updated, request_id))
            elif now - pairing.updated > self.ttl_s:
                pairing.updated = now
                finished.append((now, request_id))
                deliveries += self._abort(
                    pairing,
                    f"no progress for {self.ttl_s:.0f}s (phase {pairing.phase.name.lower()})",
                    (pairing.encoder_id, pairing.language_id),
                )
        for _, request_id in sorted(finished)[: max(0, len(finished) - self.max_history)]:
            del self._pairings[request_id]
        return deliveries
