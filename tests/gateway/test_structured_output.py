"""response_format through the real back end: guided requests, streamed and
not, batched with a free one whose output stays equal to HF generate()."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI, BadRequestError

from services.gateway.server import GatewayServer
from services.model.tokenizer import load_tokenizer
from tests.language.test_grammar import SCHEMAS
from tests.reference import chat, hf_greedy
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")


def client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)


def _format(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


async def _guided(gateway: GatewayServer, name: str, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one guided request."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 200,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Give me {name} JSON."}],
        "response_format": _format(name),
    }
    if not stream:
        reply = await client(gateway).chat.completions.create(**kwargs)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    chunks = [c async for c in await client(gateway).chat.completions.create(stream=True, **kwargs)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish or ""


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_guided_requests_beside_a_free_one(
    gateway: GatewayServer, tiny_checkpoint: Path, stream: bool
) -> None:
    text = "Say something nice."
    expected = hf_greedy(tiny_checkpoint, chat(text), (), 16)
    free = client(gateway).chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, messages=[{"role": "user", "content": text}]
    )
    results = await asyncio.gather(free, *(_guided(gateway, n, stream) for n in SCHEMAS))
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert results[0].choices[0].message.content == tokenizer.decode(
        expected, skip_special_tokens=True
    )
    complete = 0
    for name, (out, finish) in zip(SCHEMAS, results[1:], strict=True):
        if finish == "length":  # the budget ran out first: a prefix of valid JSON
            continue
        assert finish == "stop", (name, finish, out)
        jsonschema.validate(json.loads(out), SCHEMAS[name])
        complete += 1
    assert complete >= 3  # (all 4 on the tiny demo model, greedy)


async def test_json_object_mode(gateway: GatewayServer) -> None:
    reply = await client(gateway).chat.completions.create(
        model=MODEL,
        max_tokens=200,
        temperature=0,
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
    )
    choice = reply.choices[0]
    assert choice.message.content is not None and choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content, strict=False), dict)


async def test_a_schema_that_cannot_be_used_is_a_400(gateway: GatewayServer) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(BadRequestError, match="unusable JSON schema"):
        await client(gateway).chat.completions.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            response_format=bad,  # type: ignore[arg-type]
        )


# Random schemas: strings bounded (xgrammar's own rule for those let raw control
# characters in) and not, enums, numbers, nested objects and arrays.
_LEAF = st.one_of(
    st.builds(
        lambda low, high: {"type": "string", "minLength": low, "maxLength": low + high},
        st.integers(0, 3),
        st.integers(0, 12),
    ),
    st.just({"type": "string"}),
    st.lists(
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=4),
        min_size=1,
        max_size=3,
        unique=True,
    ).map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}]),
)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


SCHEMA = st.recursive(
    _LEAF,
    lambda inner: (
        st.dictionaries(
            st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, min_size=1, max_size=3
        ).map(_object)
        | st.builds(
            lambda items, most: {"type": "array", "items": items, "maxItems": most},
            inner,
            st.integers(1, 3),
        )
    ),
    max_leaves=5,
).map(lambda schema: schema if schema.get("type") == "object" else _object({"value": schema}))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMA, seed=st.integers(0, 2**16))
async def test_any_schema_gives_json_a_strict_parser_takes(
    gateway: GatewayServer, schema: dict[str, Any], seed: int
) -> None:
    """At temperature 1 (a random model writes anything the grammar lets
    through), each output, whole and streamed, under response_format and as a
    forced tool call's arguments, parses with json.loads (strict: no raw
    control character in a string) and validates against its schema."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 160,
        "temperature": 1,
        "seed": seed,
        "messages": [{"role": "user", "content": "JSON, please."}],
    }
    formatted = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    forced = {"type": "function", "function": {"name": "f"}}
    openai = client(gateway)
    whole = await openai.chat.completions.create(response_format=formatted, **kwargs)
    chunks = openai.chat.completions.create(response_format=formatted, stream=True, **kwargs)
    streamed = "".join([c.choices[0].delta.content or "" async for c in await chunks if c.choices])
    called = await openai.chat.completions.create(tools=[tool], tool_choice=forced, **kwargs)
    outputs = [
        (whole.choices[0].message.content or "", whole.choices[0].finish_reason),
        (streamed, whole.choices[0].finish_reason),  # the same seed: the same output
        *(
            (c.function.arguments, called.choices[0].finish_reason)
            for c in called.choices[0].message.tool_calls or []
        ),
    ]
    assert streamed == outputs[0][0]
    for text, finish in outputs:
        if finish == "length":  # cut short: a prefix of JSON
            continue
        jsonschema.validate(json.loads(text), schema)
