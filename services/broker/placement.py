"""Placement: which encoder encodes a request's images, as pure functions.

Each encoder keeps an embedding cache, and tells the broker what enters and
leaves it (CacheReport); a request names its items by content hash
(RouteRequest.media_hashes). The `cache` rule, for a request with items:

1. Bounded load: only encoders whose load is at most FACTOR x the least
   loaded one's + SLACK are candidates, so a hot image does not pin one
   encoder while others idle (the least loaded is always one).
2. Of those, the one holding the most of the request's items (ties: the less
   loaded, then the lower id).
3. If none holds any, rendezvous (highest-random-weight) hashing of the
   request's first item over the candidates: repeats of a new image meet on
   one encoder (which then shares or caches the encode), and an encoder that
   comes or goes moves only its own share of the items.

A request goes to one encoder: its items are not split across the encoders
that hold them (docs/performance.md, "Encoder cache routing", says why).
Peers (`Registry._holders`, on unless `--no-peer-cache`): for each item the
chosen encoder does not hold, the route names another encoder that holds it,
or that was routed it first and is encoding it; the chosen one fetches it
from there instead of encoding it. The load bound then spreads encode work,
and the cluster still encodes each item once. Text-only requests and requests
without hashes go to the least loaded. The `least-loaded` and `round-robin`
rules ignore caches for the choice: baselines to measure `cache` against.

Language instances, `prefix` rule: a chat names its prefixes (the hash of its
first message, of its first two, ...; RouteRequest.prefix_hashes), and the
broker remembers those it sent each instance. Within the same load bound, the
instance sent the longest of them takes the request (ties: the less loaded), so
a conversation's turns, and requests about one popular image, meet the prefix
cache that holds their KV; when it is too busy the request moves, and the next
turn follows it there.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


class EncoderRouting(enum.Enum):
    CACHE = "cache"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class LoadBound:
    """A candidate's load may be at most factor x the least loaded one's + slack."""

    factor: float = 2.0
    slack: int = 2

    def __post_init__(self) -> None:
        if self.factor < 1 or self.slack < 0:
            raise ValueError("a load bound needs factor >= 1 and slack >= 0")

    def limit(self, least: int) -> float:
        return self.factor * least + self.slack


@dataclass(frozen=True, slots=True)
class Candidate:
    """An encoder as placement sees it: its load and the items it holds."""

    instance_id: str
    load: int
    cached: AbstractSet[str] = frozenset()


def hrw_weight(key: str, instance_id: str) -> int:
    """The item's weight on the encoder: the highest weight wins the item."""
    digest = hashlib.blake2b(f"{key}\0{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.load, c.instance_id))


def within_bound(candidates: Sequence[Candidate], bound: LoadBound) -> list[Candidate]:
    limit = bound.limit(least_loaded(candidates).load)
    return [c for c in candidates if c.load <= limit]


def by_cache(candidates: Sequence[Candidate], keys: Sequence[str], bound: LoadBound) -> Candidate:
    """The `cache` rule (the module's docstring); `candidates` is not empty."""
    if not keys:
        return least_loaded(candidates)
    eligible = within_bound(candidates, bound)
    most = max(_hits(c, keys) for c in eligible)
    if most:
        return least_loaded([c for c in eligible if _hits(c, keys) == most])
    return max(eligible, key=lambda c: hrw_weight(keys[0], c.instance_id))


def prefix_depth(held: AbstractSet[str], keys: Sequence[str]) -> int:
    """How many of a request's prefixes (shortest first) one held: the deepest
    held one's place, counted from 1 (0: none)."""
    return next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in held), 0)


def _hits(candidate: Candidate, keys: Sequence[str]) -> int:
    return sum(k in candidate.cached for k in keys)
