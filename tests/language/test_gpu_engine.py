"""The engine on a GPU against Hugging Face generate() (GPU only), on the
tiny-gpu demo (head_dim 128: FlashInfer's kernels take 64 and up): in float32
(torch attention: FlashInfer has no float32 kernels) token for token, and in
bfloat16 (FlashInfer attention, tensor-core decode where the model's head ratio
asks for it; decode steps from CUDA graphs and eagerly) under the bf16 contract
of test_bfloat16.py; the Qwen3-VL-MoE demo the same way under graphs, its
fused experts and one-token prefill chunks that carry image tokens included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.language.engine.request import SamplingParams
from services.layers.attention import FlashInferAttention, TorchAttention
from services.layers.moe import FlashInferExperts
from services.loadgen.synthetic import random_image
from services.model.demo import build_demo_checkpoint
from tests.language.engine_fixtures import (
    count_replays,
    make_engine,
    make_request,
    run_to_completion,
    tokens,
    top_tokens,
)
from tests.reference import TOP, assert_close_to_hf, chat, hf_greedy, hf_greedy_logprobs

pytestmark = pytest.mark.gpu

CASES = [("Tell me a long story about the sea", 0), ("Compare the two pictures.", 2)]


def _images(i: int, n: int) -> list:
    return [random_image(160 + 40 * j, 120, seed=10 * i + j) for j in range(n)]


def test_float32_on_cuda_equals_hf(gpu_checkpoint: Path) -> None:
    engine = make_engine(gpu_checkpoint, device="cuda")
    assert isinstance(engine.runner.attention, TorchAttention)
    for i, (prompt, n) in enumerate(CASES):
        messages, images = chat(prompt, n), _images(i, n)
        request = make_request(
            gpu_checkpoint, f"r{i}", messages, images, SamplingParams(max_tokens=16)
        )
        got = tokens(run_to_completion(engine, [request])[f"r{i}"])
        assert got == hf_greedy(gpu_checkpoint, messages, images, 16)


@pytest.mark.parametrize(
    "attention, graphs",
    [("flashinfer", True), ("flashinfer", False), ("torch", False)],
    ids=["flashinfer-cuda-graphs", "flashinfer-eager", "torch"],
)
def test_bfloat16_on_cuda_close_to_hf(gpu_checkpoint: Path, attention: str, graphs: bool) -> None:
    """Requests of different lengths in one batch: its decode steps shrink from 3
    sequences to 2, with FlashInfer replayed from the graphs of buckets 4 (one
    padding row) and 2. Torch's attention serves a GPU without FlashInfer."""
    engine = make_engine(
        gpu_checkpoint, dtype=torch.bfloat16, device="cuda", attention=attention, cuda_graphs=graphs
    )
    kind = FlashInferAttention if attention == "flashinfer" else TorchAttention
    assert isinstance(engine.runner.attention, kind)
    engine.warm_up()  # captures the graphs
    if graphs:
        replayed = count_replays(engine)
    else:
        assert engine.runner.graphs is None
        replayed = []
    cases = [(*case, 16) for case in CASES] + [("Count to three", 0, 5)]
    requests, expected = [], []
    for i, (prompt, n, max_tokens) in enumerate(cases):
        messages, images = chat(prompt, n), _images(i, n)
        expected.append(
            hf_greedy_logprobs(gpu_checkpoint, torch.bfloat16, messages, images, max_tokens)
        )
        sampling = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=TOP)
        requests.append(
            make_request(gpu_checkpoint, f"b{i}", messages, images, sampling, dtype=torch.bfloat16)
        )
    outputs = run_to_completion(engine, requests)
    for i, want in enumerate(expected):
        assert_close_to_hf(top_tokens(outputs[f"b{i}"]), want, f"request {i}")
    assert set(replayed) == ({4, 2} if graphs else set())


@pytest.fixture(scope="module")
def moe_gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("moe-gpu")
    return build_demo_checkpoint(folder, size="tiny-gpu", arch="qwen3_vl_moe")


@pytest.mark.parametrize("budget", [2048, 1], ids=["whole-prefill", "one-token-chunks"])
def test_qwen3_vl_moe_under_graphs_close_to_hf(moe_gpu_checkpoint: Path, budget: int) -> None:
    """FlashInfer attention and fused experts, decode steps from graphs. With a
    budget of one token a step every prefill chunk is one token, as a decode is:
    those without an image token replay a graph, those with one run eagerly and
    keep their deepstack features (a replay takes none), so the output stays
    within the bf16 contract of HF's."""
    folder = moe_gpu_checkpoint
    engine = make_engine(folder, dtype=torch.bfloat16, device="cuda", max_num_batched_tokens=budget)
    moe = [m for m in engine.runner.model.modules() if isinstance(m, FlashInferExperts)]
    assert moe, "the MoE experts should be FlashInfer's on CUDA in bf16"
    engine.warm_up()
    replayed = count_replays(engine)
    messages, images = chat("Describe this image.", 1), _images(0, 1)
    expected = hf_greedy_logprobs(folder, torch.bfloat16, messages, images, 12)
    sampling = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=TOP)
    request = make_request(folder, "m", messages, images, sampling, dtype=torch.bfloat16)
    outputs = run_to_completion(engine, [request])
    assert_close_to_hf(top_tokens(outputs["m"]), expected, f"budget {budget}")
    assert request.media_positions is not None
    if budget == 1:  # every one-token step replays but those of the image's tokens
        assert len(replayed) == request.num_prompt_tokens + 11 - len(request.media_positions)
    else:
        assert len(replayed) == 11
