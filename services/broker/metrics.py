"""The broker's Prometheus metrics (one registry per broker)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.instances = Gauge(
            "epd_broker_instances", "Attached instances", ["role"], registry=registry
        )
        self.messages = Counter(
            "epd_broker_messages",
            "Messages received on Attach streams",
            ["kind"],
            registry=registry,
        )
        self.routes = Counter("epd_broker_routes", "Route calls", ["outcome"], registry=registry)
        self.aborts = Counter(
            "epd_broker_aborts",
            "Requests aborted by the broker (expiry, lost peers)",
            ["cause"],
            registry=registry,
        )
        self.failovers = Counter(
            "epd_broker_failovers",
            "Requests moved to another encoder after theirs failed",
            registry=registry,
        )
        self.active_requests = Gauge(
            "epd_broker_active_requests",
            "Requests in the rendezvous, not finished",
            registry=registry,
        )
