"""Videos in the engine against Hugging Face generate(), token for token
(Qwen2.5-VL): placeholders expanded per video, M-RoPE time positions from the
clip's sampled rate, embeddings of images and videos in prompt order; one
request at a time, and a batch whose prefill is chunked across video spans or
preempted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.bench.images import random_video
from services.language.engine.request import Request, SamplingParams, new_request
from services.model.checkpoint import load_vision_tower
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.model.video import VideoRule, load_video
from services.wire.messages import ImageGrid
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


def _pixels(checkpoint: Path, item: str) -> tuple[torch.Tensor, ImageGrid]:
    if item == "image":
        out = load_image_processor(checkpoint)(images=[IMAGE], return_tensors="pt")
        return out["pixel_values"], ImageGrid(*map(int, out["image_grid_thw"][0]))
    return load_video(CLIPS[item], VideoRule.from_checkpoint(checkpoint))


def _request(checkpoint: Path, request_id: str, case: int) -> Request:
    """As the language service builds it: the embeddings of every item in prompt order."""
    spec = load_spec(checkpoint)
    text, items, n = CASES[case]
    tower = load_vision_tower(checkpoint, spec)
    grids, embeds = [], []
    for item in items:
        pixels, grid = _pixels(checkpoint, item)
        with torch.no_grad():
            embeds.append(
                tower(pixels, grid_thw=torch.tensor([[grid.t, grid.h, grid.w]])).pooler_output
            )
        grids.append(grid)
    merge = spec.vision.spatial_merge_size
    prompt = build_prompt(
        load_tokenizer(checkpoint),
        spec,
        _messages(text, items),
        [g.num_tokens(merge) for g in grids],
    )
    return new_request(
        request_id,
        prompt.token_ids,
        SamplingParams(max_tokens=n),
        spec,
        grids,
        torch.cat(embeds),
    )


@pytest.fixture(scope="module")
def expected(tiny_checkpoint: Path) -> list[list[int]]:
    out = []
    for text, items, n in CASES:
        videos = []
        for item in items:
            if item != "image":
                pixels, grid = _pixels(tiny_checkpoint, item)
                videos.append(HfVideo(pixels, (grid.t, grid.h, grid.w), grid.second_per_grid_t))
        images = [IMAGE for i in items if i == "image"]
        out.append(hf_greedy_videos(tiny_checkpoint, _messages(text, items), images, videos, n))
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


@pytest.mark.parametrize("case", range(len(CASES)), ids=["video", "image-video", "two-videos"])
def test_single_requests_equal_hf(
    tiny_checkpoint: Path, expected: list[list[int]], case: int
) -> None:
    engine = make_engine(tiny_checkpoint)
    out = run_to_completion(engine, [_request(tiny_checkpoint, "r", case)])
    assert tokens(out["r"]) == expected[case]


@pytest.mark.parametrize(
    ("kv_bytes", "max_model_len", "budget", "preempts"),
    [(64 << 20, 1024, 24, False), (1024 * 192, 192, 32, True)],  # 192 cached tokens
    ids=["chunked-prefill", "preemption"],
)
def test_a_batch_split_across_video_spans_equals_hf(
    tiny_checkpoint: Path,
    expected: list[list[int]],
    kv_bytes: int,
    max_model_len: int,
    budget: int,
    preempts: bool,
) -> None:
    engine = make_engine(tiny_checkpoint, kv_bytes, max_model_len, max_num_batched_tokens=budget)
    requests = [_request(tiny_checkpoint, f"r{i}", i) for i in range(len(CASES))]
    check_batch(engine, requests, expected, preempts)
