"""Registry: the attached instances, their load, and the routing choice."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.broker.placement import (
    Candidate,
    EncoderRouting,
    LoadBound,
    by_cache,
    least_loaded,
    prefix_depth,
)
from services.wire.messages import (
    BrokerMessage,
    CacheReport,
    Heartbeat,
    InstanceInfo,
    LanguageRole,
    Register,
    Role,
)
from services.wire.transport import Transport, choose_transport

# The chat prefixes the broker remembers per language instance: a few thousand
# conversations' worth, a few hundred KB.
PREFIX_MEMORY = 4096
# How long an encoder routed an item no encoder holds counts as its holder (it
# is encoding it) before its cache report says it holds it: longer than an encode.
CLAIM_S = 30.0


@dataclass(slots=True)
class Session:
    """One Attach stream. `outbox` feeds the stream; None closes it."""

    registration: Register
    last_heartbeat: float
    load: Heartbeat = field(default_factory=Heartbeat)
    routed_since_heartbeat: int = 0
    outbox: asyncio.Queue[BrokerMessage | None] = field(default_factory=asyncio.Queue)
    cached: set[str] = field(default_factory=set)  # an encoder's: what its cache holds
    # a language instance's: the chat prefixes routed to it, least recently first
    prefixes: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def instance_id(self) -> str:
        return self.registration.instance_id

    @property
    def score(self) -> int:
        """Lower is less loaded: what it reported plus what was routed to it since."""
        return self.load.num_requests + self.routed_since_heartbeat

    def info(self, now: float) -> InstanceInfo:
        return InstanceInfo(self.registration, self.load, max(0.0, now - self.last_heartbeat))


@dataclass(frozen=True, slots=True)
class RouteChoice:
    language: Session  # where the request starts (E/P/D: the prefill instance)
    encoder: Session | None
    transport: Transport | None
    decode: Session | None = None  # E/P/D: takes the request from the prefill instance
    prefix_depth: int = 0  # how many of the request's prefixes were routed to `language`
    # per media key: another encoder to fetch the item from (None: `encoder` has it or encodes it)
    holders: tuple[Session | None, ...] = ()
    # another language instance sent more of the chat's prefixes: `language` fetches its KV pages
    prefix_holder: Session | None = None
    prefix_holder_depth: int = 0


class DuplicateInstanceError(ValueError):
    """An instance id that is live on another stream: it cannot be taken over."""


class NoRouteError(LookupError):
    """No instance (or no compatible pair) can take the request."""


def pair_transport(sender: Register, receiver: Register) -> Transport | None:
    """How the sender (an encoder; a prefill instance) writes into the receiver's pool."""
    assert receiver.pool is not None
    return choose_transport(
        sender.transports, sender.host_id, receiver.pool.transports, receiver.host_id
    )


def _remember(language: Session, keys: Sequence[str]) -> None:
    """The prefixes routed to a language instance, the most recent PREFIX_MEMORY."""
    for key in keys:
        language.prefixes[key] = None
        language.prefixes.move_to_end(key)
    while len(language.prefixes) > PREFIX_MEMORY:
        language.prefixes.popitem(last=False)


