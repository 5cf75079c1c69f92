"""The encoder's Prometheus metrics (one registry per encoder)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.wire.transport import Transport


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "epd_encoder_requests", "Encode requests by outcome", ["status"], registry=registry
        )
        self.images = Counter(
            "epd_encoder_images", "Images encoded or served from cache", registry=registry
        )
        self.tokens = Counter(
            "epd_encoder_image_tokens", "Embedding tokens produced", registry=registry
        )
        self.cache_hits = Counter(
            "epd_encoder_cache_hits", "Images served from the embedding cache", registry=registry
        )
        self.cache_misses = Counter(
            "epd_encoder_cache_misses", "Images not in the embedding cache", registry=registry
        )
        self.held_items = Counter(
            "epd_encoder_held_items",
            "Images neither encoded nor sent: the language instance's prefix cache held their KV",
            registry=registry,
        )
        self._sources(registry)
        self.cache_bytes = Gauge(
            "epd_encoder_cache_bytes", "Bytes in the embedding cache", registry=registry
        )
        self.send_buffer_bytes = Gauge(
            "epd_encoder_send_buffer_bytes", "Bytes of the send buffer in use", registry=registry
        )
        self.transfers = Counter(
            "epd_encoder_transfers", "Finished transfers by outcome", ["outcome"], registry=registry
        )
        self.in_flight = Gauge(
            "epd_encoder_in_flight", "Encode requests in progress", registry=registry
        )
        self.preprocess_seconds = Histogram(
            "epd_encoder_preprocess_seconds",
            "Decode + image processor time per request",
            registry=registry,
        )
        self.triton_seconds = Histogram(
            "epd_encoder_triton_seconds", "Triton round trip per request", registry=registry
        )
        self.write_bytes = Counter(
            "epd_encoder_transfer_bytes",
            "Embedding bytes written into language instances, by transport",
            ["transport"],
            registry=registry,
        )
        self.write_seconds = Histogram(
            "epd_encoder_transfer_seconds",
            "Seconds per write of a transfer part, by transport",
            ["transport"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )

    def _sources(self, registry: CollectorRegistry) -> None:
        """Where items not in the cache came from: Triton, another request's
        encode, or (the cluster as one cache, peers.py) another encoder, by
        outcome: fetched, missing there, failed; and the items sent to others."""
        self.encoded_items = Counter(
            "epd_encoder_encoded_items",
            "Images and videos this encoder sent to Triton",
            registry=registry,
        )
        self.shared_encodes = Counter(
            "epd_encoder_shared_encodes",
            "Images that waited for another request's encode of the same image",
            registry=registry,
        )
        self.peer_fetches = Counter(
            "epd_encoder_peer_fetches",
            "Items fetched from another encoder's cache instead of encoded, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.peer_fetch_bytes = Counter(
            "epd_encoder_peer_fetch_bytes",
            "Embedding bytes fetched from other encoders",
            registry=registry,
        )
        self.peer_fetch_seconds = Histogram(
            "epd_encoder_peer_fetch_seconds",
            "Seconds per item fetched from another encoder",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.peer_served = Counter(
            "epd_encoder_peer_served",
            "Fetches from other encoders, by outcome: sent, or missing here",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("fetched", "missing", "failed"):
            self.peer_fetches.labels(outcome)
        for outcome in ("sent", "missing"):
            self.peer_served.labels(outcome)

    def expect_transports(self, transports: Iterable[Transport]) -> None:
        """Each transport's series exported at 0 before its first write (a series
        born at its first value hides that value from rate())."""
        for transport in transports:
            self.write_bytes.labels(transport.name.lower())
            self.write_seconds.labels(transport.name.lower())

    def on_written(self, transport: Transport, num_bytes: int, seconds: float) -> None:
        name = transport.name.lower()
        self.write_bytes.labels(name).inc(num_bytes)
        self.write_seconds.labels(name).observe(seconds)
