"""Qwen3-VL-MoE (deepstack) through `epd serve`, disaggregated (real Triton tower
with its deepstack output, encoder, broker, shared-memory planes, language
engine) and `--monolithic`, with the official openai client: greedy outputs
equal HF generate() for text, one and three images, streaming and not."""

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

from services.bench.images import encode_image, random_image
from services.model.demo import build_demo_checkpoint
from services.model.tokenizer import load_tokenizer
from tests.processes import served
from tests.reference import chat, hf_greedy

MODEL = "demo-qwen3-moe"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_vl_moe")
    return build_demo_checkpoint(folder, size="tiny", seed=0, arch="qwen3_vl_moe")


@pytest.fixture(scope="module", params=["disaggregated", "monolithic"])
def url(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    mode = ["--monolithic"] if request.param == "monolithic" else []
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


def test_a_video_is_refused_with_a_400_until_qwen3_video_lands(url: str) -> None:
    from services.bench.images import random_video

    video = "data:video/mp4;base64," + base64.b64encode(random_video()).decode()
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="videos are not served for qwen3_vl_moe"):
        client.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "video_url", "video_url": {"url": video}}],  # type: ignore[list-item,misc]
                }
            ],
        )
    ok = client.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "still there?"}]
    )
    assert ok.choices[0].finish_reason == "length"
