"""`epd gateway`: the app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import math

import uvicorn

from services.gateway.app import Gateway, create_app
from services.gateway.backend import Backend, GenerationBackend
from services.gateway.config import GatewayConfig
from services.gateway.media import MediaLoader
from services.gateway.metrics import GatewayMetrics
from services.gateway.responses.store import ResponseStore
from services.model.processor import ImageTokenRule
from services.model.video import VideoRule
from services.runtime import env
from services.runtime.grpc_server import metrics_registry


class GatewayServer:
    """The gateway in front of the broker's stack, or of a given backend (the
    monolithic baseline)."""

    def __init__(self, config: GatewayConfig, backend: GenerationBackend | None = None) -> None:
        self.config = config
        registry = metrics_registry()
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
            media=MediaLoader(config.limits, config.fetch, rule, video_rule),
            metrics=GatewayMetrics(registry),
            registry=registry,
            api_key=config.api_key,
            max_concurrent_requests=config.max_concurrent_requests,
            max_body_bytes=config.max_body_bytes,
            store=ResponseStore(config.responses_store_bytes, config.responses_ttl_s),
        )
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.gateway),
                host=config.host,
                port=config.port,
                log_level="warning",
                log_config=None,  # this process's logging (services/runtime/logs.py): text or JSON
                access_log=False,  # the request log is ours (request_log.py)
                timeout_graceful_shutdown=math.ceil(env.SHUTDOWN_GRACE.get()),
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
        await self.gateway.media.close()