class Registry:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        encoder_routing: EncoderRouting = EncoderRouting.CACHE,
        load_bound: LoadBound | None = None,
        prefix_routing: bool = True,
        peer_cache: bool = True,
        prefix_moves: bool = True,
    ) -> None:
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self.encoder_routing = encoder_routing
        self.prefix_routing = prefix_routing
        self.load_bound = load_bound or LoadBound()
        self.peer_cache = peer_cache
        self.prefix_moves = prefix_moves
        self._turn = 0  # round-robin's
        # items routed to an encoder that held none of them: key -> (encoder id, when)
        self._claims: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def add(self, registration: Register) -> Session:
        """A new session; DuplicateInstanceError while another stream holds the id
        (an instance that reconnects is let in once its old stream is gone)."""
        if registration.instance_id in self._sessions:
            raise DuplicateInstanceError(
                f"instance {registration.instance_id!r} is attached on another stream"
            )
        session = self._sessions[registration.instance_id] = Session(registration, self._clock())
        return session

    def remove(self, session: Session) -> bool:
        """False if the session was already gone or replaced."""
        if self._sessions.get(session.instance_id) is not session:
            return False
        del self._sessions[session.instance_id]
        return True

    def get(self, instance_id: str) -> Session | None:
        return self._sessions.get(instance_id)

    def sessions(self, role: Role | None = None) -> list[Session]:
        return [s for s in self._sessions.values() if role is None or s.registration.role == role]

    def heartbeat(self, session: Session, load: Heartbeat) -> None:
        session.load = load
        session.last_heartbeat = self._clock()
        session.routed_since_heartbeat = 0

    def cache_report(self, session: Session, report: CacheReport) -> None:
        if report.full:
            session.cached = set(report.added)
            return
        session.cached.difference_update(report.evicted)
        session.cached.update(report.added)
        for key in report.added:
            if self._claims.get(key, ("",))[0] == session.instance_id:
                del self._claims[key]

    def excuse(self, seconds: float) -> None:
        """Every session heard from `seconds` later than it was: the broker did not
        run for that long, and their heartbeats waited in its sockets."""
        for session in self._sessions.values():
            session.last_heartbeat += seconds

    def stale(self, timeout_s: float) -> list[Session]:
        now = self._clock()
        return [s for s in self._sessions.values() if now - s.last_heartbeat > timeout_s]

    def route(
        self,
        model: str,
        needs_encoder: bool,
        language_id: str = "",
        exclude_encoder: str = "",
        exclude_language: str = "",
        media_keys: Sequence[str] = (),
        encoder_loads: Mapping[str, int] | None = None,
        prefix_keys: Sequence[str] = (),
    ) -> RouteChoice:
        """A language instance that takes requests (or the pinned one), in the order
        `_by_prefix` gives, and for images an available encoder sharing a transport
        with it, as `encoder_routing` picks (`media_keys`: the items' hashes;
        `encoder_loads`: each encoder's unfinished requests, for its heartbeat's). A
        prefill instance comes with the least-loaded decode instance it shares a
        transport with (none when pinned: an encoder failover keeps the request where
        it is); and the holders to fetch from. `exclude_language`: neither."""
        languages = [
            s
            for s in self._serving(Role.LANGUAGE, model, exclude_language)
            if s.registration.language_role.takes_requests
            and (not language_id or s.instance_id == language_id)
        ]
        if not languages:
            if language_id:
                raise NoRouteError(f"language instance {language_id!r} is not registered")
            raise NoRouteError(f"no language instance serves model {model!r}")
        encoders = self._serving(Role.ENCODER, model, exclude_encoder)
        no_decode = False
        for language, depth in self._by_prefix(languages, prefix_keys):
            decode = None
            if language.registration.language_role is LanguageRole.PREFILL and not language_id:
                decode = self._decode_for(language, model, exclude_language)
                if decode is None:
                    no_decode = True
                    continue
            paired = {
                e.instance_id: (e, t)
                for e in encoders
                if (t := pair_transport(e.registration, language.registration)) is not None
            }
            if needs_encoder and not paired:
                continue
            encoder, transport = (
                paired[self._pick_encoder(list(paired.values()), media_keys, encoder_loads)]
                if needs_encoder
                else (None, None)
            )
            for chosen in (c for c in (language, encoder, decode) if c is not None):
                chosen.routed_since_heartbeat += 1
            moved = self._prefix_holder(language, depth, languages, prefix_keys)
            _remember(language, prefix_keys)
            holders = self._holders(encoder, encoders, media_keys) if encoder else ()
            return RouteChoice(language, encoder, transport, decode, depth, holders, *moved)
        if no_decode:
            raise NoRouteError(f"no decode instance of model {model!r} shares a transport")
        if not encoders:
            raise NoRouteError(f"no available encoder instance serves model {model!r}")
        raise NoRouteError("no encoder shares a transport with any language instance")

    def _by_prefix(
        self, languages: list[Session], keys: Sequence[str]
    ) -> list[tuple[Session, int]]:
        """The language instances in the order to try them, each with how many of
        the request's prefixes it was sent: the least loaded first, or with
        prefix routing those within the load bound by that depth, deepest first
        (by load alone the depth is still told: what routing by it would gain)."""
        ordered = sorted(languages, key=lambda s: s.score)
        depths = [(s, prefix_depth(s.prefixes.keys(), keys) if keys else 0) for s in ordered]
        if not self.prefix_routing or not keys:
            return depths
        limit = self.load_bound.limit(ordered[0].score)
        return sorted(depths, key=lambda sd: -sd[1] if sd[0].score <= limit else 1)

    def _prefix_holder(
        self, chosen: Session, depth: int, languages: list[Session], keys: Sequence[str]
    ) -> tuple[Session | None, int]:
        """The language instance `chosen` fetches the chat's KV pages from: the one
        sent the most of its prefixes, more than `chosen` was (the least loaded of
        those; it is past the load bound, or it would have been chosen), and how
        many; (None, 0) for none."""
        if not self.prefix_moves or not keys:
            return None, 0
        best: tuple[Session | None, int] = (None, depth)
        for other in sorted(languages, key=lambda s: s.score):
            if other is not chosen and (d := prefix_depth(other.prefixes.keys(), keys)) > best[1]:
                best = (other, d)
        return best if best[0] is not None else (None, 0)

    def _pick_encoder(
        self,
        paired: list[tuple[Session, Transport]],
        keys: Sequence[str],
        loads: Mapping[str, int] | None,
    ) -> str:
        candidates = [
            Candidate(
                e.instance_id, e.score if loads is None else loads.get(e.instance_id, 0), e.cached
            )
            for e, _ in paired
        ]
        if self.encoder_routing is EncoderRouting.ROUND_ROBIN:
            self._turn += 1
            return sorted(c.instance_id for c in candidates)[self._turn % len(candidates)]
        if self.encoder_routing is EncoderRouting.LEAST_LOADED:
            return least_loaded(candidates).instance_id
        return by_cache(candidates, keys, self.load_bound).instance_id

    def _holders(
        self, chosen: Session, encoders: list[Session], keys: Sequence[str]
    ) -> tuple[Session | None, ...]:
        """Per item, the encoder `chosen` fetches it from instead of encoding it:
        the least loaded other one whose cache holds it, else the one encoding
        it (routed it first, not yet reported: a claim); None where `chosen`
        holds it or none does (`chosen` then encodes it, and claims it)."""
        if not self.peer_cache:
            return ()
        now = self._clock()
        while self._claims and next(iter(self._claims.values()))[1] < now - CLAIM_S:
            self._claims.popitem(last=False)
        others = sorted((e for e in encoders if e is not chosen), key=lambda s: s.score)
        claimants = {e.instance_id: e for e in others}
        holders: list[Session | None] = []
        for key in keys:
            holder = None
            if key not in chosen.cached:
                holder = next((e for e in others if key in e.cached), None)
                claim = self._claims.get(key)
                if holder is None and claim is not None:
                    holder = claimants.get(claim[0])
                if holder is None and (claim is None or claim[0] != chosen.instance_id):
                    self._claims[key] = (chosen.instance_id, now)
                    self._claims.move_to_end(key)
            holders.append(holder)
        return tuple(holders)

    def _serving(self, role: Role, model: str, exclude: str) -> list[Session]:
        """Of the role and model, available (not, say, draining), but `exclude`."""
        return [
            s
            for s in self.sessions(role)
            if (not model or s.registration.model == model)
            and s.instance_id != exclude
            and not s.load.unavailable
        ]

    def _decode_for(self, prefill: Session, model: str, exclude: str) -> Session | None:
        """The least-loaded decode instance the prefill instance can write KV pages into."""
        decodes = [
            s
            for s in self._serving(Role.LANGUAGE, model, exclude)
            if s.registration.language_role is LanguageRole.DECODE
            and pair_transport(prefill.registration, s.registration) is not None
        ]
        return min(decodes, key=lambda s: s.score, default=None)
