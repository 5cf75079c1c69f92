"""Videos through `epd serve`, disaggregated (gateway header checks, encoder
decoding and sampling, real Triton tower on the temporal patches, shared-memory
transfer, M-RoPE time positions in the engine) and `--monolithic`, with the
official openai client: greedy outputs equal HF generate() for one video, a
video and an image, and two videos; bad videos get a 400 that names the limit,
and the server goes on serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from PIL import Image

from services.loadgen.synthetic import encode_image, random_image, random_video
from services.model.demo import build_demo_checkpoint
from services.model.tokenizer import load_tokenizer
from services.model.video import VideoRule, load_video
from tests.processes import served
from tests.reference import HfVideo, hf_greedy_videos

MODEL = "demo-video"
CLIPS = [
    random_video(num_frames=30, width=64, height=48, fps=10),
    random_video(num_frames=24, width=90, height=60, fps=30, seed=1),
]
IMAGE = encode_image(random_image(120, 90, seed=5))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), size="tiny", seed=0)


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


def _video_part(data: bytes) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def _image_part(data: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


# the vision items in prompt order: a clip index, or "image"
CASES = {"one-video": [0], "image-and-video": ["image", 1], "two-videos": [1, 0]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_equals_hf_generate(url: str, checkpoint: Path, case: str, stream: bool) -> None:
    items = CASES[case]
    text = "What happens here?"
    rule = VideoRule.from_checkpoint(checkpoint)
    videos = []
    for item in items:
        if item != "image":
            pixels, grid = load_video(CLIPS[int(item)], rule)
            videos.append(HfVideo.of(pixels, grid))
    images = [Image.open(io.BytesIO(IMAGE)).convert("RGB") for i in items if i == "image"]
    parts = [{"type": "image" if i == "image" else "video"} for i in items]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    expected = hf_greedy_videos(checkpoint, messages, images, videos, 16)
    # the whole decode: an output that ends inside a character ends with U+FFFD
    expected_text = load_tokenizer(checkpoint).decode(expected, skip_special_tokens=True)

    content = [_image_part(IMAGE) if i == "image" else _video_part(CLIPS[int(i)]) for i in items]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
    }
    client = _client(url)
    if stream:
        chunks = client.chat.completions.create(stream=True, **kwargs)
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        got = client.chat.completions.create(**kwargs).choices[0].message.content
    assert got == expected_text


BAD = {
    "not a video": (b"\x00\x01 certainly not a container" * 50, "video 0: cannot read the video"),
    "empty": (b"", "video 0: empty video data"),
    "one frame": (random_video(num_frames=1), "video 0: the video has 1 frames; at least 2 are"),
    "too long": (
        random_video(num_frames=602, width=16, height=16, fps=1),
        "video 0: 602.0 s exceeds the limit of 600 seconds",
    ),
    "too many pixels": (
        random_video(num_frames=2, width=2000, height=1088, fps=2),
        "video 0: 2000x1088 = 2176000 pixels a frame exceeds the limit of 2073600 pixels",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_videos_are_400s_and_serving_goes_on(url: str, name: str) -> None:
    data, message = BAD[name]
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [_video_part(data)]}],  # type: ignore[list-item]
        )
    assert message in str(caught.value)
    ok = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "still there?"}],
        extra_body={"ignore_eos": True},  # sampled: EOS could come first (seen once in CI)
    )
    assert ok.choices[0].finish_reason == "length"
