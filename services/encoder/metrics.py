"""The encoder's Prometheus metrics (one registry per encoder)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
            "epd_encoder_cache_misses", "Images sent to Triton", registry=registry
        )
        self.shared_encodes = Counter(
            "epd_encoder_shared_encodes",
            "Images that waited for another request's encode of the same image",
            registry=registry,
        )
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
