"""Videos in the engine against Hugging Face generate(), token for token, in
Qwen2.5-VL (placeholders expanded per video, M-RoPE time positions from the
clip's sampled rate) and Qwen3-VL-MoE (a timestamp and a span per temporal
patch, deepstack features on every frame's tokens): embeddings of images and
videos in prompt order; one request at a time, and a batch whose prefill is
chunked across video spans or preempted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.language.engine.request import Request, SamplingParams, new_request
from services.loadgen.synthetic import random_video
from services.model.checkpoint import load_vision_tower
from services.model.demo import build_demo_checkpoint
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.model.video import VideoRule, load_video
from services.wire.messages import MediaGrid
from tests.language.engine_fixtures import check_batch, make_engine, run_to_completion, tokens
from tests.reference import HfVideo, hf_greedy_videos

CLIPS = {
    "a": random_video(num_frames=30, width=64, height=48, fps=10),  # 6 frames: 3 temporal patches
    # 0.8 s: min_frames (4) of 24 sampled at 5 fps, a temporal patch is 0.4 s
    "b": random_video(num_frames=24, width=90, height=60, fps=30, seed=1),
}
IMAGE = Image.new("RGB", (56, 84), (200, 40, 90))

# (text, vision items in prompt order: a clip name or "image", new tokens)
CASES: list[tuple[str, list[str], int]] = [
    ("What happens in this video?", ["a"], 12),
    ("Compare the picture with the clip.", ["image", "b"], 10),
    ("Which of the two videos is longer?", ["a", "b"], 14),
]


def _messages(text: str, items: list[str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image" if i == "image" else "video"} for i in items]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _pixels(checkpoint: Path, item: str) -> tuple[torch.Tensor, MediaGrid]:
    if item == "image":
        out = load_image_processor(checkpoint)(images=[IMAGE], return_tensors="pt")
        return out["pixel_values"], MediaGrid(*map(int, out["image_grid_thw"][0]))
    return load_video(CLIPS[item], VideoRule.from_checkpoint(checkpoint))


def _request(checkpoint: Path, request_id: str, case: int) -> Request:
    """As the language service builds it: the embeddings (and deepstack features)
    of every item in prompt order."""
    spec = load_spec(checkpoint)
    text, items, n = CASES[case]
    tower = load_vision_tower(checkpoint, spec)
    grids, embeds, deepstack = [], [], []
    for item in items:
        pixels, grid = _pixels(checkpoint, item)
        with torch.no_grad():
            out = tower(pixels, grid_thw=torch.tensor([[grid.t, grid.h, grid.w]]))
        embeds.append(out.pooler_output)
        if spec.has_deepstack:
            deepstack.append(torch.cat(out.deepstack_features, dim=-1))
        grids.append(grid)
    prompt = build_prompt(load_tokenizer(checkpoint), spec, _messages(text, items), grids)
    return new_request(
        request_id,
        prompt.token_ids,
        SamplingParams(max_tokens=n),
        spec,
        grids,
        torch.cat(embeds),
        deepstack=torch.cat(deepstack) if deepstack else None,
    )


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl_moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    return build_demo_checkpoint(folder, size="tiny", seed=0, arch=request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    out = []
    for text, items, n in CASES:
        videos = []
        for item in items:
            if item != "image":
                pixels, grid = _pixels(checkpoint, item)
                videos.append(HfVideo.of(pixels, grid))
        images = [IMAGE for i in items if i == "image"]
        out.append(hf_greedy_videos(checkpoint, _messages(text, items), images, videos, n))
    return out


def test_the_clips_have_time_steps_that_matter(tiny_checkpoint: Path) -> None:
    """Several temporal patches each, and time steps other than one per patch
    (2 and 0.8 positions): positions counted like an image's would differ."""
    rule = VideoRule.from_checkpoint(tiny_checkpoint)
    spec = load_spec(tiny_checkpoint)
    assert spec.vision.tokens_per_second == 2
    grids = [load_video(CLIPS[c], rule)[1] for c in ("a", "b")]
    assert all(g.t >= 2 for g in grids)
    steps = [spec.vision.tokens_per_second * g.second_per_grid_t for g in grids]
    assert steps == pytest.approx([2.0, 0.8])


def test_qwen3_clips_have_several_timestamped_frames(checkpoint: Path) -> None:
    rule = VideoRule.from_checkpoint(checkpoint)
    grids = [load_video(CLIPS[c], rule)[1] for c in ("a", "b")]
    stamps = [len(g.frame_seconds) for g in grids]
    assert stamps == ([3, 2] if load_spec(checkpoint).has_deepstack else [0, 0])


@pytest.mark.parametrize("case", range(len(CASES)), ids=["video", "image-video", "two-videos"])
def test_single_requests_equal_hf(checkpoint: Path, expected: list[list[int]], case: int) -> None:
    engine = make_engine(checkpoint)
    out = run_to_completion(engine, [_request(checkpoint, "r", case)])
    assert tokens(out["r"]) == expected[case]


@pytest.mark.parametrize(
    ("kv_tokens", "max_model_len", "budget", "preempts"),
    [(8192, 1024, 24, False), (192, 192, 32, True)],
    ids=["chunked-prefill", "preemption"],
)
def test_a_batch_split_across_video_spans_equals_hf(
    checkpoint: Path,
    expected: list[list[int]],
    kv_tokens: int,
    max_model_len: int,
    budget: int,
    preempts: bool,
) -> None:
    text = load_spec(checkpoint).text
    kv_bytes = kv_tokens * text.num_layers * 2 * text.num_kv_heads * text.head_dim * 4  # fp32
    # Without the prefix cache: the prompts' shared system prompt would spare the
    # pages whose lack this case is about (tests/language/test_prefix_cache.py).
    engine = make_engine(
        checkpoint, kv_bytes, max_model_len, max_num_batched_tokens=budget, prefix_caching=False
    )
    requests = [_request(checkpoint, f"r{i}", i) for i in range(len(CASES))]
    check_batch(engine, requests, expected, preempts)
