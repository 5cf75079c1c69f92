"""`epd encoder`: assembles the encoder service and runs it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.broker.client import BrokerUnavailableError
from services.broker.instance import InstanceServer
from services.encoder.cache import EmbeddingCache
from services.encoder.config import EncoderConfig
from services.encoder.metrics import EncoderMetrics
from services.encoder.pipeline import EncodePipeline
from services.encoder.preprocess import Preprocessor
from services.encoder.send_buffer import SendBuffer
from services.encoder.servicer import EncoderServicer
from services.encoder.triton_client import VitClient
from services.model.spec import ModelSpec, load_spec
from services.proto import encoder_pb2, encoder_pb2_grpc
from services.runtime.grpc_server import metrics_registry
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout, embedding_planes
from services.transfer.sender_driver import SenderDriver
from services.transfer.transports.cuda_ipc import cuda_ipc_available
from services.transfer.transports.ends import writers
from services.wire.messages import Heartbeat, Register
from services.wire.transport import Transport

logger = logging.getLogger(__name__)


def _send_buffer(config: EncoderConfig, spec: ModelSpec) -> SendBuffer:
    """Where embeddings wait for their transfer: pinned where CUDA IPC copies from
    it, so that the host-to-GPU copy is one DMA."""
    layout = PoolLayout(
        num_blocks=config.send_buffer_tokens // config.send_block_size,
        block_size=config.send_block_size,
        planes=embedding_planes(spec.vision.out_hidden_size, spec.vision.deepstack_levels),
        dtype=config.dtype,
    )
    pin = Transport.CUDA_IPC in config.instance.transports and cuda_ipc_available()
    return SendBuffer(EmbeddingPool.in_host_memory(layout, pin=pin))


class EncoderServer(InstanceServer):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config.instance)
        self.config = config
        spec = load_spec(config.checkpoint)
        registry = metrics_registry()
        self.metrics = EncoderMetrics(registry)
        self.vit = VitClient(
            config.triton_url,
            hidden_size=spec.vision.out_hidden_size,
            deepstack_levels=spec.vision.deepstack_levels,
            merge_size=spec.vision.spatial_merge_size,
            shared_memory=config.triton_shared_memory,
            timeout_s=config.triton_timeout_s,
            max_in_flight=config.triton_max_in_flight,
            http_url=config.triton_http_url,
        )
        self.preprocessor = Preprocessor(
            config.checkpoint, config.limits, config.preprocess_workers
        )
        self.pipeline = EncodePipeline(
            self.preprocessor,
            self.vit,
            EmbeddingCache(config.cache_bytes),
            config.limits,
            self.metrics,
            config.items_one_by_one,
        )
        self.buffer = _send_buffer(config, spec)
        buffer = self.buffer
        self.metrics.send_buffer_bytes.set_function(lambda: buffer.bytes_used)
        self.sender = self.driver = SenderDriver(
            self.buffer,
            self.to_broker,
            writers(
                config.instance.transports,
                config.instance.instance_id,
                self.buffer.pool,
                config.write_timeout_s,
            ),
            config.instance.host_id,
            config.transfer_timeout_s,
            on_finished=lambda _, state: self.metrics.transfers.labels(state.name.lower()).inc(),
            on_written=self.metrics.on_written,
        )
        self.metrics.expect_transports(config.instance.transports)
        servicer = EncoderServicer(
            self.pipeline,
            self.buffer,
            self.sender,
            self.metrics,
            config.buffer_wait_s,
            config.max_pending,
        )
        self.grpc = config.instance.server(
            encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
            lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
            registry,
        )
        self.triton_ready: bool | None = None  # unknown until the first probe
        self._reported_on = -1  # the attachment the broker last heard of the cache on

    def registration(self) -> Register:
        return self.config.instance.registration(
            self.grpc.address, self.sender.transports, self.config.model_name
        )

    def load(self) -> Heartbeat:
        pipeline = self.pipeline
        return Heartbeat(
            num_requests=len(self.sender.transfers),
            unavailable=not self.triton_ready,
            cached_items=len(pipeline.cache),
            cache_lookups=pipeline.num_lookups,
            cache_hits=pipeline.num_hits,
            queue_depth=pipeline.num_encoding,
            encode_seconds=pipeline.recent_encode_seconds(),
        )

    async def on_serving(self) -> None:
        await self._check_triton()  # registers unavailable while Triton is not ready

    def periodic(self) -> list[tuple[float, Callable[[], Awaitable[None]]]]:
        return [
            (self.config.triton_check_s, self._check_triton),
            (self.config.cache_report_s, self._report_cache),
        ]

    async def _report_cache(self) -> None:
        """Tells the broker what entered and left the embedding cache (it routes
        by it): the whole cache first on each Attach stream, then the changes."""
        link = self.link
        if link is None or not link.attached.is_set():
            return
        full = link.num_attachments != self._reported_on
        report = self.pipeline.cache.report(full)
        if not (report.full or report.added or report.evicted):
            return
        try:
            link.send(report)
        except BrokerUnavailableError:
            self._reported_on = -1  # lost: the whole cache goes next time
            return
        self._reported_on = link.num_attachments

    async def _check_triton(self) -> None:
        """Health follows Triton: NOT_SERVING (and unavailable to the broker's
        routing) while it is unreachable or its model is not ready."""
        ready = await self.vit.ready()
        if ready and self.vit.reclaiming:
            await self.vit.reclaim()
        if ready == self.triton_ready:
            return
        self.triton_ready = ready
        await self.grpc.set_serving(ready)
        if self.link is not None and self.link.attached.is_set():
            self.link.send(self._heartbeat())  # the broker routes by it: no waiting for a heartbeat
        log = logger.info if ready else logger.warning
        log("Triton at %s is %s", self.vit.url, "ready" if ready else "unreachable")

    async def release(self) -> None:
        await self.vit.close()
        await self.pipeline.peers.close()
        self.preprocessor.close()
