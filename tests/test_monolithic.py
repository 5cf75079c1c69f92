"""`epd serve --monolithic`, the baseline: same API, same answers, one process."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from tests.processes import served
from tests.reference import chat, hf_greedy, hf_greedy_prompt

MODEL = "demo-tiny"


@pytest.fixture(scope="module")
def monolithic(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served(tiny_checkpoint, MODEL, tmp_path_factory.mktemp("logs"), "--monolithic") as url:
        yield url


@pytest.mark.parametrize("n", [1, 3])
def test_image_request_equals_hf_generate(monolithic: str, tiny_checkpoint: Path, n: int) -> None:
    """n=3: the vision tower encodes once, every choice equals HF."""
    image = random_image(200, 140, seed=31)
    data = encode_image(image)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    client = OpenAI(base_url=monolithic + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        n=n,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    expected = hf_greedy(tiny_checkpoint, chat("What is it?", 1), [decoded], 16)
    text = load_tokenizer(tiny_checkpoint).decode(expected, skip_special_tokens=True)
    assert [c.message.content for c in reply.choices] == [text] * n
    assert reply.usage is not None and reply.usage.completion_tokens == n * len(expected)


def test_seeded_choices_are_reproducible(monolithic: str) -> None:
    client = OpenAI(base_url=monolithic + "/v1", api_key="none", max_retries=0)

    def sampled(seed: int, n: int) -> list[str]:
        reply = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, seed=seed, n=n
        )
        return [c.text for c in reply.choices]

    three = sampled(9, 3)
    assert three == sampled(9, 3) and len(set(three)) == 3
    assert [sampled(9 + i, 1)[0] for i in range(3)] == three


def test_completions_and_penalties_equal_hf_generate(
    monolithic: str, tiny_checkpoint: Path
) -> None:
    """/v1/completions and the logits processors run in the monolithic engine too."""
    client = OpenAI(base_url=monolithic + "/v1", api_key="none", max_retries=0)
    prompt = [5, 17, 42, 99, 7]
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        logprobs=0,
        extra_body={"repetition_penalty": 1.5},
    )
    tokenizer = load_tokenizer(tiny_checkpoint)
    expected = hf_greedy_prompt(tiny_checkpoint, prompt, 10, repetition_penalty=1.5)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]


def test_structured_output(monolithic: str) -> None:
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    client = OpenAI(base_url=monolithic + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        temperature=0,
        messages=[{"role": "user", "content": "A colour?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content or "") in schema["enum"]


def test_a_forced_tool_call(monolithic: str) -> None:
    """tool_choice naming a function: its call, with arguments its schema takes."""
    parameters = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    client = OpenAI(base_url=monolithic + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=80,
        temperature=0,
        messages=[{"role": "user", "content": "Paint it."}],
        tools=[{"type": "function", "function": {"name": "paint", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "paint"}},
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "paint"
    assert json.loads(call.function.arguments)["colour"] in ("red", "green")


def test_bad_image_is_a_400(monolithic: str) -> None:
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode()
    reply = httpx.post(
        monolithic + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
        },
        timeout=60,
    )
    assert reply.status_code == 400
    assert "image 0" in reply.json()["error"]["message"]


def test_epd_bench_against_the_monolithic_server(monolithic: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher.cli",
            "bench",
            "--base-url",
            monolithic + "/v1",
            "--num-prompts",
            "4",
            "--image-ratio",
            "0.5",
            "--image-size",
            "96x96",
            "--output-len",
            "3",
            "--input-len",
            "8",
            "--result-json",
            str(tmp_path / "bench.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (4, 0, 12)
    assert summary["by_kind"]["image"]["completed"] == 2
