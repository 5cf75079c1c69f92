"""tools and tool_choice with the official openai client, through the real back
end (Triton, broker, encoder, language). The demo's weights are random, so only
what the grammar forces ("required", a named function) can be checked for
content: calls whose arguments are JSON the schema accepts."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError

from services.gateway.server import GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SUM = {
    "type": "object",
    "properties": {"terms": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["terms"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": SUM}},
]
SCHEMAS = {"get_weather": WEATHER, "add": SUM}
PNG = "data:image/png;base64," + base64.b64encode(encode_image(random_image(64, 48))).decode()


def client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)


def _messages(image: bool) -> list[Any]:
    content: list[Any] = [{"type": "text", "text": "What will the weather be in Paris?"}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": PNG}})
    return [{"role": "user", "content": content}]


def _kwargs(choice: Any, image: bool, parallel: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 160,
        "temperature": 0,
        "messages": _messages(image),
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }


def _valid(calls: Any, names: set[str]) -> list[tuple[str, Any]]:
    """Each call's (name, arguments), checked: a known function, arguments its schema accepts."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    ("choice", "image"),
    [("required", False), ("required", True), (NAMED, False), (NAMED, True)],
    ids=["required", "required-image", "named", "named-image"],
)
async def test_forced_calls_validate_and_stream_the_same(
    gateway: GatewayServer, choice: Any, image: bool
) -> None:
    kwargs = _kwargs(choice, image)
    reply = await client(gateway).chat.completions.create(**kwargs)
    (only,) = reply.choices
    assert only.finish_reason == "tool_calls", only
    assert only.message.content is None
    names = {"add"} if choice == NAMED else {"get_weather", "add"}
    calls = _valid(only.message.tool_calls, names)
    assert len(calls) == 1  # parallel_tool_calls=False
    # The same request streamed, accumulated by the client's own helpers.
    async with client(gateway).chat.completions.stream(**kwargs) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert _valid(streamed.message.tool_calls, names) == calls
    # the streamed fragments add up to the arguments as written, to the character
    whole = [c.function.arguments for c in only.message.tool_calls or []]
    assert [c.function.arguments for c in streamed.message.tool_calls or []] == whole


async def test_a_forced_call_cut_by_max_tokens_is_a_call_not_markup(gateway: GatewayServer) -> None:
    """The grammar writes the call's opening, then the arguments begin: cut there
    by max_tokens, the reply is the call with its arguments so far and
    finish_reason "length", never the template's markup, streamed or not."""
    free = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs = {
        **_kwargs({"type": "function", "function": {"name": "f"}}, False),
        "tools": free,
        "max_tokens": 48,  # the demo's opening takes ~30; its object runs on past 64
    }
    reply = await client(gateway).chat.completions.create(**kwargs)
    (only,) = reply.choices
    assert only.finish_reason == "length"
    assert only.message.content is None
    (call,) = only.message.tool_calls or []
    assert call.function.name == "f" and call.function.arguments.startswith("{")
    # Streamed (the client's stream helper refuses a "length" finish): no content,
    # and the call's deltas add up to the same call.
    names, fragments, reasons, content = [], [], [], ""
    async for chunk in await client(gateway).chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                fragments += [delta.function.arguments] if delta.function.arguments else []
    assert content == "" and reasons[-1] == "length"
    assert (names, "".join(fragments)) == (["f"], call.function.arguments)
    assert len(fragments) > 1  # the arguments stream as they are written, not at the end


async def test_a_forced_call_cut_anywhere_in_its_opening_is_still_the_call(
    gateway: GatewayServer,
) -> None:
    """Cut by max_tokens at every point of the call's opening: a named function's
    reply is its call from the first token on (its name is known); a "required"
    one's is the call once its name is written, and never the markup before."""
    free = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        named = []
        for max_tokens in range(1, 34):
            kwargs = {**_kwargs(choice, False), "tools": free, "max_tokens": max_tokens}
            (only,) = (await client(gateway).chat.completions.create(**kwargs)).choices
            assert only.message.content is None, (choice, max_tokens, only)
            calls = only.message.tool_calls or []
            assert [c.function.name for c in calls] in ([], ["f"])
            assert all(c.function.arguments[:1] in ("", "{") for c in calls)
            named.append(bool(calls))
        assert named[-1]  # the name is written well within 33 tokens
        if choice == "required":
            assert named == sorted(named)  # no call until its name is written, then the call
        else:
            assert all(named)


async def test_parallel_calls_and_a_conversation_that_sends_results_back(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    """parallel_tool_calls: one or more calls; then the results go back as tool
    messages beside the assistant's calls, and the model answers (tool_choice
    "none": text). The prompt is what the chat template makes of it all."""
    kwargs = _kwargs("required", True, parallel=True)
    reply = await client(gateway).chat.completions.create(**kwargs)
    (only,) = reply.choices
    assert only.finish_reason in ("tool_calls", "length")
    assert only.message.content is None  # calls, and nothing after them
    calls = only.message.tool_calls or []
    assert calls
    # cut by max_tokens, the last call is a call too, its arguments as far as they got
    _valid(calls[:-1] if only.finish_reason == "length" else calls, {"get_weather", "add"})
    history = [
        {"role": "user", "content": "What will the weather be in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    answer = await client(gateway).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=history, tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    tokenizer = load_tokenizer(tiny_checkpoint)
    template_history = [*history[:1], dict(history[1]), history[2]]
    template_history[1]["tool_calls"] = [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
        }
    ]
    text = tokenizer.apply_chat_template(
        template_history, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    assert "<tool_response>" in text and '"name": "get_weather"' in text


async def test_auto_leaves_text_that_calls_nothing_as_content(gateway: GatewayServer) -> None:
    """tool_choice "auto" (the default with tools): the output is parsed, and a
    random model's text, which holds no call, comes back as it is."""
    kwargs = {**_kwargs("auto", False), "max_tokens": 12}
    plain = await client(gateway).chat.completions.create(
        **{k: v for k, v in kwargs.items() if k not in ("tool_choice", "parallel_tool_calls")}
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert (plain.choices[0].message.content or "").strip()


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools.0.type", "function"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "x", "parameters": {"type": "nonsense"}},
                    }
                ]
            },
            "tools.0.function.parameters",
            "grammar compiler refuses",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "'get_weather' is defined twice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "no function 'nope'",
        ),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"response_format": {"type": "json_object"}, "tool_choice": "required"},
            "response_format",
            "cannot both constrain",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
            "",
        ),
    ],
    ids=[
        "not-a-function",
        "bad-schema",
        "duplicate",
        "unknown-named",
        "required-alone",
        "two-grammars",
        "bad-name",
    ],
)
async def test_bad_tools_are_a_400_that_names_them(
    gateway: GatewayServer, change: dict[str, Any], param: str, says: str
) -> None:
    kwargs = {**_kwargs("required", False), **change}
    with pytest.raises(BadRequestError) as info:
        await client(gateway).chat.completions.create(**kwargs)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert says in error["message"], error
    ok = await client(gateway).chat.completions.create(**_kwargs("required", False))
    assert ok.choices[0].message.tool_calls  # and the gateway serves on
