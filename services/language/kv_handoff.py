"""E/P/D: a prefill instance hands a request's KV pages to a decode instance.

The hand-off is a transfer like an encoder's embeddings (services/transfer/),
its id the request's + "/kv": the decode instance preallocates pages and
announces them (Prealloc), the prefill instance announces the prompt (KvMeta:
its tokens, M-RoPE delta, each choice's first token), the broker pairs the
two, the prefill instance writes the pages over the best transport both
share, and the decode instance admits the request straight into its decode
batch with the pages as its block table.

    prefill instance                          decode instance
    Frontend.prefill                          Frontend.decode
    KVSource: the engine's KV cache           KVPages: pages its engine hands out
    SenderDriver (sender_driver.py)           ReceiverDriver that keeps its blocks
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.language.engine.async_engine import AsyncEngine
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.receiver_driver import ReceiverDriver
from services.transfer.sender_driver import Held, SenderDriver
from services.wire import messages
from services.wire.messages import (
    Abort,
    BrokerMessage,
    InstanceJoined,
    KvMeta,
    PeerLost,
    Prealloc,
    Resume,
    is_kv_transfer,
)
from services.wire.transport import Transport

# A finished KV transfer: its transport, tokens and seconds (for the metrics).
KVObserver = Callable[[Transport, int, float], None]


class KVPages:
    """A decode instance's receive blocks: KV pages its engine hands out, all a
    part needs or none (a request holds its pages: partial ones could deadlock)."""

    keeps_blocks = True

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def allocate(self, num_tokens: int, wait_s: float) -> list[int]:
        return await self.engine.reserve_pages(num_tokens, wait_s)

    def free(self, blocks: list[int]) -> None:
        self.engine.free_pages(blocks)


class KVSource:
    """A prefill instance's KV cache as a sender's source: each transfer reads
    its request's pages, which the engine keeps (PREFILLED) until the transfer
    lets them go."""

    def __init__(self, pool: EmbeddingPool, engine: AsyncEngine) -> None:
        self.pool = pool
        self.engine = engine
        self._held: dict[str, Held] = {}

    def hold(self, transfer_id: str, pages: Sequence[int], num_tokens: int) -> Held:
        held = self._held[transfer_id] = Held(transfer_id, list(pages), num_tokens)
        return held

    def held(self, request_id: str) -> Held:
        return self._held[request_id]

    def release(self, request_id: str) -> None:
        """No write reads the pages any more: the engine frees them (if it still
        holds them: this is also how a hand-off that never started lets go)."""
        self._held.pop(request_id, None)
        self.engine.release(request_id.removesuffix(messages.KV_TRANSFER_SUFFIX))


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """What a prefill instance's frontend hands KV pages over with."""

    sender: SenderDriver
    source: KVSource
    on_sent: KVObserver = lambda transport, tokens, seconds: None

    def hold(
        self, decode_instance_id: str, request: Request, outputs: Sequence[RequestOutput]
    ) -> KvMeta:
        """The pages of a prefilled request's prompt, held for their transfer to the
        decode instance, and the KvMeta that announces them: the prompt, and each
        choice's first token in choice order."""
        prefilled = [o.prefilled for o in sorted(outputs, key=lambda o: o.index)]
        assert prefilled[0] is not None
        transfer = messages.kv_transfer_id(request.request_id)
        held = self.source.hold(transfer, prefilled[0].pages, request.num_prompt_tokens)
        layout = self.source.pool.layout
        return KvMeta(
            transfer,
            decode_instance_id,
            held.num_tokens,
            layout.planes,
            layout.dtype,
            layout.block_size,
            tuple(request.prompt_token_ids),
            tuple(p.first for p in prefilled if p is not None),
            request.mrope_delta,
        )


class LanguageDrivers:
    """A language instance's transfer drivers: its receiver (embeddings; a decode
    instance's KV pages) and a prefill instance's KV sender. Each broker message
    goes to the one whose transfer it names; a lost peer concerns both."""

    def __init__(self, receiver: ReceiverDriver, kv_sender: SenderDriver | None = None) -> None:
        self.receiver = receiver
        self.kv_sender = kv_sender

    def _drivers(self) -> list[ReceiverDriver | SenderDriver]:
        return [self.receiver] if self.kv_sender is None else [self.receiver, self.kv_sender]

    async def on_message(self, message: BrokerMessage) -> None:
        sender = self.kv_sender
        match message:
            case PeerLost():
                for driver in self._drivers():
                    await driver.on_message(message)
            case InstanceJoined() | Prealloc() | Resume():  # only senders hear of these
                if sender is not None:
                    await sender.on_message(message)
            case Abort(request_id) if sender is not None and is_kv_transfer(request_id):
                await sender.on_message(message)
            case _:
                await self.receiver.on_message(message)

    async def expire(self) -> None:
        for driver in self._drivers():
            await driver.expire()

    async def detached(self) -> None:
        for driver in self._drivers():
            await driver.detached()

    async def close(self) -> None:
        for driver in self._drivers():
            await driver.close()
