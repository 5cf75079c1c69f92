"""BrokerLink: an instance's end of the Attach stream.

Registers, sends heartbeats with the instance's load, hands every broker
message to the instance's handler (in order), and reconnects with backoff
when the stream breaks, re-registering, so a broker restart heals by itself.
Messages sent while detached fail fast with BrokerUnavailableError: the
requests they belong to are failed by their owners, never left waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.proto import broker_pb2, broker_pb2_grpc
from services.runtime.grpc_server import channel
from services.wire.convert import unwrap, wrap
from services.wire.messages import BrokerMessage, Heartbeat, PeerMessage, Register, Registered

logger = logging.getLogger(__name__)

Handler = Callable[[BrokerMessage], Awaitable[None]]


class BrokerUnavailableError(ConnectionError):
    """Not attached to the broker right now."""


class BrokerLink:
    def __init__(
        self,
        address: str,
        registration: Register,
        handler: Handler,
        load: Callable[[], Heartbeat],
        on_detached: Callable[[], Awaitable[None]] | None = None,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.address = address
        self.registration = registration
        self._handler = handler
        self._load = load
        self._on_detached = on_detached
        self._max_backoff_s = max_backoff_s
        self._outbox: asyncio.Queue[broker_pb2.PeerMessage | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.attached = asyncio.Event()
        self.num_attachments = 0

    @property
    def instance_id(self) -> str:
        return self.registration.instance_id

    async def start(self, wait_s: float | None = 10.0) -> None:
        """Starts the link; with wait_s, waits that long for the first registration."""
        self._task = asyncio.create_task(self._run())
        if wait_s is not None:
            try:
                async with asyncio.timeout(wait_s):
                    await self.attached.wait()
            except TimeoutError:
                raise BrokerUnavailableError(
                    f"could not attach to the broker at {self.address} within {wait_s:.0f}s"
                ) from None

    def send(self, message: PeerMessage) -> None:
        if self._outbox is None or not self.attached.is_set():
            raise BrokerUnavailableError(f"not attached to the broker at {self.address}")
        self._outbox.put_nowait(wrap(broker_pb2.PeerMessage, message))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.attached.clear()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._attach_once()
                backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                logger.debug("broker stream ended: %s", exc.code())
            was_attached = self.attached.is_set()
            self.attached.clear()
            self._outbox = None
            if was_attached:
                logger.warning("lost the broker at %s; reconnecting", self.address)
                if self._on_detached is not None:
                    await self._on_detached()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _attach_once(self) -> None:
        outbox: asyncio.Queue[broker_pb2.PeerMessage | None] = asyncio.Queue()
        outbox.put_nowait(wrap(broker_pb2.PeerMessage, self.registration))

        async def outgoing() -> AsyncIterator[broker_pb2.PeerMessage]:
            while (message := await outbox.get()) is not None:
                yield message

        heartbeat: asyncio.Task[None] | None = None
        async with channel(self.address) as ch:
            call = broker_pb2_grpc.BrokerStub(ch).Attach(outgoing())
            try:
                async for pb in call:
                    message = unwrap(pb)
                    if isinstance(message, Registered):
                        self._outbox = outbox
                        self.attached.set()
                        self.num_attachments += 1
                        heartbeat = asyncio.create_task(
                            self._heartbeat(outbox, message.heartbeat_interval_s)
                        )
                        logger.info("attached to the broker at %s", self.address)
                        continue
                    try:
                        await self._handler(message)
                    except Exception:
                        logger.exception("handling %s failed", type(message).__name__)
            finally:
                if heartbeat is not None:
                    heartbeat.cancel()
                outbox.put_nowait(None)
                call.cancel()

    async def _heartbeat(
        self, outbox: asyncio.Queue[broker_pb2.PeerMessage | None], interval_s: float
    ) -> None:
        while True:
            outbox.put_nowait(wrap(broker_pb2.PeerMessage, self._load()))
            await asyncio.sleep(interval_s)
