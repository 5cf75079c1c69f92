"""The gateway's request log: one line per request at its end, with what an
operator needs and none of what the request said."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from openai import AsyncOpenAI, BadRequestError, InternalServerError

from services.gateway.backend import GenerateCall, Responses
from services.gateway.server import GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from services.runtime.logs import JsonFormatter
from tests.stack import MODEL

SECRET = "the prompt is nobody's business"


def _client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sesame", max_retries=0
    )


def _lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "epd.requests" and getattr(r, "fields", {}).get("request_id") == request_id
    ]


async def test_a_served_request_is_one_line_with_its_fields(
    gateway: GatewayServer, caplog: pytest.LogCaptureFixture
) -> None:
    image = base64.b64encode(encode_image(random_image(64, 48, seed=3))).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": SECRET},
    ]
    with caplog.at_level(logging.INFO, logger="epd.requests"):
        reply = await _client(gateway).chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        )
    (line,) = _lines(caplog, reply.id)
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["status"] == 200 and fields["model"] == MODEL
    assert fields["media"] == 1
    assert reply.usage is not None
    assert fields["prompt_tokens"] == reply.usage.prompt_tokens
    assert fields["completion_tokens"] == reply.usage.completion_tokens
    assert 0 < fields["ttft_ms"] <= fields["total_ms"]
    assert fields["language"].startswith("language-")
    assert fields["encoder"].startswith("encoder-")
    assert fields["error"] == "" and fields["component"] == ""
    text = line.getMessage()
    assert text.startswith(f"request {reply.id} ") and "status=200" in text
    assert SECRET not in text and image[:32] not in text
    parsed = json.loads(JsonFormatter().format(line))  # what --log-format json writes
    assert parsed["request_id"] == reply.id and parsed["status"] == 200
    assert parsed["message"] == text


async def test_a_failed_request_names_its_error_and_the_component(
    gateway: GatewayServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Over the context length: the language instance refuses it (a 400)."""
    with caplog.at_level(logging.INFO, logger="epd.requests"), pytest.raises(BadRequestError):
        await _client(gateway).chat.completions.create(
            model=MODEL, max_tokens=100_000, messages=[{"role": "user", "content": SECRET}]
        )
    (line,) = [r for r in caplog.records if r.name == "epd.requests"]
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["status"] == 400
    assert fields["request_id"].startswith("chatcmpl-")
    assert "context length" in fields["error"]
    assert fields["component"].startswith("language instance language-")
    assert SECRET not in line.getMessage()
    parsed = json.loads(JsonFormatter().format(line))
    assert parsed["status"] == 400 and parsed["component"] == fields["component"]


async def test_a_failure_nobody_foresaw_is_a_json_500_and_logged(
    gateway: GatewayServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug (here a backend that raises what it never should) still answers
    JSON that says what failed, not Starlette's plain-text 500."""

    def broken(call: GenerateCall) -> Responses:
        raise RuntimeError("a bug in the backend")

    monkeypatch.setattr(gateway.gateway.backend, "generate", broken)
    logged = caplog.at_level(logging.INFO, logger="epd.requests")
    with logged, pytest.raises(InternalServerError) as failed:
        await _client(gateway).chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": SECRET}]
        )
    assert failed.value.status_code == 500
    body = failed.value.body
    assert isinstance(body, dict)
    assert body["message"] == "the gateway failed: RuntimeError: a bug in the backend"
    (line,) = [r for r in caplog.records if r.name == "epd.requests"]
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["status"] == 500 and fields["component"] == "gateway"
    assert "a bug in the backend" in fields["error"]
