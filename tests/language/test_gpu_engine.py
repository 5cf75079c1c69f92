"""The engine on a GPU against Hugging Face generate() (GPU only): in float32
(torch attention: FlashInfer has no float32 kernels) token for token, and in
bfloat16 (FlashInfer attention, tensor-core decode where the model's head ratio
asks for it; decode steps from CUDA graphs and eagerly) under the bf16 contract
of test_bfloat16.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.bench.images import random_image
from services.language.engine.attention import FlashInferAttention, TorchAttention
from services.language.engine.request import SamplingParams
from tests.language.engine_fixtures import make_engine, make_request, run_to_completion, tokens
from tests.reference import chat, hf_greedy, hf_greedy_logprobs

pytestmark = pytest.mark.gpu

CASES = [("Tell me a long story about the sea", 0), ("Compare the two pictures.", 2)]


def _images(i: int, n: int) -> list:
    return [random_image(160 + 40 * j, 120, seed=10 * i + j) for j in range(n)]


def test_float32_on_cuda_equals_hf(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, device="cuda")
    assert isinstance(engine.runner.attention, TorchAttention)
    for i, (prompt, n) in enumerate(CASES):
        messages, images = chat(prompt, n), _images(i, n)
        request = make_request(
            tiny_checkpoint, f"r{i}", messages, images, SamplingParams(max_tokens=16)
        )
        got = tokens(run_to_completion(engine, [request])[f"r{i}"])
        assert got == hf_greedy(tiny_checkpoint, messages, images, 16)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_bfloat16_on_cuda_with_flashinfer_close_to_hf(tiny_checkpoint: Path, graphs: bool) -> None:
    """Requests of different lengths in one batch: its decode steps shrink from 3
    sequences to 2, replayed from the graphs of buckets 4 (one padding row) and 2."""
    engine = make_engine(tiny_checkpoint, dtype=torch.bfloat16, device="cuda", cuda_graphs=graphs)
    assert isinstance(engine.runner.attention, FlashInferAttention)
    engine.warm_up()  # captures the graphs
    replayed: list[int] = []
    if graphs:
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        replay = engine.runner.graphs.replay

        def counting(size: int, *args: Any) -> torch.Tensor:
            replayed.append(size)
            return replay(size, *args)

        engine.runner.graphs.replay = counting  # type: ignore[method-assign]
    else:
        assert engine.runner.graphs is None
    cases = [(*case, 16) for case in CASES] + [("Count to three", 0, 5)]
    requests, expected = [], []
    for i, (prompt, n, max_tokens) in enumerate(cases):
        messages, images = chat(prompt, n), _images(i, n)
        expected.append(
            hf_greedy_logprobs(tiny_checkpoint, torch.bfloat16, messages, images, max_tokens, 5)
        )
        sampling = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=5)
        requests.append(
            make_request(tiny_checkpoint, f"b{i}", messages, images, sampling, dtype=torch.bfloat16)
        )
    outputs = run_to_completion(engine, requests)
    for i, want in enumerate(expected):
        got = [
            (lp.token_id, {t for t, _, _ in lp.top})
            for out in outputs[f"b{i}"]
            for lp in out.logprobs
        ]
        assert len(got) == len(want)
        for (ours, our_top), (theirs, their_top) in zip(got, want, strict=True):
            if ours != theirs:
                assert theirs in our_top and ours in their_top
                break
    assert set(replayed) == ({4, 2} if graphs else set())
