"""The engine's loop, the one both hosts run (AsyncEngine on a thread of the
language service, EngineProcess in a child process). A host is only its
transport: how messages come in and how replies go out.

    until the host stops:
        take the messages that came (with no work to do, wait for one), apply them
        if there is work and the pacing lets it: step
        publish the messages' replies and the step's outputs

A step that fails (a bug, not bad input) fails the requests it held and the
loop goes on serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from services.language.engine.engine import LLMEngine
from services.language.engine.outputs import RequestOutput, StepStats
from services.language.engine.request import Request

logger = logging.getLogger(__name__)

# What every host sends the loop (AsyncEngine's inbox, EngineProcess's pipe)


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request


@dataclass(frozen=True, slots=True)
class AddMedia:
    """Streamed embeddings of a request's media tokens from `start` on (LLMEngine.add_media)."""

    request_id: str
    start: int
    embeds: torch.Tensor
    deepstack: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Encoding:
    """When the oldest request of this instance now awaiting its embeddings came
    (time.monotonic, one clock for the host's processes; None: none awaits them),
    and how long a request's embeddings have taken to arrive lately: Pacing's
    awaiting_since and media_wait_s."""

    since: float | None
    wait_s: float


# a request's output, or the error that ends it
Reply = tuple[str, RequestOutput | Exception]


class Host(Protocol):
    def receive(self, timeout: float | None) -> list[object] | None:
        """The messages that came; when none has, waits up to `timeout` seconds
        (None: until one comes) first. None (or EOFError) once the host stops."""

    def apply(self, message: object) -> list[Reply]:
        """A message applied to the engine (`apply` below for the ones every host
        sends), and the replies it makes."""

    def publish(self, replies: list[Reply], step: tuple[StepStats, float] | None) -> None:
        """Replies, the engine's load, and a step's figures with its seconds."""


def run(engine: LLMEngine, host: Host) -> None:
    wait: float | None = 0.0
    while (messages := host.receive(wait)) is not None:
        replies = [reply for message in messages for reply in host.apply(message)]
        if not engine.has_work():
            wait = None
        elif delay := engine.step_delay():  # the step once due, or a message first
            wait = delay
        else:
            wait = 0.0
            started = time.perf_counter()
            outputs, stats = step(engine)
            host.publish(replies + outputs, (stats, time.perf_counter() - started))
            continue
        host.publish(replies, None)


def step(engine: LLMEngine) -> tuple[list[Reply], StepStats]:
    try:
        outputs, stats = engine.step()
    except Exception as exc:  # a bug, not bad input: fail what is running, keep serving
        logger.exception("engine step failed")
        failed = list(engine.requests)
        for request_id in failed:
            engine.abort_request(request_id)
        error = RuntimeError(f"engine step failed: {exc}")
        return [(request_id, error) for request_id in failed], StepStats(0, 0, [], [])
    return replies(outputs), stats


def apply(engine: LLMEngine, message: object) -> list[Reply]:
    """A message every host sends, applied to the engine."""
    match message:
        case AddRequest(request):
            try:
                return replies(engine.add_request(request))
            except ValueError as exc:
                return [(request.request_id, exc)]
        case AddMedia(request_id, start, embeds, deepstack):
            return replies(engine.add_media(request_id, start, embeds, deepstack))
        case AbortRequest(request_id):
            return replies(engine.abort_request(request_id))
        case Encoding(since, wait_s):
            engine.pacing.awaiting_since, engine.pacing.media_wait_s = since, wait_s
            return []
    raise TypeError(f"not a message for the engine: {message!r}")


def replies(outputs: list[RequestOutput]) -> list[Reply]:
    return [(output.request_id, output) for output in outputs]
