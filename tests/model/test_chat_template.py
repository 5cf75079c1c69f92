"""--chat-template: a checkpoint served with another template than its own, checked
when the service starts; the demo builds a checkpoint with the template the
Qwen2.5-VL checkpoints were released with, which renders no tools."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.language.server import LanguageServer
from services.model.demo import build_demo_checkpoint
from services.model.spec import CheckpointError
from services.model.tokenizer import load_tokenizer, render_chat
from services.proto import common_pb2, language_pb2
from tests.language.test_language_service import proto_messages
from tests.stack import language_stub, start_language

TOOLS_TEMPLATE = Path(str(resources.files("services.model").joinpath("chat_template.jinja")))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CHAT = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo, seed 0, with the released Qwen2.5-VL template: no tools."""
    return build_demo_checkpoint(tmp_path_factory.mktemp("released"), template="released")


def test_a_checkpoint_whose_template_has_no_tools_takes_them_with_another(released: Path) -> None:
    with pytest.raises(ValueError, match="does not render tools"):
        render_chat(load_tokenizer(released), CHAT, TOOLS)
    text = render_chat(load_tokenizer(released, TOOLS_TEMPLATE), CHAT, TOOLS)
    assert "get_weather" in text and "<tools>" in text


def test_a_processor_s_chat_template_json_is_read_too(released: Path, tmp_path: Path) -> None:
    wrapped = tmp_path / "chat_template.json"
    wrapped.write_text(json.dumps({"chat_template": TOOLS_TEMPLATE.read_text()}))
    assert "<tools>" in render_chat(load_tokenizer(released, wrapped), CHAT, TOOLS)


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% if %}", "does not render a chat"),
        ("{{ messages[0]['content'] }}", "image placeholder"),
        (None, "cannot read"),
    ],
)
def test_a_template_that_cannot_serve_fails_at_load(
    released: Path, tmp_path: Path, template: str | None, error: str
) -> None:
    path = tmp_path / "template.jinja"
    if template is not None:
        path.write_text(template)
    with pytest.raises(CheckpointError, match=error):
        load_tokenizer(released, path)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def with_template(released: Path) -> AsyncIterator[LanguageServer]:
    server = await start_language(released, chat_template=TOOLS_TEMPLATE)
    yield server
    await server.stop()


async def _generate(server: LanguageServer, request_id: str) -> list[int]:
    request = language_pb2.GenerateRequest(
        request_id=request_id,
        messages=proto_messages("Weather in Paris?", []),
        sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
        tools=json.dumps(TOOLS),
    )
    tokens = []
    async for response in language_stub(server).Generate(request):
        if response.HasField("chunk"):
            tokens += list(response.chunk.token_ids)
    return tokens


@pytest.mark.asyncio(loop_scope="session")
async def test_the_language_service_serves_tools_with_the_template_it_was_given(
    released: Path, with_template: LanguageServer, tiny_checkpoint: Path
) -> None:
    """The released checkpoint with --chat-template generates what the demo whose
    own template renders tools does (the same weights); without it, tools are a
    400-class error."""
    plain = await start_language(released)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _generate(plain, "no-template")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not render tools" in (info.value.details() or "")
    finally:
        await plain.stop()
    reference = await start_language(tiny_checkpoint)
    try:
        expected = await _generate(reference, "reference")
    finally:
        await reference.stop()
    assert await _generate(with_template, "with-template") == expected
