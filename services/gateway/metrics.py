"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "epd_gateway_requests",
            "Chat completion requests by HTTP status",
            ["status"],
            registry=registry,
        )
        self.in_flight = Gauge("epd_gateway_in_flight", "Requests in progress", registry=registry)
        self.images = Counter("epd_gateway_images", "Images received", registry=registry)
        self.prompt_tokens = Counter(
            "epd_gateway_prompt_tokens", "Prompt tokens served", registry=registry
        )
        self.completion_tokens = Counter(
            "epd_gateway_completion_tokens", "Completion tokens served", registry=registry
        )
        self.latency = Histogram(
            "epd_gateway_request_seconds",
            "End-to-end request time",
            buckets=BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "epd_gateway_ttft_seconds",
            "Time to the first content token",
            buckets=BUCKETS,
            registry=registry,
        )
