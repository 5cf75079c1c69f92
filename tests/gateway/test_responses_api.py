"""POST /v1/responses with the official openai client (`responses.create`,
`responses.stream`, `retrieve`, `delete`), through the real back end: the same
greedy text as the chat endpoint and HF's generate(), images, JSON schemas,
function tools and their outputs sent back, stored responses continued with
their KV from the prefix cache, and what is not supported answered 400."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from services.gateway.server import GatewayServer
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from tests.reference import chat, hf_greedy
from tests.stack import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "Describe the picture."
IMAGE = random_image(180, 130, seed=77)
URL = "data:image/png;base64," + base64.b64encode(encode_image(IMAGE)).decode()
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


def client(gateway: GatewayServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)


def _image_input() -> list[Any]:
    content = [{"type": "input_image", "image_url": URL}, {"type": "input_text", "text": PROMPT}]
    return [{"role": "user", "content": content}]


async def test_text_and_an_image_give_the_chat_endpoints_greedy_text_and_hfs(
    gateway: GatewayServer, tiny_checkpoint: Path
) -> None:
    openai = client(gateway)
    for given, messages, images in (
        (PROMPT, [{"role": "user", "content": PROMPT}], []),
        (
            _image_input(),
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": URL}},
                        {"type": "text", "text": PROMPT},
                    ],
                }
            ],
            [IMAGE],
        ),
    ):
        response = await openai.responses.create(
            model=MODEL, input=given, max_output_tokens=10, temperature=0, store=False
        )
        reply = await openai.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
        )
        expected = hf_greedy(tiny_checkpoint, chat(PROMPT, len(images)), images, 10)
        text = load_tokenizer(tiny_checkpoint).decode(expected, skip_special_tokens=True)
        assert response.output_text == reply.choices[0].message.content == text
        assert response.id.startswith("resp-") and response.object == "response"
        assert (response.status, response.incomplete_details) == (
            ("incomplete", response.incomplete_details)
            if len(expected) == 10
            else ("completed", None)
        )
        if response.status == "incomplete":
            assert response.incomplete_details is not None
            assert response.incomplete_details.reason == "max_output_tokens"
        (message,) = response.output
        assert message.type == "message" and message.role == "assistant"
        assert response.usage is not None and reply.usage is not None
        assert response.usage.input_tokens == reply.usage.prompt_tokens
        assert response.usage.output_tokens == len(expected)


async def test_a_json_schema_holds_the_output(gateway: GatewayServer) -> None:
    response = await client(gateway).responses.create(
        model=MODEL,
        input="Where is it sunny?",
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": WEATHER}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)


async def test_the_streamed_events_add_up_to_the_whole_response(gateway: GatewayServer) -> None:
    """The client's own accumulation of the events equals the non-streamed
    response, for text cut by max_output_tokens and for a forced call."""
    openai = client(gateway)
    for kwargs in (
        {"input": PROMPT, "max_output_tokens": 12},
        {"input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required"},
    ):
        whole = await openai.responses.create(model=MODEL, temperature=0, **kwargs)  # type: ignore[arg-type]
        kinds, final = [], None
        async with openai.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:  # type: ignore[arg-type]
            async for event in stream:
                kinds.append(event.type)
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
        assert final is not None
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == f"response.{whole.status}"
        assert final.status == whole.status
        strip = [(i.type, _content(i)) for i in final.output]
        assert strip == [(i.type, _content(i)) for i in whole.output]
        assert final.usage is not None and whole.usage is not None
        # (the second of the two takes its prompt from the prefix cache)
        counts = ("input_tokens", "output_tokens", "total_tokens")
        assert [getattr(final.usage, k) for k in counts] == [
            getattr(whole.usage, k) for k in counts
        ]


def _content(item: Any) -> Any:
    if item.type == "message":
        return [part.text for part in item.content]
    return (item.name, item.arguments, item.status)


async def test_a_function_call_and_its_output_sent_back(gateway: GatewayServer) -> None:
    """A forced call comes back as a function_call item; its output goes back,
    by previous_response_id and inline alike, and the model answers."""
    openai = client(gateway)
    first = await openai.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=64,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '"sunny"'}
    continued = await openai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],  # type: ignore[list-item]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_output_tokens=6,
    )
    inline = await openai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Paris?"}, call, result],  # type: ignore[list-item]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_output_tokens=6,
        store=False,
    )
    assert continued.output_text and continued.output_text == inline.output_text
    assert continued.usage is not None and inline.usage is not None
    assert continued.usage.input_tokens == inline.usage.input_tokens


async def test_a_stored_response_continues_from_the_prefix_cache(gateway: GatewayServer) -> None:
    """previous_response_id: the next turn's prompt is the last one's prompt and
    output, whose KV the prefix cache holds; GET reads a stored response and
    DELETE ends it."""
    openai = client(gateway)
    first = await openai.responses.create(
        model=MODEL, input=_image_input(), max_output_tokens=40, temperature=0
    )
    second = await openai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="And the colours?",
        max_output_tokens=4,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    reused = second.usage.input_tokens_details.cached_tokens
    # at least every full page of the first turn's prompt, its image's included (16-token
    # pages); its answer's too where the random model's text tokenizes back the same
    assert reused >= first.usage.input_tokens // 16 * 16 > 0, (reused, first.usage)
    assert (await openai.responses.retrieve(first.id)).output_text == first.output_text
    await openai.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        await openai.responses.retrieve(first.id)
    with pytest.raises(BadRequestError, match="previous_response_id"):
        await openai.responses.create(model=MODEL, previous_response_id=first.id, input="More?")


async def test_a_responses_input_items_are_listed(gateway: GatewayServer) -> None:
    """GET /v1/responses/{id}/input_items, through the official client: the
    request's own input (not the turns it continues), newest first by default,
    in pages; a deleted response's continuation keeps its history."""
    openai = client(gateway)
    first = await openai.responses.create(
        model=MODEL, input="Weather in Paris?", max_output_tokens=3, temperature=0
    )
    second = await openai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": "And in Rome?"},
            {"role": "user", "content": [{"type": "input_text", "text": "Briefly."}]},
        ],
        max_output_tokens=3,
        temperature=0,
    )
    (item,) = [i async for i in openai.responses.input_items.list(first.id)]
    assert item.type == "message" and item.role == "user" and item.id
    assert [c.text for c in item.content] == ["Weather in Paris?"]  # type: ignore[union-attr]
    newest = [i async for i in openai.responses.input_items.list(second.id)]
    assert [i.content[0].text for i in newest] == ["Briefly.", "And in Rome?"]  # type: ignore[union-attr]
    oldest = await openai.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.content[0].text for i in oldest.data] == ["And in Rome?"]  # type: ignore[union-attr]
    assert oldest.has_more
    await openai.responses.delete(first.id)
    third = await openai.responses.create(
        model=MODEL, previous_response_id=second.id, input="Thanks.", max_output_tokens=3
    )
    assert third.usage is not None and second.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens  # the first turn is in it
    with pytest.raises(NotFoundError):
        await openai.responses.input_items.list(first.id)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search_preview"}]}, "web_search_preview"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"truncation": "auto"}, "truncation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input_file",
        ),
    ],
)
async def test_what_is_not_supported_is_a_400_that_names_it(
    gateway: GatewayServer, extra: dict[str, Any], named: str
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(BadRequestError, match=named) as raised:
        await client(gateway).responses.create(**kwargs)
    assert "not supported" in str(raised.value)
    # and the gateway goes on serving
    served = await client(gateway).responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert served.output
