"""Qwen3-VL and Qwen3-VL-MoE in the engine against Hugging Face generate(),
token for token: QK-norm, interleaved M-RoPE, deepstack features added at the
image tokens after the first layers (also when a chunked prefill splits an
image's tokens across steps, and after a recompute preemption), and the MoE
block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.language.engine.request import SamplingParams
from services.model.spec import load_spec
from tests.language.engine_fixtures import (
    check_batch,
    make_engine,
    make_request,
    run_to_completion,
    tokens,
)
from tests.language.test_engine import MIXED, _case
from tests.reference import _generate, hf_greedy


@pytest.fixture(scope="module")
def expected(qwen3_checkpoint: Path) -> list[list[int]]:
    return [hf_greedy(qwen3_checkpoint, *_case(i)) for i in range(len(MIXED))]


def test_the_demo_checkpoints_are_the_family(qwen3_checkpoint: Path) -> None:
    spec = load_spec(qwen3_checkpoint)
    assert spec.text.qk_norm and spec.text.mrope_interleaved and not spec.text.qkv_bias
    assert spec.vision.deepstack_levels == 2 and spec.vision.patch_size == 16
    assert (spec.text.moe is not None) == (spec.model_type == "qwen3_vl_moe")


@pytest.mark.parametrize("index", [0, 1, 3], ids=["text", "one-image", "three-images"])
def test_single_requests_equal_hf(
    qwen3_checkpoint: Path, expected: list[list[int]], index: int
) -> None:
    engine = make_engine(qwen3_checkpoint)
    messages, images, n = _case(index)
    request = make_request(qwen3_checkpoint, "r", messages, images, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
    assert tokens(run_to_completion(engine, [request])["r"]) == expected[index]


@pytest.mark.parametrize(
    ("kv_bytes", "max_model_len", "budget", "preempts"),
    [
        (64 << 20, 1024, 2048, False),
        (64 << 20, 1024, 24, False),  # 24 tokens a step: image spans split across steps
        (24576 * 12, 192, 40, True),  # 12 pages of 16 tokens (3 layers): preemption
    ],
    ids=["batch", "chunked-prefill", "preemption"],
)
def test_batch_of_eight_mixed_requests_equals_hf(
    qwen3_checkpoint: Path,
    expected: list[list[int]],
    kv_bytes: int,
    max_model_len: int,
    budget: int,
    preempts: bool,
) -> None:
    engine = make_engine(qwen3_checkpoint, kv_bytes, max_model_len, max_num_batched_tokens=budget)
    requests = [
        make_request(qwen3_checkpoint, f"r{i}", m, im, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
        for i in range(len(MIXED))
        for m, im, n in [_case(i)]
    ]
    check_batch(engine, requests, expected, preempts)


@pytest.mark.parametrize("index", [1, 3], ids=["one-image", "three-images"])
def test_first_token_logprobs_match_hf(qwen3_checkpoint: Path, index: int) -> None:
    """Closer than the greedy token: the first step's top logprobs equal HF's to
    1e-4, so every deepstack level must land where HF adds it (a level left out
    moves them by far more, even where the greedy tokens survive it)."""
    messages, images, _ = _case(index)
    scores = _generate(qwen3_checkpoint, torch.float32, messages, images, 1).scores[0][0]
    reference = torch.log_softmax(scores.float(), dim=-1)
    engine = make_engine(qwen3_checkpoint, max_num_batched_tokens=24)
    sampling = SamplingParams(max_tokens=1, logprobs=True, top_logprobs=5)  # type: ignore[call-arg]
    request = make_request(qwen3_checkpoint, "lp", messages, images, sampling)  # type: ignore[arg-type]
    (logprob,) = [lp for o in run_to_completion(engine, [request])["lp"] for lp in o.logprobs]
    for top in logprob.top:
        assert top.logprob == pytest.approx(float(reference[top.token_id]), abs=1e-4)


class _EagerGraphs:
    """Stands in for DecodeGraphs on a CPU (CUDA graphs cannot run here): it
    replays a decode step as the captured graph would, eagerly and without
    deepstack features, which a real replay cannot take either."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.replays = 0

    def size_for(self, num_seqs: int) -> int:
        return num_seqs

    def replay(self, size: int, meta: Any, embeds: Any, cos: Any, sin: Any) -> torch.Tensor:
        self.replays += 1
        runner = self.runner
        runner.attention.plan(meta)
        return runner.model.lm_head(
            runner.model(embeds, cos, sin, runner.kv_cache.layers, runner.attention)
        )


def test_one_token_prefill_chunks_with_image_tokens_keep_their_deepstack(
    qwen3_checkpoint: Path, expected: list[list[int]]
) -> None:
    """A budget of one token a step: every prefill chunk is one token, as a
    decode is, image tokens included. Steps without deepstack features take the
    graph path (replays counted); those with them run eagerly, so the image's
    features are added and the output equals HF's."""
    engine = make_engine(qwen3_checkpoint, max_num_batched_tokens=1)
    graphs = _EagerGraphs(engine.runner)
    engine.runner.graphs = graphs  # type: ignore[assignment]
    messages, images, n = _case(1)
    request = make_request(qwen3_checkpoint, "r", messages, images, SamplingParams(max_tokens=n))  # type: ignore[arg-type]
    assert tokens(run_to_completion(engine, [request])["r"]) == expected[1]
    assert graphs.replays > 0
