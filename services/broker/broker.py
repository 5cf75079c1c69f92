"""Broker: the registry and the rendezvous behind the gRPC servicer.

Everything runs on the event loop; deliveries go into the target session's
outbox, which its Attach stream drains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.broker.metrics import BrokerMetrics
from services.broker.registry import Registry, RouteChoice, Session
from services.broker.rendezvous import Delivery, FailoverError, Rendezvous
from services.runtime import tracing
from services.wire.messages import (
    Abort,
    CacheReport,
    EmbeddingMeta,
    Heartbeat,
    InstanceJoined,
    KvMeta,
    LanguageRole,
    PeerLost,
    PeerMessage,
    Prealloc,
    Register,
    Registered,
    Released,
    Resume,
    Role,
    TransferDone,
    kv_transfer_id,
)

logger = logging.getLogger(__name__)


class Broker:
    def __init__(
        self,
        metrics: BrokerMetrics,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        rendezvous: Rendezvous | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.metrics = metrics
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.registry = registry or Registry()
        self.routed_with_media = self.routed_text = 0  # routes since start (not failovers)
        self.rendezvous = rendezvous or Rendezvous()

    def _deliver(self, deliveries: list[Delivery]) -> None:
        for target, message in deliveries:
            session = self.registry.get(target)
            if session is not None:
                session.outbox.put_nowait(message)
        self.metrics.active_requests.set(self.rendezvous.num_active)

    def _encoder_gauges(self) -> None:
        loads = [s.load for s in self.registry.sessions(Role.ENCODER)]
        self.metrics.encoder_queue_depth.set(sum(load.queue_depth for load in loads))
        busy = [load.encode_seconds for load in loads if load.encode_seconds > 0]
        self.metrics.encode_seconds.set(sum(busy) / len(busy) if busy else 0.0)

    def _update_gauges(self) -> None:
        for role in Role:
            self.metrics.instances.labels(role.name.lower()).set(len(self.registry.sessions(role)))

    def _senders(self) -> list[Session]:
        """Instances that write into language instances' pools: the encoders, and
        the prefill instances (into decode instances' KV caches)."""
        return [
            s
            for s in self.registry.sessions()
            if s.registration.role is Role.ENCODER
            or s.registration.language_role is LanguageRole.PREFILL
        ]

    def join(self, registration: Register) -> Session:
        """Registers the instance; each sender hears of every language instance."""
        session = self.registry.add(registration)
        session.outbox.put_nowait(Registered(registration.instance_id, self.heartbeat_interval_s))
        now = session.last_heartbeat
        senders = self._senders()
        if session in senders:
            for language in self.registry.sessions(Role.LANGUAGE):
                if language is not session:
                    session.outbox.put_nowait(InstanceJoined(language.info(now)))
        if registration.role is Role.LANGUAGE:
            for sender in senders:
                if sender is not session:
                    sender.outbox.put_nowait(InstanceJoined(session.info(now)))
        self._update_gauges()
        logger.info(
            "%s %s joined from %s",
            registration.role.name.lower()
            if registration.role is Role.ENCODER
            else f"{registration.language_role.name.lower()} language instance",
            registration.instance_id,
            registration.grpc_address,
        )
        return session

    def leave(self, session: Session, reason: str) -> None:
        if not self.registry.remove(session):
            return
        session.outbox.put_nowait(None)
        lost = self.rendezvous.on_instance_lost(session.instance_id)
        self.metrics.aborts.labels("peer_lost").inc(
            sum(len(m.request_ids) for _, m in lost if isinstance(m, PeerLost))
        )
        # Every other instance hears of it: senders drop what they keep for a lost
        # receiver (shm mappings, NIXL peers); receivers release the blocks they
        # quarantined for a lost sender's writes.
        told = {target for target, message in lost if isinstance(message, PeerLost)}
        lost += [
            (peer.instance_id, PeerLost(session.instance_id, ()))
            for peer in self.registry.sessions()
            if peer.instance_id not in told
        ]
        self._deliver(lost)
        self._update_gauges()
        logger.info("%s left: %s", session.instance_id, reason)

    def handle(self, session: Session, message: PeerMessage) -> None:
        sender = session.instance_id
        self.metrics.messages.labels(type(message).__name__).inc()
        deliveries: list[Delivery]
        if isinstance(message, Heartbeat):
            self.registry.heartbeat(session, message)
            if session.registration.role is Role.ENCODER:
                self._encoder_gauges()
            return
        if isinstance(message, CacheReport):
            self.registry.cache_report(session, message)
            return
        if isinstance(message, EmbeddingMeta | KvMeta):
            target = message.target_id
            if self.registry.get(target) is None:
                reason = f"language instance {target!r} is not registered"
                deliveries = [(sender, Abort(message.request_id, reason))]
            else:
                deliveries = self.rendezvous.on_meta(sender, message)
        elif isinstance(message, Prealloc):
            deliveries = self.rendezvous.on_prealloc(sender, message)
        elif isinstance(message, TransferDone):
            deliveries = self.rendezvous.on_transfer_done(sender, message)
            if message.is_last:
                self._trace(message.request_id)
        elif isinstance(message, Resume):
            deliveries = self.rendezvous.on_resume(sender, message)
        elif isinstance(message, Abort):
            deliveries = self.rendezvous.on_abort(sender, message)
        elif isinstance(message, Released):
            deliveries = self.rendezvous.on_released(sender, message)
        else:
            raise ValueError(f"{type(message).__name__} is only valid as the first message")
        self._deliver(deliveries)

    def _trace(self, request_id: str) -> None:
        """A finished transfer's time at the broker, in its request's trace: from
        the route to both halves in, and from there to the last part."""
        pairing = self.rendezvous.describe(request_id)
        if pairing is None or pairing.trace is None or pairing.paired is None:
            return
        ids = {"request_id": request_id, "sender": pairing.encoder_id}
        tracing.record("broker.rendezvous", pairing.created, pairing.paired, pairing.trace, **ids)
        tracing.record(
            "broker.transfer",
            pairing.paired,
            time.monotonic(),
            pairing.trace,
            **ids,
            tokens=pairing.total_tokens,
            resumes=pairing.num_resumes,
        )

    def route(
        self,
        request_id: str,
        model: str,
        needs_encoder: bool,
        language_id: str = "",
        failed_encoder_id: str = "",
        failed_language_id: str = "",
        media_keys: Sequence[str] = (),
        prefix_keys: Sequence[str] = (),
    ) -> RouteChoice:
        """A language instance and, for images, an encoder; E/P/D: a prefill
        instance and a decode instance. With failed_encoder_id the request fails
        over: it stays on language_id and gets another encoder (NoRouteError if
        none; FailoverError if it cannot move). With failed_language_id (a retry
        under a new request id) other language instances than that one.
        `media_keys`: the content hashes of its images, for the encoder's choice;
        `prefix_keys`: its chat's prefixes, for the language instance's."""
        choice = self.registry.route(
            model,
            needs_encoder,
            language_id,
            failed_encoder_id,
            failed_language_id,
            media_keys,
            self.rendezvous.sending() if needs_encoder else None,  # a scan: only where it counts
            prefix_keys,
        )
        if not failed_encoder_id:
            if needs_encoder:
                self.routed_with_media += 1
            else:
                self.routed_text += 1
            self.metrics.routed.labels("yes" if needs_encoder else "no").inc()
            self.metrics.peer_items.inc(sum(h is not None for h in choice.holders))
            self.metrics.prefix_moves.inc(choice.prefix_holder is not None)
            if prefix_keys:
                held = "yes" if choice.prefix_depth else "no"
                self.metrics.prefix_routes.labels(held).inc()
        if request_id and choice.decode is not None:
            kv = kv_transfer_id(request_id)
            self.rendezvous.route(kv, choice.language.instance_id, choice.decode.instance_id)
            self._traced(kv)
        if not request_id or choice.encoder is None:
            return choice
        encoder_id, language = choice.encoder.instance_id, choice.language.instance_id
        if not failed_encoder_id:
            self.rendezvous.route(request_id, encoder_id, language)
            self._traced(request_id)
            return choice
        try:
            deliveries = self.rendezvous.reroute(
                request_id, failed_encoder_id, encoder_id, language
            )
        except FailoverError as exc:
            self._deliver(exc.deliveries)
            raise
        self.metrics.failovers.inc()
        self._deliver(deliveries)
        return choice

    def _traced(self, request_id: str) -> None:
        pairing = self.rendezvous.describe(request_id)
        if pairing is not None:
            pairing.trace = tracing.context_for(request_id)

    def tick(self, held_up_s: float = 0.0) -> None:
        """Periodic work: expire stuck rendezvous entries, evict silent instances
        (`held_up_s`: how long the broker itself did not run since the last tick,
        not counted as anyone's silence)."""
        if held_up_s > 0:
            self.registry.excuse(held_up_s)
        expired = self.rendezvous.expire()
        if expired:
            aborted = {m.request_id for _, m in expired if isinstance(m, Abort)}
            self.metrics.aborts.labels("expired").inc(len(aborted))
        self._deliver(expired)
        for session in self.registry.stale(self.heartbeat_timeout_s):
            self.leave(session, f"no heartbeat for {self.heartbeat_timeout_s:.0f}s")
