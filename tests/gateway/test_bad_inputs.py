"""Every bad input gets a clear 4xx in OpenAI's format, naming the parameter,
streaming or not (the status comes before any byte of the stream); afterwards
a good request is served and nothing is left in flight."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from services.gateway.server import GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from tests.bad_images import png_header_only
from tests.gateway.conftest import MAX_BODY_BYTES
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEY = {"Authorization": "Bearer sesame"}
HI = [{"role": "user", "content": "hi"}]
GOOD_IMAGE = (
    "data:image/png;base64," + base64.b64encode(encode_image(random_image(64, 64))).decode()
)


def _image(url: str, **extra: Any) -> list[dict[str, Any]]:
    part = {"type": "image_url", "image_url": {"url": url, **extra}}
    return [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _with(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, **fields}


# (name, body: a dict or raw bytes, status, the error's param (or None), a piece of its message)
CASES: list[tuple[str, Any, int, str | None, str]] = [
    # the body itself
    ("malformed JSON", b"{'model': nope", 400, None, "not valid JSON"),
    ("not an object", b"[1, 2, 3]", 400, None, "must be a JSON object"),
    ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', 400, None, "not valid JSON"),
    ("over the body limit", b" " * (MAX_BODY_BYTES + 1), 413, None, "over the limit"),
    # the model
    ("no model", {"messages": HI}, 400, "model", "Field required"),
    ("empty model", _with(model=""), 400, "model", "at least 1 character"),
    ("model not a string", _with(model=5), 400, "model", "valid string"),
    ("unknown model", _with(model="gpt-9"), 404, "model", "does not exist"),
    ("lone surrogate in model", _with(model="demo\ud800"), 400, "model", "unicode string"),
    # messages
    ("no messages", {"model": MODEL}, 400, "messages", "Field required"),
    ("empty messages", _with(messages=[]), 400, "messages", "at least 1 item"),
    ("messages not a list", _with(messages="hi"), 400, "messages", "valid list"),
    ("unknown role", _with(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role", "Input should be"),
    ("content a number", _with(messages=[{"role": "user", "content": 7}]), 400, "messages.0.content", ""),
    ("unknown part type", _with(messages=[{"role": "user", "content": [{"type": "audio"}]}]), 400, "messages.0.content.0", "tag 'audio'"),
    ("text part without text", _with(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages.0.content.0.text", "Field required"),
    ("lone surrogate in text", _with(messages=[{"role": "user", "content": "hi \ud800"}]), 400, "messages.0.content", "not valid Unicode"),
    ("tool calls in a user's message", _with(messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages.0", "an assistant message's"),
    # sampling and lengths
    ("max_tokens 0", _with(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("max_tokens negative", _with(max_tokens=-5), 400, "max_tokens", "greater than or equal to 1"),
    ("max_tokens over uint32", _with(max_tokens=2**32), 400, "max_tokens", "less than or equal to 4294967295"),
    ("max_tokens a string", _with(max_tokens="5"), 400, "max_tokens", "valid integer"),
    ("max_completion_tokens fractional", _with(max_completion_tokens=1.5), 400, "max_completion_tokens", "valid integer"),
    ("max_tokens over the context", _with(max_tokens=100_000), 400, None, "exceeds the context length"),
    ("temperature 3", _with(temperature=3), 400, "temperature", "less than or equal to 2"),
    ("temperature negative", _with(temperature=-0.1), 400, "temperature", "greater than or equal to 0"),
    ("temperature a string", _with(temperature="hot"), 400, "temperature", "valid number"),
    ("top_p 0", _with(top_p=0), 400, "top_p", "greater than 0"),
    ("top_p 1.5", _with(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("top_k -2", _with(top_k=-2), 400, "top_k", "greater than or equal to -1"),
    ("seed negative", _with(seed=-1), 400, "seed", "greater than or equal to 0"),
    ("seed over uint64", _with(seed=2**64), 400, "seed", "less than or equal to"),
    ("five stop strings", _with(stop=list("abcde")), 400, "stop", "at most 4"),
    ("an empty stop string", _with(stop=[""]), 400, "stop", "must not be empty"),
    ("stop a number", _with(stop=123), 400, "stop", ""),
    ("stream not a boolean", _with(stream="yes"), 400, "stream", "valid boolean"),
    ("n 0", _with(n=0), 400, "n", "greater than or equal to 1"),
    ("n 129", _with(n=129), 400, "n", "less than or equal to 128"),
    ("n beyond the batch's sequences", _with(n=100), 400, None, "n (100) exceeds the 64 sequences"),
    ("top_logprobs without logprobs", _with(top_logprobs=2), 400, "top_logprobs", "requires logprobs"),
    ("top_logprobs 21", _with(logprobs=True, top_logprobs=21), 400, "top_logprobs", "less than or equal to 20"),
    ("logprobs a string", _with(logprobs="true"), 400, "logprobs", "valid boolean"),
    ("presence penalty out of range", _with(presence_penalty=-2.5), 400, "presence_penalty", "greater than or equal to -2"),
    ("repetition penalty 0", _with(repetition_penalty=0), 400, "repetition_penalty", "greater than 0"),
    ("min_tokens over max_tokens", _with(min_tokens=9, max_tokens=8), 400, "min_tokens", "must not exceed max_tokens (8)"),
    ("a logit_bias key that is no token id", _with(logit_bias={"five": 10}), 400, "logit_bias.five", "valid integer"),
    ("a logit_bias over 100", _with(logit_bias={"5": 101}), 400, "logit_bias.5", "less than or equal to 100"),
    ("a logit_bias token out of the vocabulary", _with(logit_bias={"999999": 1}), 400, None, "must be in [0, "),
    ("a stop token out of the vocabulary", _with(stop_token_ids=[999999]), 400, None, "must be in [0, "),
    ("frequency penalty out of range", _with(frequency_penalty=3), 400, "frequency_penalty", "less than or equal to 2"),
    # parameters this server does not implement
    ("an unknown response_format", _with(response_format={"type": "yaml"}), 400, "response_format", "does not match any of the expected tags"),
    ("a json_schema without its schema name", _with(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400, "response_format.json_schema.name", "Field required"),
    ("an unusable JSON schema", _with(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400, None, "unusable JSON schema"),
    ("functions (tools' old form)", _with(functions=[{"name": "f"}]), 400, "functions", "not supported"),
    ("a tool_choice that is none of the choices", _with(tool_choice="always"), 400, "tool_choice", "Input should be"),
    ("a tool message without its call id", _with(messages=[{"role": "tool", "content": "42"}]), 400, "messages.0", "tool_call_id"),
    ("an unknown parameter", _with(frobnicate=True), 400, "frobnicate", "unknown parameter"),
    # images
    ("data URL not base64", _with(messages=_image("data:image/png,abc")), 400, "messages", "must be base64"),
    ("broken base64", _with(messages=_image("data:image/png;base64,%%%")), 400, "messages", "invalid base64"),
    ("not an image", _with(messages=_image(_b64(b"not a picture"))), 400, "messages", "image 0: not a valid image"),
    ("too many pixels", _with(messages=_image(_b64(png_header_only(8000, 8000)))), 400, "messages", "exceeds the limit of 16777216 pixels"),
    ("too many images", _with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": GOOD_IMAGE}}] * 17}]), 400, "messages", "too many images: 17"),
    ("private address", _with(messages=_image("http://127.0.0.1:8000/x.png")), 400, "messages", "non-public address"),
    ("port out of range", _with(messages=_image("http://example.com:99999/x.png")), 400, "messages", "invalid image URL"),
    ("a 64-character DNS label", _with(messages=_image(f"http://{'a' * 64}.example.com/x.png")), 400, "messages", "invalid host name"),
    ("an ftp URL", _with(messages=_image("ftp://example.com/x.png")), 400, "messages", "data:, http: or https:"),
    ("unknown detail", _with(messages=_image(GOOD_IMAGE, detail="ultra")), 400, "messages.0.content.0.image_url.detail", "Input should be"),
    # what only the language instance knows, still before the first byte
    ("prompt over the context length", _with(messages=[{"role": "user", "content": "word " * 1200}]), 400, None, "context length of 1024 tokens"),
]  # fmt: skip
STREAMABLE = [case for case in CASES if isinstance(case[1], dict)]


async def _post(gateway: GatewayServer, body: Any, headers: dict[str, str] = KEY) -> httpx.Response:
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        url = gateway.url + "/v1/chat/completions"
        # ASCII JSON: a lone surrogate travels as the \\ud800 escape a client would send
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await http.post(url, content=raw, headers={"Content-Type": "application/json"})


def _check(reply: httpx.Response, status: int, param: str | None, message: str) -> None:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert message in error["message"], error
    assert error["type"] and error["param"] == param, error


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "message"), CASES, ids=[c[0] for c in CASES]
)
async def test_bad_input(
    gateway: GatewayServer, name: str, body: Any, status: int, param: str | None, message: str
) -> None:
    _check(await _post(gateway, body), status, param, message)


@pytest.mark.parametrize(
    ("name", "body", "status", "param", "message"), STREAMABLE, ids=[c[0] for c in STREAMABLE]
)
async def test_bad_input_streaming(
    gateway: GatewayServer, name: str, body: Any, status: int, param: str | None, message: str
) -> None:
    streaming = {**body, "stream": True}
    if name in ("stream not a boolean",):
        streaming = body
    _check(await _post(gateway, streaming), status, param, message)


async def test_stream_options_without_stream(gateway: GatewayServer) -> None:
    reply = await _post(gateway, _with(stream_options={"include_usage": True}))
    _check(reply, 400, "stream_options", "stream_options is only allowed when stream is true")


async def test_no_api_key(gateway: GatewayServer) -> None:
    _check(await _post(gateway, _with(), headers={}), 401, None, "API key")


async def test_after_the_table_a_good_request_and_nothing_in_flight(
    gateway: GatewayServer,
) -> None:
    reply = await _post(gateway, _with(max_tokens=3, messages=_image(GOOD_IMAGE)))
    assert reply.status_code == 200, reply.text
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(gateway.url + "/metrics")).text
    assert "epd_gateway_in_flight 0.0" in metrics
