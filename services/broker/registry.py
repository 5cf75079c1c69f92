"""Registry: the attached instances, their load, and the routing choice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.wire.messages import BrokerMessage, Heartbeat, InstanceInfo, Register, Role
from services.wire.transport import Transport, choose_transport


@dataclass(slots=True)
class Session:
    """One Attach stream. `outbox` feeds the stream; None closes it."""

    registration: Register
    last_heartbeat: float
    load: Heartbeat = field(default_factory=Heartbeat)
    routed_since_heartbeat: int = 0
    outbox: asyncio.Queue[BrokerMessage | None] = field(default_factory=asyncio.Queue)

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
    language: Session
    encoder: Session | None
    transport: Transport | None


class DuplicateInstanceError(ValueError):
    """An instance id that is live on another stream: it cannot be taken over."""


class NoRouteError(LookupError):
    """No instance (or no compatible pair) can take the request."""


def pair_transport(encoder: Register, language: Register) -> Transport | None:
    assert language.pool is not None
    return choose_transport(
        encoder.transports, encoder.host_id, language.pool.transports, language.host_id
    )


class Registry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sessions: dict[str, Session] = {}

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
    ) -> RouteChoice:
        """The least-loaded language instance (or the pinned one) and, for images,
        the least-loaded available encoder that shares a transport with it."""
        languages = [
            s
            for s in self.sessions(Role.LANGUAGE)
            if (not model or s.registration.model == model)
            and (not language_id or s.instance_id == language_id)
            and s.instance_id != exclude_language
        ]
        if not languages:
            if language_id:
                raise NoRouteError(f"language instance {language_id!r} is not registered")
            raise NoRouteError(f"no language instance serves model {model!r}")
        encoders = [
            s
            for s in self.sessions(Role.ENCODER)
            if (not model or s.registration.model == model)
            and not s.load.unavailable
            and s.instance_id != exclude_encoder
        ]
        for language in sorted(languages, key=lambda s: s.score):
            if not needs_encoder:
                language.routed_since_heartbeat += 1
                return RouteChoice(language, None, None)
            paired = [
                (e, t)
                for e in sorted(encoders, key=lambda s: s.score)
                if (t := pair_transport(e.registration, language.registration)) is not None
            ]
            if paired:
                encoder, transport = paired[0]
                language.routed_since_heartbeat += 1
                encoder.routed_since_heartbeat += 1
                return RouteChoice(language, encoder, transport)
        if not encoders:
            raise NoRouteError(f"no available encoder instance serves model {model!r}")
        raise NoRouteError("no encoder shares a transport with any language instance")
