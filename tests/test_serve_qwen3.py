"""Qwen3-VL-MoE (deepstack) through `epd serve`, disaggregated (real Triton tower
with its deepstack output, encoder, broker, shared-memory planes, language
engine) and `--monolithic`, with the official openai client: greedy outputs
equal HF generate() for text, one and three images, streaming and not, and for
videos (Qwen3-VL's timestamped frames), alone and beside an image."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from PIL import Image

from services.loadgen.synthetic import encode_image, random_image, random_video
from services.model.demo import build_demo_checkpoint
from services.model.tokenizer import load_tokenizer
from services.model.video import VideoRule, load_video, probe
from tests.processes import served
from tests.reference import HfVideo, chat, hf_greedy, hf_greedy_videos

MODEL = "demo-qwen3-moe"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_vl_moe")
    return build_demo_checkpoint(folder, size="tiny", seed=0, arch="qwen3_vl_moe")


MODES = {  # how `epd serve` runs: E + L, everything in one process, or E/P/D
    "disaggregated": (),
    "monolithic": ("--monolithic",),
    "epd": ("--prefill", "1", "--decode", "1"),
}


@pytest.fixture(scope="module", params=list(MODES))
def url(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    mode = MODES[request.param]
    with served(checkpoint, MODEL, tmp_path_factory.mktemp("logs"), *mode) as url:
        yield url


@pytest.mark.parametrize("num_images", [0, 1, 3])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_equals_hf_generate(
    url: str, checkpoint: Path, num_images: int, stream: bool
) -> None:
    images = [random_image(180 + 60 * i, 150 + 30 * i, seed=90 + i) for i in range(num_images)]
    data = [encode_image(i) for i in images]
    text = "Describe what you see." if num_images else "Say something nice."
    content: list[dict[str, Any]] = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()},
        }
        for d in data
    ]
    content.append({"type": "text", "text": text})
    decoded = [Image.open(io.BytesIO(d)).convert("RGB") for d in data]
    expected = hf_greedy(checkpoint, chat(text, num_images), decoded, 16)
    expected_text = load_tokenizer(checkpoint).decode(expected, skip_special_tokens=True)
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        got = client.chat.completions.create(**kwargs).choices[0].message.content
    assert got == expected_text


# the vision items in prompt order: a clip index, or "image"
VIDEO_CASES = {"one-video": [0], "image-and-video": ["image", 1], "two-videos": [1, 0]}


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_videos_greedy_equal_hf_generate(url: str, checkpoint: Path, case: str) -> None:
    """Timestamped frames (`<t seconds>` before each temporal patch's span), the
    video's deepstack planes over the transport: as HF generate() on the frames
    its processor samples."""
    items = VIDEO_CASES[case]
    clips = [
        random_video(num_frames=30, width=64, height=48, fps=10),
        random_video(num_frames=5, width=90, height=60, fps=2, seed=1),  # 3 patches, padded
    ]
    image = encode_image(random_image(120, 90, seed=5))
    rule = VideoRule.from_checkpoint(checkpoint)
    videos = []
    for item in items:
        if item != "image":
            pixels, grid = load_video(clips[int(item)], rule)
            assert grid.frame_seconds
            videos.append(HfVideo.of(pixels, grid))
    images = [Image.open(io.BytesIO(image)).convert("RGB") for i in items if i == "image"]
    text = "What happens here?"
    parts = [{"type": "image" if i == "image" else "video"} for i in items]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    expected = hf_greedy_videos(checkpoint, messages, images, videos, 16)
    expected_text = load_tokenizer(checkpoint).decode(expected, skip_special_tokens=True)

    def part(item: str | int) -> dict[str, Any]:
        if item == "image":
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            return {"type": "image_url", "image_url": {"url": url}}
        url = "data:video/mp4;base64," + base64.b64encode(clips[int(item)]).decode()
        return {"type": "video_url", "video_url": {"url": url}}

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        messages=[
            {"role": "user", "content": [*map(part, items), {"type": "text", "text": text}]}  # type: ignore[list-item,misc]
        ],
    )
    assert reply.choices[0].message.content == expected_text
    assert reply.usage is not None and reply.usage.prompt_tokens > sum(
        rule.num_tokens(probe(clips[int(i)])) for i in items if i != "image"
    )
