"""`epd language`: assembles the language service and runs it."""

from __future__ import annotations

import logging

import torch
from prometheus_client import CollectorRegistry

from services.instance import InstanceServer
from services.language.config import LanguageConfig
from services.language.engine.async_engine import AsyncEngine
from services.language.engine.engine import LLMEngine
from services.language.frontend import Frontend
from services.language.metrics import LanguageMetrics
from services.language.servicer import LanguageServicer
from services.model.checkpoint import load_language_weights
from services.model.processor import ImageTokenRule
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from services.proto import language_pb2, language_pb2_grpc
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.transports.ends import receive_side
from services.wire.messages import (
    Heartbeat,
    PoolDescriptor,
    Register,
)

logger = logging.getLogger(__name__)


class LanguageServer(InstanceServer):
    def __init__(self, config: LanguageConfig) -> None:
        super().__init__(config.instance)
        self.config = config
        self.spec = load_spec(config.checkpoint)
        self.tokenizer = load_tokenizer(config.checkpoint)
        registry = CollectorRegistry()
        self.metrics = LanguageMetrics(registry)
        weights = load_language_weights(config.checkpoint, self.spec, config.dtype)
        self.engine = AsyncEngine(
            LLMEngine(self.spec, weights, self.tokenizer, config.engine), self.metrics.on_step
        )
        self.pool, self.ends = receive_side(
            PoolLayout(
                num_blocks=config.embedding_pool_tokens // config.embedding_block_size,
                block_size=config.embedding_block_size,
                planes=embedding_planes(
                    self.spec.text.hidden_size, self.spec.vision.deepstack_levels
                ),
                dtype=config.dtype,
            ),
            torch.device(config.engine.device),
            config.instance.transports,
            config.instance.instance_id,
            lambda: self.grpc.address,
        )
        self.receiver = self.driver = ReceiverDriver(
            self.pool,
            self.to_broker,
            self.ends,
            config.default_allocate_tokens,
            config.transfer_timeout_s,
            on_finished=lambda state: self.metrics.transfers.labels(state.name.lower()).inc(),
            pool_wait_s=config.pool_wait_s,
            quarantine_s=config.quarantine_s,
        )
        self.frontend = Frontend(
            self.engine,
            self.tokenizer,
            self.spec,
            self.receiver,
            ImageTokenRule.from_checkpoint(config.checkpoint).max_tokens,
        )
        self._observe()
        servicer = LanguageServicer(
            self.frontend, self.receiver, self.metrics, config.max_active_requests
        )
        self.grpc = config.instance.server(
            language_pb2.DESCRIPTOR.services_by_name["Language"].full_name,
            lambda server: language_pb2_grpc.add_LanguageServicer_to_server(servicer, server),
            registry,
        )

    def _observe(self) -> None:
        """The gauges read at each scrape: the engine's load, the receive pool."""
        engine, pool, receiver = self.engine, self.pool, self.receiver
        self.metrics.kv_pages_total.set(engine.num_kv_pages)
        self.metrics.embedding_blocks_total.set(pool.layout.num_blocks)
        self.metrics.observe(
            running=lambda: engine.load.running,
            waiting=lambda: engine.load.waiting,
            receiving=lambda: len(receiver.transfers),
            kv_pages_used=lambda: engine.load.kv_pages_used,
            kv_pages_shared=lambda: engine.load.kv_pages_shared,
            embedding_blocks_used=lambda: pool.allocator.num_used_blocks,
            embedding_blocks_quarantined=lambda: receiver.num_quarantined_blocks,
        )

    def registration(self) -> Register:
        layout = self.pool.layout
        pool = PoolDescriptor(
            layout.num_blocks, layout.block_size, layout.planes, layout.dtype
        ).reached_by(end.endpoint() for end in self.ends.values())
        return self.config.instance.registration(
            self.grpc.address, pool.transports, self.config.model_name, pool
        )

    def load(self) -> Heartbeat:
        return Heartbeat(
            num_requests=self.engine.num_requests + len(self.receiver.transfers),
            free_blocks=self.pool.allocator.num_free_blocks,
        )

    async def start(self) -> None:
        self.engine.start()  # warmed up before it serves
        await super().start()
        polling = self.receiver.polling
        for end in self.ends.values():
            end.start(busy=lambda: bool(polling))

    async def release(self) -> None:
        await self.engine.stop()
        self.frontend.close()
        for end in self.ends.values():
            end.close()
        self.pool.close()
