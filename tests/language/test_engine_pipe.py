"""The pipe between a language instance and its engine process on uvloop, the
loop `epd language` runs on."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import uvloop

from services.language.engine.config import EngineConfig
from services.language.engine.process import EngineProcess
from services.language.engine.request import SamplingParams, new_request
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.wire.messages import MediaGrid
from tests.reference import chat


def test_a_request_larger_than_the_pipes_buffer_crosses_on_uvloop(tiny_checkpoint: Path) -> None:
    """uvloop's reader made the pipe's socket non-blocking: an image request's
    embeddings (here 1024 tokens, 512 KiB, past the socket's ~208 KiB buffer)
    failed half-written with BlockingIOError and the child read garbage. It now
    crosses whole and is served."""
    spec, tokenizer = load_spec(tiny_checkpoint), load_tokenizer(tiny_checkpoint)
    grid = MediaGrid(1, 64, 64)
    tokens = grid.num_tokens(spec.vision.spatial_merge_size)
    prompt = build_prompt(tokenizer, spec, chat("Describe it.", 1), [grid])
    embeds = torch.randn(tokens, spec.text.hidden_size)
    assert embeds.numel() * embeds.element_size() > 2 * 208 * 1024  # past the buffer
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    request = new_request("big", prompt.token_ids, sampling, spec, [grid], embeds)

    async def serve() -> list[int]:
        engine = EngineProcess(tiny_checkpoint, EngineConfig(max_model_len=2048), spec, tokenizer)
        engine.start()
        try:
            assert engine._conn is not None and os.get_blocking(engine._conn.fileno())
            return [t async for output in engine.generate(request) for t in output.token_ids]
        finally:
            await engine.stop()

    assert len(uvloop.run(serve())) == 2
