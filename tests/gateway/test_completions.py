"""POST /v1/completions through the real back end: raw prompts (text, token
ids, several), streaming and not, equal to HF generate() on the same tokens,
with the official openai client, and through `epd bench`."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from services.gateway.server import GatewayServer
from services.loadgen.runner import RunConfig, run
from services.loadgen.workload import Workload, build_requests
from services.model.tokenizer import load_tokenizer
from tests.reference import hf_greedy_prompt
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")

TEXT = "Once upon a time, in a house by the sea,"


def client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)


def expected_tokens(checkpoint: Path, token_ids: list[int], n: int) -> list[str]:
    """HF's greedy continuation, token by token as logprobs show them."""
    tokenizer = load_tokenizer(checkpoint)
    greedy = hf_greedy_prompt(checkpoint, token_ids, n)
    return [tokenizer.decode([t], skip_special_tokens=False) for t in greedy]


def expected_text(checkpoint: Path, token_ids: list[int], n: int) -> str:
    greedy = hf_greedy_prompt(checkpoint, token_ids, n)
    return str(load_tokenizer(checkpoint).decode(greedy, skip_special_tokens=True))


async def test_a_text_prompt_equals_hf_generate(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    ids = load_tokenizer(tiny_checkpoint)(TEXT, add_special_tokens=False)["input_ids"]
    reply = await client(gateway).completions.create(
        model=MODEL, prompt=TEXT, max_tokens=12, temperature=0, logprobs=2
    )
    (choice,) = reply.choices
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.logprobs.tokens == expected_tokens(tiny_checkpoint, ids, 12)
    assert choice.logprobs.top_logprobs is not None
    # Keyed by token text: two alternatives that decode alike are one entry.
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    # The text too, but for a last half character, which is held back.
    text = expected_text(tiny_checkpoint, ids, 12)
    assert text.startswith(choice.text) and len(text) - len(choice.text) <= 1
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)


async def test_token_id_prompts_each_get_their_choice(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    prompts = [[5, 17, 42, 99, 7], [300, 13, 8]]
    reply = await client(gateway).completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, logprobs=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, prompt in zip(reply.choices, prompts, strict=True):
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == expected_tokens(tiny_checkpoint, prompt, 6)
        assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.prompt_tokens == 8
    assert reply.usage.completion_tokens == 12


async def test_streaming_equals_the_whole_reply(gateway: GatewayServer) -> None:
    whole = await client(gateway).completions.create(
        model=MODEL, prompt=TEXT, max_tokens=10, temperature=0
    )
    stream = await client(gateway).completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


BAD = [
    ({"prompt": "x", "echo": True}, "echo", "echo is not supported"),
    ({"prompt": "x", "best_of": 2}, "best_of", "less than or equal to 1"),
    ({"prompt": []}, "prompt", ""),
    ({"prompt": ""}, "prompt", "at least 1"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt", "a streamed completion takes one prompt"),
    ({"prompt": [10**6]}, None, "prompt token ids must be in [0, "),
    ({"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({"prompt": "x", "messages": []}, "messages", "unknown parameter"),
    ({"prompt": "x", "max_tokens": 5000}, None, "exceeds the context length"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[str(b[0]) for b in BAD])
async def test_bad_completions_get_a_400_that_names_the_parameter(
    gateway: GatewayServer, fields: dict[str, Any], param: str | None, message: str
) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.post(
            gateway.url + "/v1/completions",
            json={"model": MODEL, **fields},
            headers={"Authorization": "Bearer sesame"},
        )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param, error


async def test_a_placeholder_token_without_an_image_is_refused(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    from services.model.spec import load_spec

    image_token = load_spec(tiny_checkpoint).image_token_id
    async with httpx.AsyncClient() as http:
        reply = await http.post(
            gateway.url + "/v1/completions",
            json={"model": MODEL, "prompt": [5, image_token, 6]},  # 12 in the tiny model
            headers={"Authorization": "Bearer sesame"},
        )
    assert reply.status_code == 400
    assert "no image placeholder tokens" in reply.json()["error"]["message"]


async def test_epd_bench_drives_completions(gateway: GatewayServer) -> None:
    workload = Workload(
        num_prompts=6, input_len=12, output_len=8, image_ratio=0, endpoint="completions"
    )
    requests = build_requests(workload, MODEL)
    assert all(r.path == "/completions" and "prompt" in r.body for r in requests)
    config = RunConfig(gateway.url + "/v1", api_key="sesame", warmup=0, progress=False)
    result = await run(config, requests)
    assert [r.ok for r in result.results] == [True] * 6, [r.error for r in result.results]
    assert all(r.output_tokens == 8 and r.ttft is not None for r in result.results)


async def test_epd_bench_reports_what_failed(gateway: GatewayServer) -> None:
    """A status other than 200 (a wrong key) and a server that is not there: each
    request fails with what happened, none raises."""
    workload = Workload(
        num_prompts=2, input_len=12, output_len=8, image_ratio=0, endpoint="completions"
    )
    requests = build_requests(workload, MODEL)
    config = RunConfig(gateway.url + "/v1", api_key="wrong", warmup=0, progress=False)
    refused = await run(config, requests)
    assert [r.ok for r in refused.results] == [False, False]
    assert all(r.error.startswith("HTTP 401: ") for r in refused.results), refused.results
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{unused.getsockname()[1]}/v1"
        config = RunConfig(nowhere, warmup=0, progress=False, timeout_s=5)
        gone = await run(config, requests)
    assert [r.ok for r in gone.results] == [False, False]
    assert all(r.error.startswith("ClientConnectorError") for r in gone.results), gone.results
