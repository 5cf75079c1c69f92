"""`epd serve --prefill 1 --decode 1` as a user runs it, over each KV transport
this machine runs (chosen by --language-transports): greedy chat completions
through the official openai client equal HF generate(), streamed and not, with
text, one image and two images; the instances' health shows their roles, and
every KV page is back afterwards."""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from PIL import Image

from services.bench.images import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from tests.processes import served
from tests.reference import chat, hf_greedy
from tests.test_serve import image_url

MODEL = "demo-tiny"
TRANSPORTS = ["shm", "nixl", "grpc"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def url(
    request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    flags = ("--prefill", "1", "--decode", "1", "--language-transports", request.param)
    with served(tiny_checkpoint, MODEL, tmp_path_factory.mktemp("logs"), *flags) as url:
        yield url


@pytest.mark.parametrize("num_images", [0, 1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_equals_hf_generate(
    url: str, tiny_checkpoint: Path, num_images: int, stream: bool
) -> None:
    images = [random_image(180 + 60 * i, 150 + 30 * i, seed=70 + i) for i in range(num_images)]
    text = "Describe what you see." if num_images else "Say something nice."
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": text})
    decoded = [Image.open(io.BytesIO(encode_image(i))).convert("RGB") for i in images]
    expected = hf_greedy(tiny_checkpoint, chat(text, num_images), decoded, 20)
    expected_text = load_tokenizer(tiny_checkpoint).decode(expected, skip_special_tokens=True)
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 20,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**kwargs)
        got, usage = reply.choices[0].message.content, reply.usage
    assert got == expected_text
    assert usage is not None and usage.completion_tokens == len(expected)


def test_health_shows_the_roles(url: str) -> None:
    health = json.load(urllib.request.urlopen(url + "/health", timeout=10))
    roles = {name: c["role"] for name, c in health["components"].items()}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "encoder-0": "encoder"}
    assert health["status"] == "ok"
