"""The engine's two hosts, AsyncEngine (the loop on a thread) and EngineProcess (the
loop in a child process), tested alike: both run services/language/engine/loop.py,
and differ only in how messages reach it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.language.engine import loop
from services.language.engine.async_engine import AsyncEngine
from services.language.engine.interface import EngineHost
from services.language.engine.outputs import RequestOutput, StepStats
from services.language.engine.process import EngineProcess
from services.language.engine.request import SamplingParams
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from tests.language.engine_fixtures import make_engine, make_request, run_to_completion
from tests.reference import chat


@pytest_asyncio.fixture(params=["thread", "process"])
async def host(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> AsyncIterator[EngineHost]:
    engine = make_engine(tiny_checkpoint)
    started: AsyncEngine | EngineProcess
    if request.param == "thread":
        started = AsyncEngine(engine)
    else:
        spec = load_spec(tiny_checkpoint)
        tokenizer = load_tokenizer(tiny_checkpoint)
        started = EngineProcess(tiny_checkpoint, engine.config, spec, tokenizer)
    started.start()
    try:
        yield started
    finally:
        await started.stop()


async def _idle(host: EngineHost) -> None:
    for _ in range(250):
        if host.load == type(host.load)():  # nothing running, waiting or held
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine still holds {host.load}")


@pytest.mark.asyncio
async def test_requests_load_and_aborts_through_the_api(
    host: AsyncEngine | EngineProcess, tiny_checkpoint: Path
) -> None:
    assert host.max_model_len == 1024 and host.num_kv_pages > 0
    long = make_request(
        tiny_checkpoint, "long", chat("go on"), [], SamplingParams(max_tokens=500, ignore_eos=True)
    )
    outputs = host.generate(long)
    first = await anext(outputs)
    assert first.request_id == "long"
    assert host.has_request("long") and host.num_requests == 1
    for _ in range(100):  # the load is published as of the loop's last step
        if host.load.running == 1 and host.load.kv_pages_used > 0:
            break
        await asyncio.sleep(0.02)
    assert host.load.running == 1 and host.load.kv_pages_used > 0

    twin = host.generate(
        make_request(tiny_checkpoint, "long", chat("again"), [], SamplingParams(max_tokens=4))
    )
    with pytest.raises(ValueError, match="duplicate request id"):
        await anext(twin)
    assert host.has_request("long")  # the first one goes on

    await outputs.aclose()  # the caller leaves: the request is aborted
    assert not host.has_request("long") and host.num_requests == 0
    await _idle(host)


@pytest.mark.asyncio
async def test_concurrent_requests_each_equal_the_engine_run_alone(
    host: AsyncEngine | EngineProcess, tiny_checkpoint: Path
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)

    def requests() -> list:  # type: ignore[type-arg]
        return [
            make_request(tiny_checkpoint, f"r{i}", chat(f"Tell me about {i}"), [], params)
            for i in range(4)
        ]

    alone = run_to_completion(make_engine(tiny_checkpoint), requests())

    async def tokens(request) -> list[int]:  # type: ignore[no-untyped-def]
        return [t async for output in host.generate(request) for t in output.token_ids]

    got = await asyncio.gather(*(tokens(r) for r in requests()))
    for i, ids in enumerate(got):
        assert ids == [t for o in alone[f"r{i}"] for t in o.token_ids]
    await _idle(host)


@pytest.mark.asyncio
async def test_a_request_it_cannot_take_is_refused_before_it_reaches_the_loop(
    host: AsyncEngine | EngineProcess, tiny_checkpoint: Path
) -> None:
    too_long = make_request(
        tiny_checkpoint, "big", chat("hi"), [], SamplingParams(max_tokens=host.max_model_len)
    )
    with pytest.raises(ValueError, match="exceeds the context length"):
        await anext(host.generate(too_long))
    assert host.num_requests == 0


class _ListHost:
    """The loop's Host over lists: what the test sends, what the loop publishes."""

    def __init__(self, engine: object, batches: list[list[object]]) -> None:
        self.engine = engine
        self.batches = batches
        self.published: list[tuple[str, RequestOutput | Exception]] = []
        self.steps: list[StepStats] = []

    def receive(self, timeout: float | None) -> list[object] | None:
        if self.batches:
            return self.batches.pop(0)
        return [] if timeout is not None else None  # no work left: stop

    def apply(self, message: object) -> list[tuple[str, RequestOutput | Exception]]:
        return loop.apply(self.engine, message)  # type: ignore[arg-type]

    def publish(self, replies: list[tuple[str, RequestOutput | Exception]], step: object) -> None:
        self.published += replies
        if step is not None:
            self.steps.append(step[0])  # type: ignore[index]


def test_a_step_that_fails_fails_its_requests_and_the_loop_serves_on(
    tiny_checkpoint: Path,
) -> None:
    engine = make_engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=3, temperature=0)
    doomed = make_request(tiny_checkpoint, "doomed", chat("a"), [], params)
    later = make_request(tiny_checkpoint, "later", chat("b"), [], params)
    real_step = engine.step

    def fails_once() -> tuple[list[RequestOutput], StepStats]:
        engine.step = real_step  # type: ignore[method-assign]
        raise RuntimeError("a kernel broke")

    engine.step = fails_once  # type: ignore[method-assign]
    host = _ListHost(engine, [[loop.AddRequest(doomed)], [loop.AddRequest(later)]])
    loop.run(engine, host)
    (failure,) = [item for rid, item in host.published if rid == "doomed"]
    assert isinstance(failure, RuntimeError) and "a kernel broke" in str(failure)
    served = [item for rid, item in host.published if rid == "later"]
    assert served and all(isinstance(o, RequestOutput) for o in served)
    assert served[-1].finished  # type: ignore[union-attr]
    assert engine.load() == type(engine.load())()
