"""`epd language`: assembles the language service and runs it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from services.broker.instance import InstanceServer
from services.language.config import LanguageConfig
from services.language.engine.async_engine import AsyncEngine
from services.language.engine.engine import LLMEngine
from services.language.engine.interface import Engine
from services.language.engine.kv_cache import device_memory, kv_page_bytes, kv_planes
from services.language.engine.outputs import StepStats
from services.language.engine.process import EngineProcess
from services.language.frontend import Frontend
from services.language.kv_handoff import KVHandoff, KVPages, KVSource, LanguageDrivers
from services.language.metrics import LanguageMetrics
from services.language.prefix_moves import MoveCost, PageShape, PrefixPeers
from services.language.servicer import LanguageServicer, add_to_server
from services.model.checkpoint import load_language_weights
from services.model.processor import ImageTokenRule
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from services.proto import language_pb2
from services.runtime.grpc_server import metrics_registry
from services.runtime.malloc import keep_freed_memory
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.sender_driver import SenderDriver
from services.transfer.transports.base import ReceiveEnd
from services.transfer.transports.ends import receive_side, writers
from services.wire.messages import Heartbeat, LanguageRole, PoolDescriptor, Register
from services.wire.transport import Transport

logger = logging.getLogger(__name__)


def noop() -> None:
    pass


class LanguageServer(InstanceServer):
    """A language instance in its role: `both` receives embeddings into its
    embedding pool and generates; `prefill` does the same up to the first
    token, then hands the KV pages over (a KV sender reading its KV cache);
    `decode` receives KV pages straight into its KV cache, which lives where
    the transports reach it, and generates from there."""

    def __init__(self, config: LanguageConfig, on_engine_lost: Callable[[], None] = noop) -> None:
        super().__init__(config.instance)
        self.config = config
        self.role = config.role
        self.spec = load_spec(config.checkpoint)
        self.tokenizer = load_tokenizer(config.checkpoint, config.chat_template)
        registry = metrics_registry()
        self.metrics = LanguageMetrics(registry)
        self.metrics.expect_steps()
        engine_config = config.engine
        self.move_cost = MoveCost(
            engine_config.page_size,
            kv_page_bytes(self.spec.text, engine_config.page_size, engine_config.dtype),
        )
        if self.role is not LanguageRole.BOTH:
            direction = "sent" if self.role is LanguageRole.PREFILL else "received"
            self.metrics.expect_kv(direction, config.instance.transports)
        self.ends: dict[Transport, ReceiveEnd] = {}
        kv: KVHandoff | None = None
        self.kv_layout: PoolLayout | None = None  # the KV cache's, where this process has it
        if config.engine_process:
            self.engine: Engine = EngineProcess(
                config.checkpoint,
                config.engine,
                self.spec,
                self.tokenizer,
                self._on_step,
                on_engine_lost,
            )
            self.pool, self.ends = self._embedding_receive_side()
            self.receiver = self._receiver(None)
        else:
            keep_freed_memory()  # a CPU engine's activations (with a GPU: host memory only)
            weights = load_language_weights(config.checkpoint, self.spec, config.dtype)
            decode = self.role is LanguageRole.DECODE
            kv_memory = self._kv_receive_side if decode else device_memory
            llm = LLMEngine(self.spec, weights, self.tokenizer, config.engine, kv_memory=kv_memory)
            self.engine = engine = AsyncEngine(llm, self._on_step)
            self.kv_layout = llm.runner.kv_cache.pool.layout
            if decode:
                self.pool = llm.runner.kv_cache.pool
            else:
                self.pool, self.ends = self._embedding_receive_side()
            self.receiver = self._receiver(KVPages(engine) if decode else None)
            if self.role is LanguageRole.PREFILL:
                kv = self._kv_handoff(llm, engine)
        self.driver = LanguageDrivers(self.receiver, kv.sender if kv is not None else None)
        self.frontend = self._frontend(kv)
        self._observe()
        self.servicer = servicer = LanguageServicer(
            self.frontend, self.receiver, self.metrics, config.max_active_requests, self.role
        )
        self.grpc = config.instance.server(
            language_pb2.DESCRIPTOR.services_by_name["Language"].full_name,
            lambda server: add_to_server(servicer, server),
            registry,
        )

    def _frontend(self, kv: KVHandoff | None) -> Frontend:
        return Frontend(
            self.engine,
            self.tokenizer,
            self.spec,
            self.receiver,
            ImageTokenRule.from_checkpoint(self.config.checkpoint).max_tokens,
            kv,
            on_kv_received=partial(self._kv_observed, "received"),
            on_media_held=self.metrics.media_tokens_held.inc,
            prefill_while_encoding=self.config.prefill_while_encoding,
            prefix_peers=PrefixPeers(self._page_shape(), self.move_cost, self.metrics),
        )

    def _page_shape(self) -> PageShape:
        engine = self.config.engine
        widths = tuple(plane.width for plane in kv_planes(self.spec.text))
        return PageShape(engine.page_size, engine.dtype, widths)

    def _on_step(self, stats: StepStats, seconds: float) -> None:
        """After every engine step (on the engine's thread, or the pipe's reader)."""
        self.metrics.on_step(stats, seconds)
        self.move_cost.on_step(stats, seconds)

    def _embedding_receive_side(self) -> tuple[EmbeddingPool, dict[Transport, ReceiveEnd]]:
        config = self.config
        layout = PoolLayout(
            num_blocks=config.embedding_pool_tokens // config.embedding_block_size,
            block_size=config.embedding_block_size,
            planes=embedding_planes(self.spec.text.hidden_size, self.spec.vision.deepstack_levels),
            dtype=config.dtype,
        )
        return self._receive_side(layout, torch.device(config.engine.device))

    def _kv_receive_side(self, layout: PoolLayout, device: torch.device) -> EmbeddingPool:
        """A decode instance's KV cache: its engine builds it here, where the
        transports reach it."""
        pool, self.ends = self._receive_side(layout, device)
        return pool

    def _receive_side(
        self, layout: PoolLayout, device: torch.device
    ) -> tuple[EmbeddingPool, dict[Transport, ReceiveEnd]]:
        instance = self.config.instance
        return receive_side(
            layout, device, instance.transports, instance.instance_id, lambda: self.grpc.address
        )

    def _receiver(self, blocks: KVPages | None) -> ReceiverDriver:
        """Receive blocks from the embedding pool, or (`blocks`: a decode instance)
        KV pages from its engine."""
        config = self.config
        return ReceiverDriver(
            self.pool,
            self.to_broker,
            self.ends,
            config.default_allocate_tokens,
            config.transfer_timeout_s,
            on_finished=lambda state: self.metrics.transfers.labels(state.name.lower()).inc(),
            pool_wait_s=config.pool_wait_s,
            quarantine_s=config.quarantine_s,
            blocks=blocks,
        )

    def _kv_handoff(self, llm: LLMEngine, engine: AsyncEngine) -> KVHandoff:
        """A prefill instance's KV sender, its writes reading the KV cache."""
        config, instance = self.config, self.config.instance
        kv = llm.runner.kv_cache.pool
        source = KVSource(kv, engine)
        sender = SenderDriver(
            source,
            self.to_broker,
            writers(instance.transports, instance.instance_id, kv, config.transfer_timeout_s, "kv"),
            instance.host_id,
            config.transfer_timeout_s,
        )
        return KVHandoff(sender, source, partial(self._kv_observed, "sent"))

    def _kv_observed(
        self, direction: str, transport: Transport, tokens: int, seconds: float
    ) -> None:
        layout = self.kv_layout
        assert layout is not None, "KV pages cross only between engines in this process"
        pages = -(-tokens // layout.block_size)
        self.metrics.kv_transferred(
            direction, transport, pages, tokens * layout.token_bytes, seconds
        )

    def _observe(self) -> None:
        """The gauges read at each scrape: the engine's load, the receive pool (a
        decode instance has no embedding pool: its KV pages, quarantined ones
        included, count as KV pages used)."""
        engine, receiver = self.engine, self.receiver
        embeddings = self.pool if self.role is not LanguageRole.DECODE else None
        self.metrics.kv_pages_total.set(engine.num_kv_pages)
        self.metrics.embedding_blocks_total.set(embeddings.layout.num_blocks if embeddings else 0)
        self.metrics.observe(
            running=lambda: engine.load.running,
            waiting=lambda: engine.load.waiting,
            receiving=lambda: len(receiver.transfers),
            kv_pages_used=lambda: engine.load.kv_pages_used,
            kv_pages_shared=lambda: engine.load.kv_pages_shared,
            embedding_blocks_used=lambda: embeddings.allocator.num_used_blocks if embeddings else 0,
            embedding_blocks_quarantined=lambda: (
                receiver.num_quarantined_blocks if embeddings else 0
            ),
        )

    def registration(self) -> Register:
        layout = self.pool.layout
        pool = PoolDescriptor(
            layout.num_blocks, layout.block_size, layout.planes, layout.dtype
        ).reached_by(end.endpoint() for end in self.ends.values())
        return self.config.instance.registration(
            self.grpc.address, pool.transports, self.config.model_name, pool, self.role
        )

    def load(self) -> Heartbeat:
        if self.role is LanguageRole.DECODE:  # its pool is the KV cache, its engine's pages
            free = self.engine.num_kv_pages - self.engine.load.kv_pages_used
        else:
            free = self.pool.allocator.num_free_blocks
        return Heartbeat(
            num_requests=self.engine.num_requests + len(self.receiver.transfers),
            free_blocks=free,
            max_requests=self.config.max_active_requests,
        )

    async def start(self) -> None:
        self.engine.start()  # warmed up before it serves
        await super().start()
        polling = self.receiver.polling
        for end in self.ends.values():
            end.start(busy=lambda: bool(polling))

    def refuse_new(self) -> None:
        self.servicer.drain()  # the gateways' streams end once their requests have

    async def release(self) -> None:
        await self.engine.stop()
        if self.frontend.prefix_peers is not None:
            await self.frontend.prefix_peers.close()
        self.frontend.close()
        for end in self.ends.values():
            end.close()
        self.pool.close()
