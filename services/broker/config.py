"""BrokerConfig: the broker's settings and their defaults (`epd broker`'s flags
are built from them)."""

from __future__ import annotations

from dataclasses import dataclass

from services.ports import BROKER_PORT
from services.wire.transport import TRANSFER_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = BROKER_PORT
    metrics_port: int | None = 0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    rendezvous_ttl_s: float = TRANSFER_TIMEOUT_S
    tick_s: float = 0.25

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
