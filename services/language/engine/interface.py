"""What the language service asks of an engine: the interface that AsyncEngine
(async_engine.py: the loop on a thread of this process) and EngineProcess
(process.py: the loop in a child process) both implement, and the part of it
they share (EngineHost); the loop itself is loop.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.language.engine.config import EngineConfig, RequestChecks
from services.language.engine.grammar import Grammars
from services.language.engine.kv_cache import PrefixPages
from services.language.engine.outputs import EngineLoad, RequestFailedError, RequestOutput
from services.language.engine.request import Request
from services.model.spec import ModelSpec
from services.wire.messages import FirstToken
from services.wire.request import SamplingParams


@dataclass(slots=True)
class Going:
    """A request's choices still going, counted down as its outputs are taken."""

    choices: int

    async def outputs(
        self, q: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        """Its outputs from the queue its engine fills, until every choice has
        finished; an error the engine put there, or an output that failed, raises."""
        while self.choices:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                raise RequestFailedError(item.error)
            self.choices -= item.finished
            yield item


class Engine(Protocol):
    """What the language service's frontend and servicer ask of an engine:
    AsyncEngine (its loop on a thread of this process) or EngineProcess (in a
    child process). `load`: the engine's as of its last step."""

    load: EngineLoad
    checks: RequestChecks

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_kv_pages(self) -> int: ...

    @property
    def num_requests(self) -> int: ...

    async def compile_grammar(self, params: SamplingParams) -> Any: ...

    def generate(
        self, request: Request, firsts: Sequence[FirstToken] = ()
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def has_request(self, request_id: str) -> bool: ...

    async def export_prefix(
        self, digests: Sequence[bytes], min_pages: int, timeout_s: float, with_planes: bool = True
    ) -> PrefixPages:
        """The cached pages the digests begin with (none if fewer than min_pages;
        without planes, only which they are), read while the engine steps
        (LLMEngine.export_prefix); TimeoutError past timeout_s."""

    def add_media(
        self, request_id: str, start: int, embeds: torch.Tensor, deepstack: torch.Tensor | None
    ) -> None:
        """Embeddings of a streamed request's media tokens from `start` on."""

    def abort(self, request_id: str) -> None: ...

    def set_encoding(self, since: float | None, wait_s: float) -> None:
        """When the oldest request now awaiting its embeddings came (None: none),
        and how long embeddings have taken to arrive lately."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


OutputQueue = asyncio.Queue[RequestOutput | BaseException]


class EngineHost:
    """What both hosts do alike: the checks (on the immutable config and spec, so
    callable from the event loop), grammar compilation, and each request's queue
    of outputs, which `_outputs` reads until every choice has finished."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, grammars: Grammars) -> None:
        self.config = config
        self.spec = spec
        self.grammars = grammars
        self.checks = RequestChecks(config, spec)
        self._queues: dict[str, OutputQueue] = {}

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def check(self, request: Request) -> None:
        """A request this engine can take: it passes the checks, and its id is not
        one in flight (ValueError otherwise)."""
        self.checks.check(request)
        if request.request_id in self._queues:
            raise ValueError(f"duplicate request id {request.request_id!r}")

    async def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (None without one), compiled off the loop."""
        return await self.grammars.compile(params)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def _outputs(
        self, request: Request, q: OutputQueue
    ) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request whose queue is `q` (registered by the caller),
        until every choice finishes; leaving early aborts it."""
        going = Going(request.sampling.n)
        try:
            async for output in going.outputs(q):
                yield output
        finally:
            del self._queues[request.request_id]
            if going.choices:
                self.abort(request.request_id)
