"""POST /v1/responses, validated: the request, its input items and content parts,
its function tools. What this server does not implement (built-in tools,
background mode, reasoning, files) is refused by name, never ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from services.gateway.protocol import (
    UINT32_MAX,
    FunctionDefinition,
    JsonObjectFormat,
    Text,
    TextFormat,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Echoed(BaseModel):
    """An earlier response's output item sent back as input: the fields that
    matter are checked, the rest (ids, status, annotations) is the client's echo."""

    model_config = ConfigDict(extra="ignore", strict=True)


def _unsupported(name: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{name} is not supported", {"name": name})


def _kind(value: Any, default: str = "") -> str:
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", "")
    return kind if isinstance(kind, str) else ""


class InputText(_Strict):
    type: Literal["input_text"]
    text: Text


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: Text  # a data: or http(s) URL (file_id: refused)
    detail: Literal["auto", "low", "high"] | None = None


class OutputText(_Echoed):
    type: Literal["output_text"]
    text: Text


class Refusal(_Echoed):
    type: Literal["refusal"]
    refusal: Text


_PARTS = {"input_text", "input_image", "output_text", "refusal"}


def _part(value: Any) -> str:
    return _kind(value)


Part = Annotated[
    Annotated[InputText, Tag("input_text")]
    | Annotated[InputImage, Tag("input_image")]
    | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")],
    Discriminator(_part),
]


class Message(_Echoed):
    """A message: {"role", "content"} ("type": "message" may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Part]

    @property
    def parts(self) -> list[InputText | InputImage | OutputText | Refusal]:
        if isinstance(self.content, str):
            return [InputText(type="input_text", text=self.content)]
        return list(self.content)


class FunctionCall(_Echoed):
    """A call an earlier response made, sent back beside its output."""

    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text
    arguments: Text


class FunctionCallOutput(_Echoed):
    """What the client's function returned for call_id."""

    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


_ITEMS = {"message", "function_call", "function_call_output"}


def _item(value: Any) -> str:
    return _kind(value, "message")


Item = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_item),
]


class FunctionTool(FunctionDefinition):
    """A function tool: the chat API's definition, flattened beside its type."""

    type: Literal["function"]


def _tool(value: Any) -> str:
    return _kind(value)


Tool = Annotated[Annotated[FunctionTool, Tag("function")], Discriminator(_tool)]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Text


class SchemaFormat(_Strict):
    """text.format {"type": "json_schema", ...}: the chat API's json_schema, flattened."""

    type: Literal["json_schema"]
    name: Text = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: (
        Annotated[TextFormat | JsonObjectFormat | SchemaFormat, Field(discriminator="type")] | None
    ) = None
    verbosity: Literal["medium"] | None = None  # the only one a model without it has


class StreamOptions(_Strict):
    include_obfuscation: bool = False  # nothing to obfuscate against: no padding is sent


# Refused by name where set to anything but "off": (parameter, the value that is off).
UNSUPPORTED: dict[str, Any] = {
    "background": False,
    "conversation": None,
    "prompt": None,
    "reasoning": None,
    "include": [],
    "max_tool_calls": None,
    "top_logprobs": None,
    "context_management": None,
}


class ResponsesRequest(_Strict):
    model: Text = Field(min_length=1, max_length=256)
    input: Text | list[Item]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = Field(default=None, max_length=1024)  # a routing hint
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=1024)  # vLLM's
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the oldest input): refused

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in UNSUPPORTED.items():
                if data.get(name, off) not in (off, None):
                    raise _unsupported(name)
            if data.get("truncation") == "auto":
                raise _unsupported("truncation 'auto'")
            _refuse_kinds(data)
        return data


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _refuse_kinds(data: dict[str, Any]) -> None:
    """Built-in tools, and input items and parts of kinds this server does not
    take (files, reasoning, item references, ...), refused by name."""
    for tool in _list(data.get("tools")):
        if (kind := _kind(tool)) != "function":
            raise _unsupported(f"tool '{kind}' (only function tools are)")
    for item in _list(data.get("input")):
        if (kind := _kind(item, "message")) not in _ITEMS:
            raise _unsupported(f"input item '{kind}'")
        for part in _list(item.get("content")) if isinstance(item, dict) else []:
            if (kind := _kind(part)) not in _PARTS:
                raise _unsupported(f"content part '{kind}'")
            if kind == "input_image" and isinstance(part, dict) and "file_id" in part:
                raise _unsupported("input_image file_id (send image_url)")
