"""The language service's Prometheus metrics (one registry per instance)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.language.engine.outputs import StepStats
from services.wire.transport import Transport

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


class LanguageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.running = gauge("epd_language_running_requests", "Requests in the running batch")
        self.waiting = gauge("epd_language_waiting_requests", "Requests queued for the engine")
        self.receiving = gauge("epd_language_receiving_requests", "Requests waiting for embeddings")
        self.engine_threads = gauge(
            "epd_language_engine_threads",
            "OpenMP threads of the engine's last step (fewer while requests wait for "
            "embeddings, with --threads-while-encoding)",
        )
        self.kv_pages_used = gauge("epd_language_kv_blocks_used", "KV cache pages in use")
        self.kv_pages_total = gauge("epd_language_kv_blocks_total", "KV cache pages")
        self.kv_pages_shared = gauge(
            "epd_language_kv_blocks_shared",
            "KV cache pages shared by the choices of n > 1 requests",
        )
        self.embedding_blocks_used = gauge(
            "epd_language_embedding_blocks_used", "Embedding pool blocks in use"
        )
        self.embedding_blocks_quarantined = gauge(
            "epd_language_embedding_blocks_quarantined",
            "Embedding blocks given up while an encoder may still write them (in use)",
        )
        self.embedding_blocks_total = gauge(
            "epd_language_embedding_blocks_total", "Embedding pool blocks"
        )
        self.generated_tokens = Counter(
            "epd_language_generated_tokens", "Output tokens generated", registry=registry
        )
        self.prompt_tokens = Counter(
            "epd_language_prompt_tokens",
            "Prompt tokens computed (recomputation included)",
            registry=registry,
        )
        self.requests = Counter(
            "epd_language_requests", "Finished requests by reason", ["reason"], registry=registry
        )
        self.transfers = Counter(
            "epd_language_transfers",
            "Finished embedding transfers by outcome",
            ["outcome"],
            registry=registry,
        )
        self._latencies(registry)
        self._kv_transfers(registry)
        self._pacing(registry)
        self._reuse(registry)

    def _reuse(self, registry: CollectorRegistry) -> None:
        """Work not done again: the prefix cache's hits, and pages moved."""
        self.prefix_cached_tokens = Counter(
            "epd_language_prefix_cache_hit_tokens",
            "Tokens whose KV pages came from the prefix cache (not computed), by kind: "
            "text, or an image's or video's",
            ["kind"],
            registry=registry,
        )
        self.media_tokens_held = Counter(
            "epd_language_media_tokens_held",
            "Image and video tokens asked of no encoder: the prefix cache held their KV",
            registry=registry,
        )
        self._prefix_moves(registry)

    def _prefix_moves(self, registry: CollectorRegistry) -> None:
        """A chat's KV pages moved between instances (prefix_moves.py)."""
        self.prefix_fetches = Counter(
            "epd_language_prefix_fetches",
            "Fetches of a chat's KV pages from the instance that holds them, by outcome: "
            "fetched, missing (it held none), failed (unreachable, late or unfit), skipped "
            "(too few pages for a fetch to beat computing them)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("fetched", "missing", "failed", "skipped"):
            self.prefix_fetches.labels(outcome)
        self.prefix_fetch_pages = Counter(
            "epd_language_prefix_fetch_pages", "KV pages fetched", registry=registry
        )
        self.prefix_fetch_bytes = Counter(
            "epd_language_prefix_fetch_bytes", "KV bytes fetched", registry=registry
        )
        self.prefix_fetch_seconds = Histogram(
            "epd_language_prefix_fetch_seconds",
            "Seconds per fetch that brought pages",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefix_move_min_pages = Gauge(
            "epd_language_prefix_move_min_pages",
            "The fewest KV pages a fetch must bring to beat computing them (the crossover, "
            "from the measured prefill and fetch rates), as of the last turn that could move",
            registry=registry,
        )
        self.prefill_token_seconds = Gauge(
            "epd_language_prefill_token_seconds",
            "A prompt token's measured prefill time, which a fetch's time is weighed against",
            registry=registry,
        )
        self.prefix_served = Counter(
            "epd_language_prefix_served",
            "Fetches of KV pages other instances made here, by outcome: sent, missing",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("sent", "missing"):
            self.prefix_served.labels(outcome)
        self.prefix_served_pages = Counter(
            "epd_language_prefix_served_pages",
            "KV pages sent to other instances",
            registry=registry,
        )

    def prefix_fetched(self, pages: int, num_bytes: int, seconds: float) -> None:
        self.prefix_fetches.labels("fetched").inc()
        self.prefix_fetch_pages.inc(pages)
        self.prefix_fetch_bytes.inc(num_bytes)
        self.prefix_fetch_seconds.observe(seconds)

    def _pacing(self, registry: CollectorRegistry) -> None:
        self.held_steps = Counter(
            "epd_language_held_steps",
            "Decode-only steps held while requests awaited their embeddings "
            "(--tpot-slo-ms and --ttft-slo-ms, or --decode-interval-while-encoding-ms)",
            registry=registry,
        )
        self.pacing_unmet_steps = Counter(
            "epd_language_pacing_unmet_steps",
            "Decode-only steps that the oldest request awaiting its embeddings wanted "
            "held (by --ttft-slo-ms) and the TPOT target left no time to "
            "hold (a decode step alone takes it): the first tokens and the TPOT target "
            "cannot both be kept",
            registry=registry,
        )
        self.held_seconds = Counter(
            "epd_language_held_seconds",
            "Their total wait: what the pacing added to the running requests' TPOT",
            registry=registry,
        )

    def _latencies(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "epd_language_ttft_seconds",
            "Time to first token (engine arrival to first token)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "epd_language_tpot_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "epd_language_step_seconds",
            "Engine steps by kind: decode (one token for each sequence) or prefill "
            "(prompt tokens too)",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )

    def _kv_transfers(self, registry: CollectorRegistry) -> None:
        """E/P/D: a prefill instance counts what it sent, a decode instance what it received."""
        self.kv_transfer_pages = Counter(
            "epd_kv_transfer_pages",
            "KV pages handed over (prefill instances: sent; decode instances: received)",
            ["direction", "transport"],
            registry=registry,
        )
        self.kv_transfer_bytes = Counter(
            "epd_kv_transfer_bytes",
            "KV bytes handed over",
            ["direction", "transport"],
            registry=registry,
        )
        self.kv_transfer_seconds = Histogram(
            "epd_kv_transfer_seconds",
            "Seconds per KV hand-off (sent: from the meta to the last write landing; "
            "received: from preallocating to the last part confirmed)",
            ["direction", "transport"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(
        self,
        running: Callable[[], int],
        waiting: Callable[[], int],
        receiving: Callable[[], int],
        kv_pages_used: Callable[[], int],
        kv_pages_shared: Callable[[], int],
        embedding_blocks_used: Callable[[], int],
        embedding_blocks_quarantined: Callable[[], int],
    ) -> None:
        """Pool and queue gauges read the live state at scrape time, so they are
        right after an abort too (no step runs then)."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.receiving.set_function(receiving)
        self.kv_pages_used.set_function(kv_pages_used)
        self.kv_pages_shared.set_function(kv_pages_shared)
        self.embedding_blocks_used.set_function(embedding_blocks_used)
        self.embedding_blocks_quarantined.set_function(embedding_blocks_quarantined)

    def expect_kv(self, direction: str, transports: Iterable[Transport]) -> None:
        """Every KV series this instance can have, exported at 0 before the first
        hand-off (a series born at its first value hides that value from rate())."""
        for transport in transports:
            name = transport.name.lower()
            for family in (self.kv_transfer_pages, self.kv_transfer_bytes):
                family.labels(direction, name)
            self.kv_transfer_seconds.labels(direction, name)

    def kv_transferred(
        self, direction: str, transport: Transport, pages: int, num_bytes: int, seconds: float
    ) -> None:
        name = transport.name.lower()
        self.kv_transfer_pages.labels(direction, name).inc(pages)
        self.kv_transfer_bytes.labels(direction, name).inc(num_bytes)
        self.kv_transfer_seconds.labels(direction, name).observe(seconds)

    def expect_steps(self) -> None:
        """Both kinds of step exported at 0 before the first (see expect_kv)."""
        for kind in ("decode", "prefill"):
            self.step_seconds.labels(kind)

    def on_step(self, stats: StepStats, seconds: float) -> None:
        """Called from the engine thread after every step, with how long it took."""
        kind = "decode" if stats.num_tokens == stats.num_generated else "prefill"
        self.step_seconds.labels(kind).observe(seconds)
        self.engine_threads.set(stats.threads)
        self.generated_tokens.inc(stats.num_generated)
        self.prompt_tokens.inc(stats.num_tokens - stats.num_generated)
        media = stats.num_cached_media_tokens
        self.prefix_cached_tokens.labels("text").inc(stats.num_cached_tokens - media)
        self.prefix_cached_tokens.labels("media").inc(media)
        if stats.held_s:
            self.held_steps.inc()
            self.held_seconds.inc(stats.held_s)
        if stats.pacing_unmet:
            self.pacing_unmet_steps.inc()
        for value in stats.ttfts:
            self.ttft.observe(value)
        for value in stats.tpots:
            self.tpot.observe(value)
