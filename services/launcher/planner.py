"""The encoder planner: how many encoders `epd serve --encoders auto` runs, as a
pure decision over what the broker sees (no I/O, an explicit clock).

Each reading is the encoders' summed queue depth (encodes in progress), their
mean recent encode latency, and the share of routed requests that needed an
encoder. The planner adds an encoder when the load per encoder stays above
its bound (queue depth per encoder, or latency over the target) for
`up_after_s`; it retires one after `down_after_s` of a quiet the others could
absorb (half the bounds, with one encoder fewer); no change within
`cooldown_s` of the last, so it does not flap; never beyond
[min_encoders, max_encoders]. A retiring encoder drains: the broker routes it
nothing new, and it finishes what it has (services/launcher/serve.py).

It also names an imbalance: encoders saturated at their maximum while the
language side has room, or the language side saturated while encoders idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    min_encoders: int = 1
    max_encoders: int = 4
    queue_per_encoder: float = 2.0  # encodes in progress per encoder, at most
    latency_target_s: float = 1.0  # an encode's recent mean latency, at most
    up_after_s: float = 5.0
    down_after_s: float = 30.0
    cooldown_s: float = 15.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_encoders <= self.max_encoders:
            raise ValueError("need 1 <= min_encoders <= max_encoders")
        if self.queue_per_encoder <= 0 or self.latency_target_s <= 0:
            raise ValueError("queue_per_encoder and latency_target_s must be positive")


@dataclass(frozen=True, slots=True)
class Reading:
    encoders: int  # serving (not retiring)
    queue_depth: int  # encodes in progress, all encoders
    encode_seconds: float  # recent mean encode latency, over the encoders
    image_share: float  # of the requests routed since the last reading, those with media
    language_requests: int = 0  # in flight on the language instances
    language_capacity: int = 0  # what they admit at once (0: unknown)

    def describe(self) -> str:
        return (
            f"{self.encoders} encoders, queue {self.queue_depth}, encode "
            f"{self.encode_seconds * 1000:.0f} ms, images {self.image_share:.0%} of requests, "
            f"language {self.language_requests}/{self.language_capacity or '?'}"
        )


@dataclass(frozen=True, slots=True)
class Decision:
    change: int  # +1 add an encoder, -1 retire one, 0 hold
    reason: str
    imbalance: str = ""


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._pressed_since: float | None = None
        self._quiet_since: float | None = None
        self._last_change = -math.inf

    def _pressed(self, r: Reading) -> bool:
        c = self.config
        per_encoder = r.queue_depth / max(1, r.encoders)
        return per_encoder > c.queue_per_encoder or r.encode_seconds > c.latency_target_s

    def _quiet(self, r: Reading) -> bool:
        """One encoder fewer would still be under half the bounds."""
        c = self.config
        fewer = max(1, r.encoders - 1)
        return (
            r.queue_depth / fewer <= c.queue_per_encoder / 2
            and r.encode_seconds <= c.latency_target_s / 2
        )

    def decide(self, r: Reading, now: float) -> Decision:
        c = self.config
        pressed, quiet = self._pressed(r), self._quiet(r)
        self._pressed_since = (self._pressed_since or now) if pressed else None
        self._quiet_since = (self._quiet_since or now) if quiet else None
        imbalance = _imbalance(r, pressed, r.encoders >= c.max_encoders)
        if r.encoders < c.min_encoders:
            return self._change(+1, f"below the minimum of {c.min_encoders}", now, imbalance)
        if r.encoders > c.max_encoders:
            return self._change(-1, f"above the maximum of {c.max_encoders}", now, imbalance)
        if now - self._last_change < c.cooldown_s:
            return Decision(0, "cooling down after the last change", imbalance)
        if self._pressed_since is not None and now - self._pressed_since >= c.up_after_s:
            if r.encoders < c.max_encoders:
                return self._change(+1, f"pressed for {c.up_after_s:g}s", now, imbalance)
            return Decision(0, "pressed, at the maximum", imbalance)
        quiet_for = now - self._quiet_since if self._quiet_since is not None else 0.0
        if quiet_for >= c.down_after_s and r.encoders > c.min_encoders:
            return self._change(-1, f"quiet for {c.down_after_s:g}s", now, imbalance)
        return Decision(0, "steady", imbalance)

    def _change(self, change: int, reason: str, now: float, imbalance: str) -> Decision:
        self._last_change = now
        self._pressed_since = self._quiet_since = None
        return Decision(change, reason, imbalance)


def _imbalance(r: Reading, encoders_pressed: bool, at_max: bool) -> str:
    if not r.language_capacity:
        return ""
    language_share = r.language_requests / r.language_capacity
    if encoders_pressed and at_max and language_share < 0.5:
        return "encoders saturated at their maximum while the language side has room"
    if language_share >= 0.9 and r.queue_depth == 0:
        return "language side saturated while the encoders idle"
    return ""
