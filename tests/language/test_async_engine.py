"""AsyncEngine: the engine thread's API for asyncio callers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.language.engine.async_engine import AsyncEngine
from services.language.engine.request import SamplingParams
from tests.language.engine_fixtures import make_engine, make_request
from tests.reference import chat

pytestmark = pytest.mark.asyncio


async def test_requests_load_and_aborts_through_the_api(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(make_engine(tiny_checkpoint))
    engine.start()
    try:
        assert engine.max_model_len == 1024 and engine.num_kv_pages > 0
        long = make_request(
            tiny_checkpoint,
            "long",
            chat("go on"),
            [],
            SamplingParams(max_tokens=500, ignore_eos=True),
        )
        outputs = engine.generate(long)
        first = await anext(outputs)
        assert first.request_id == "long"
        assert engine.has_request("long") and engine.num_requests == 1
        assert engine.load.running == 1 and engine.load.kv_pages_used > 0

        twin = engine.generate(
            make_request(tiny_checkpoint, "long", chat("again"), [], SamplingParams(max_tokens=4))
        )
        with pytest.raises(ValueError, match="duplicate request id"):
            await anext(twin)
        assert engine.has_request("long")  # the first one goes on

        await outputs.aclose()  # the caller leaves: the request is aborted
        assert not engine.has_request("long") and engine.num_requests == 0
        for _ in range(100):
            if engine.load.kv_pages_used == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.load == type(engine.load)()  # nothing running, waiting or held
    finally:
        await engine.stop()
