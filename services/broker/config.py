"""BrokerConfig: the broker's settings and their defaults (`epd broker`'s flags
are built from them)."""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.ports import BROKER_PORT
from services.wire.transport import TRANSFER_TIMEOUT_S

ENCODER_ROUTINGS = ("cache", "least-loaded", "round-robin")  # placement.EncoderRouting's
LANGUAGE_ROUTINGS = ("prefix", "least-loaded")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = BROKER_PORT
    metrics_port: int | None = 0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    rendezvous_ttl_s: float = TRANSFER_TIMEOUT_S
    tick_s: float = 0.25
    # Which encoder takes a request's images (placement.py): cache, least-loaded
    # or round-robin; cache's load bound: at most factor x the least load + slack.
    encoder_routing: str = "cache"
    load_factor: float = 2.0
    load_slack: int = 2
    # Whether an encoder routed an item another encoder holds (or is encoding)
    # fetches it from that one instead of encoding it (placement.py, "peers").
    peer_cache: bool = True
    # Which language instance takes a request: prefix (the one sent the longest
    # part of its chat before, within the same load bound) or least-loaded.
    language_routing: str = "prefix"
    # Whether a language instance routed a chat turn that another one holds more of
    # fetches the chat's KV pages from that one instead of computing them.
    prefix_moves: bool = True
    # A Route that finds no instance to take it waits this long for one to attach
    # (they attach again within a second or two of a broker restart) before 503.
    route_wait_s: float = 3.0

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if self.encoder_routing not in ENCODER_ROUTINGS:
            raise ValueError(f"encoder_routing is one of {', '.join(ENCODER_ROUTINGS)}")
        if self.language_routing not in LANGUAGE_ROUTINGS:
            raise ValueError(f"language_routing is one of {', '.join(LANGUAGE_ROUTINGS)}")
