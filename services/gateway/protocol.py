"""The OpenAI chat- and text-completion requests, validated (responses.py shapes
the answers)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from services.gateway.tool_calls import Forced, schema_error

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

# OpenAI parameters this server does not implement: refused by name, never ignored.
UNSUPPORTED = (
    "functions",  # the deprecated form of tools
    "function_call",
    "prediction",
    "audio",
    "modalities",
    "reasoning_effort",
    "web_search_options",
)


def _valid_unicode(text: str) -> str:
    """Text that UTF-8 can carry (JSON's \\ud800 escapes decode to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode ({exc.reason} at index {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
# logit_bias: {"token id": bias}; JSON keys are strings, hence lax for the key.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1, strict=False)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Fields keep their JSON types (no "5" for 5, no "yes" for true); unknown
    fields are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Strict):
    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Strict):
    url: Text


class VideoPart(_Strict):
    """A video, as vLLM and SGLang take it: {"type": "video_url", "video_url": {"url": ...}}."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class AssistantToolCall(_Strict):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are an assistant message's")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only it, has a tool_call_id")
        return self

    @property
    def parts(self) -> list[TextPart | ImagePart | VideoPart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """What chat and text completions share: the model, sampling, streaming."""

    model: Text = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # vLLM's; -1 or 0: off
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's limit; the engine's seats may be fewer
    ignore_eos: bool = False  # an extension (as in vLLM): fixed output lengths for benchmarks
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[TokenId, Bias] | None = Field(default=None, max_length=1024)
    # Extensions, as in vLLM:
    repetition_penalty: float = Field(default=1.0, gt=0, le=100, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    user: Text | None = None
    # vLLM's: the client's cache scope. Requests under other salts share no cached
    # KV page and no cached image embedding with this one (nor its timing).
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=1024)
    # OpenAI's: requests with one key and one prefix are routed to one language
    # instance (with the prefix, it names the instance whose cache serves them)
    prompt_cache_key: Text | None = Field(default=None, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNSUPPORTED:
                if name in data:
                    raise PydanticCustomError(
                        "unsupported", "{name} is not supported by this server", {"name": name}
                    )
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options",
                "stream_options is only allowed when stream is true",
                {"param": "stream_options"},
            )
        return self

    @model_validator(mode="after")
    def _min_tokens_within_max_tokens(self) -> Self:
        limit = self.max_output_tokens
        if limit is not None and self.min_tokens > limit:
            raise PydanticCustomError(
                "min_tokens",
                "min_tokens ({min}) must not exceed max_tokens ({max})",
                {"min": self.min_tokens, "max": limit, "param": "min_tokens"},
            )
        return self

    @property
    def stops(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class JsonSchema(_Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _usable_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (why := schema_error(json.dumps(value, sort_keys=True))):
            raise ValueError(f"a schema the grammar compiler refuses: {why}")
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools_fit_the_choice(self) -> Self:
        names = [t.function.name for t in self.tools or []]
        if duplicate := next((n for n in names if names.count(n) > 1), None):
            raise _tools_error("tools", "function '{name}' is defined twice", name=duplicate)
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise _tools_error("tool_choice", "tool_choice '{choice}' needs tools", choice=choice)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            name = choice.function.name
            raise _tools_error("tool_choice", "no function '{name}' in tools", name=name)
        if self.forces_tools and self.response_format is not None:
            text = "response_format and a forced tool_choice cannot both constrain the output"
            raise _tools_error("response_format", text)
        return self

    @property
    def calls_tools(self) -> bool:
        """The output is parsed for calls: tools given, and tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tools(self) -> bool:
        """tool_choice "required" or a named function: the output is calls only."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def forced_calls(self) -> Forced | None:
        """What a forced tool_choice holds the output to (tool_calls.Forced)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return Forced(self.tool_choice.function.name)
        return Forced() if self.tool_choice == "required" else None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _tools_error(param: str, text: str, **values: Any) -> PydanticCustomError:
    return PydanticCustomError("tools", text, {**values, "param": param})


PromptText = Annotated[Text, Field(min_length=1)]
PromptTokens = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]
Prompts = Annotated[list[PromptText] | list[PromptTokens], Field(min_length=1)]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions: one prompt or several (text or token ids), each a choice."""

    prompt: PromptText | PromptTokens | Prompts
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy form: top-k alternatives
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: its text or its token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [[t for t in self.prompt if isinstance(t, int)]]
        return [p for p in self.prompt if not isinstance(p, int)]


def _path(error: Any) -> list[str]:
    """An error's location without the arms of unions (`str`, `list[...]`,
    `function-after[...]`, a model's class name) and the tags of tagged unions
    that pydantic puts in it."""
    path: list[str] = []
    tag_next = False  # the next name after a tagged union is the tag, not a field
    for part in error.get("loc", ()):
        if isinstance(part, str) and "tagged-union[" in part:
            tag_next = True
        elif isinstance(part, str) and tag_next:
            tag_next = False
        elif not (
            (isinstance(part, str) and ("[" in part or part in _ARMS or part[:1].isupper()))
            or part == "body"
        ):
            path.append(str(part))
            # A tagged union held by the field itself: no `tagged-union[...]` arm
            # comes first, and the tag follows the field's name.
            if path == ["response_format"]:
                tag_next = True
    return path


_ARMS = ("str", "int", "float", "bool")


def validation_error(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic's most specific error as one readable line and the parameter it
    names: (`messages.0.role: ...`, `messages.0.role`). Of a union's failed arms,
    the one that got deepest into the value says what is wrong with it."""
    error = max(errors, key=lambda e: len(_path(e)))
    path = _path(error)
    message = str(error.get("msg", "invalid value"))
    if error.get("type") == "extra_forbidden":
        message = "unknown parameter, not supported by this server"
    if error.get("type") == "unsupported":
        path = [str(error.get("ctx", {}).get("name", ""))]
        message = "not supported by this server"
    elif "param" in error.get("ctx", {}):  # a check across fields names the one at fault
        path = [str(error["ctx"]["param"])]
    location = ".".join(path)
    return (f"{location}: {message}" if location else message), location or None
