"""`epd gateway`: the app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from services.encoder.limits import ImageLimits
from services.gateway.app import Gateway, create_app
from services.gateway.backend import Backend, GenerationBackend
from services.gateway.images import FetchPolicy, ImageLoader
from services.gateway.metrics import GatewayMetrics
from services.model.processor import ImageTokenRule
from services.model.video import VideoRule
from services.ports import GATEWAY_PORT


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    broker: str
    checkpoint: Path | None = None  # for token hints: its preprocessor_config.json
    host: str = "127.0.0.1"
    port: int = GATEWAY_PORT
    api_key: str = ""
    limits: ImageLimits = field(default_factory=ImageLimits)
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    generate_timeout_s: float = 900.0
    encode_timeout_s: float = 60.0
    # Answered 503 with Retry-After, not 404, while no instance serves them.
    served_models: tuple[str, ...] = ()
    max_concurrent_requests: int = 512  # beyond: 429 with Retry-After
    max_body_bytes: int = 64 * 1024 * 1024  # beyond: 413


class GatewayServer:
    """The gateway in front of the broker's stack, or of a given backend (the
    monolithic baseline)."""

    def __init__(self, config: GatewayConfig, backend: GenerationBackend | None = None) -> None:
        self.config = config
        registry = CollectorRegistry()
        rule = ImageTokenRule.from_checkpoint(config.checkpoint) if config.checkpoint else None
        video_rule = VideoRule.from_checkpoint(config.checkpoint) if config.checkpoint else None
        self.gateway = Gateway(
            backend=backend
            or Backend(
                config.broker,
                encode_timeout_s=config.encode_timeout_s,
                generate_timeout_s=config.generate_timeout_s,
                served_models=config.served_models,
            ),
            images=ImageLoader(config.limits, config.fetch, rule, video_rule),
            metrics=GatewayMetrics(registry),
            registry=registry,
            api_key=config.api_key,
            max_concurrent_requests=config.max_concurrent_requests,
            max_body_bytes=config.max_body_bytes,
        )
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.gateway),
                host=config.host,
                port=config.port,
                log_level="warning",
                lifespan="off",
            )
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        servers = getattr(self._server, "servers", [])
        if servers and servers[0].sockets:
            return int(servers[0].sockets[0].getsockname()[1])
        return self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self.gateway.backend.start()
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.gateway.backend.close()
        await self.gateway.images.close()
