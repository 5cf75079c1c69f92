"""The OpenAI chat- and text-completion requests, validated, and the response shapes."""

from __future__ import annotations

import time
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

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

# OpenAI parameters this server does not implement: refused by name, never ignored.
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
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


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

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


class ChatCompletionRequest(_GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
    `function-after[...]`) and the tags of tagged unions that pydantic puts in it."""
    path: list[str] = []
    tag_next = False  # the next name after a tagged union is the tag, not a field
    for part in error.get("loc", ()):
        if isinstance(part, str) and "tagged-union[" in part:
            tag_next = True
        elif isinstance(part, str) and tag_next:
            tag_next = False
        elif not ((isinstance(part, str) and ("[" in part or part in _ARMS)) or part == "body"):
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprob_content(entries: list[Any]) -> list[dict[str, Any]]:
    """GenerateChunk TokenLogprobs -> OpenAI's `logprobs.content`."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                for t in e.top
            ],
        }
        for e in entries
    ]


def completion(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    """A chat completion; each choice from chat_choice()."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(
    index: int, text: str, finish_reason: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish_reason,
    }


def text_logprobs(entries: list[Any]) -> dict[str, Any]:
    """GenerateChunk TokenLogprobs -> the legacy completions `logprobs`."""
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def text_completion(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int] | None
) -> dict[str, Any]:
    """A /v1/completions response or stream chunk; each choice {index, text,
    logprobs, finish_reason}."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason,
            }
        ],
    }
