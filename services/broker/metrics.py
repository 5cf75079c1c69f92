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
        # What the encoder planner reads, for an autoscaler too (deploy/: the
        # Kubernetes issue): the encoders' summed queue, their mean recent
        # encode time, and the routes with and without media.
        self.encoder_queue_depth = Gauge(
            "epd_broker_encoder_queue_depth",
            "Encodes in progress on all encoders, from their heartbeats",
            registry=registry,
        )
        self.encode_seconds = Gauge(
            "epd_broker_encode_seconds",
            "Mean recent encode time over the encoders that encoded lately",
            registry=registry,
        )
        self._reuse(registry)
        self.routed = Counter(
            "epd_broker_routed_requests",
            "Requests routed (not failovers), by whether they carry images or videos",
            ["media"],
            registry=registry,
        )

    def _reuse(self, registry: CollectorRegistry) -> None:
        """What the routes do to reuse work already done: a chat's prefix cache, a
        peer encoder's embeddings, a chat's KV pages moved."""
        self.prefix_routes = Counter(
            "epd_broker_prefix_routes",
            "Chat requests routed (not failovers), by whether their language instance "
            "had been sent part of their chat before (its prefix cache likely holds it)",
            ["held"],
            registry=registry,
        )
        self.peer_items = Counter(
            "epd_broker_peer_items",
            "Images and videos routed to an encoder with another encoder named to send them "
            "from its cache (or its encode in progress) instead",
            registry=registry,
        )
        self.prefix_moves = Counter(
            "epd_broker_prefix_moves",
            "Chat requests routed to a language instance with another named to send it the "
            "chat's KV pages (the one holding them was past the load bound)",
            registry=registry,
        )
