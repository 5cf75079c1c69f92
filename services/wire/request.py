"""The request path's messages as plain dataclasses: what a language instance is
asked (GenerateRequest) and what it streams back (GenerateResponse).

Named as their protobuf messages in protos/epd/v1/language.proto and
common.proto, with the same field names, and converted by convert.py at the two
gRPC edges (the gateway's backend, the language servicer); everything between
them, the gateway's app, the language frontend and engine, the monolithic
baseline, sees only these.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field

from services.wire.messages import MediaGrid

# Below this temperature sampling is greedy (as in vLLM): dividing the logits by
# it would overflow to inf and leave no distribution to draw from.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample, OpenAI's and vLLM's parameters. A field left at proto3's
    zero value arrives as its default here (convert.py): top_p 0 is 1, n 0 is 1."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 0  # 0: up to the context length (the frontend resolves it)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Logits processors (OpenAI / vLLM semantics; services/language/engine/sampler.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # Structured output (services/language/engine/grammar.py).
    json_schema: str = ""
    json_object: bool = False
    n: int = 1  # choices: the prompt is prefilled once, its KV pages shared by all
    structural_tag: str = ""  # tool calling: an xgrammar structural tag (JSON text)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 0:
            raise ValueError(
                f"max_tokens must be >= 0 (0: up to the context), got {self.max_tokens}"
            )
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0 or (self.max_tokens and self.min_tokens > self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}"
            )
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias {token}: {bias} must be in [-100, 100]")
        if self.structural_tag and (self.json_schema or self.json_object):
            raise ValueError("one grammar a request: a JSON schema or a tool-call structural tag")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_processors(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )

    @property
    def token_ids(self) -> list[int]:
        """Every token id these parameters name (to check against the vocabulary)."""
        return [*self.stop_token_ids, *(token for token, _ in self.logit_bias)]


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ImagePart:
    token_hint: int = 0  # expected embedding tokens (0: unknown)
    key: str = ""  # its content hash (media_key): the prefix cache knows its KV by it
    grid_hint: MediaGrid | None = None  # the grid the encoder will send (None: unknown)


@dataclass(frozen=True, slots=True)
class VideoPart:
    token_hint: int = 0  # expected embedding tokens (0: unknown)
    key: str = ""  # its content hash (media_key)
    grid_hint: MediaGrid | None = None


# A ContentPart is its oneof's member: text, an image or a video.
ContentPart = str | ImagePart | VideoPart
MediaPart = ImagePart | VideoPart


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant made: its id, the function and its arguments (JSON)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: tuple[ContentPart, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str = ""  # a tool's result: the call it answers


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A chat (messages, each image or video with its token hint), or a
    completion: `prompt` or `prompt_token_ids` as it is, no template, no media."""

    request_id: str
    messages: tuple[ChatMessage, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    # E/P/D: to a prefill instance, where the KV pages go; to a decode instance,
    # which prefill instance sends them.
    decode_instance_id: str = ""
    prefill_instance_id: str = ""
    tools: str = ""  # the functions the model may call: OpenAI's `tools`, JSON text
    # the leading images and videos the instance may hold in its prefix cache
    held_items: int = 0
    # the client's cache scope: requests with other salts share no KV page with it
    cache_salt: str = ""
    # another language instance that holds the chat's KV pages (its address)
    prefix_holder: str = ""

    @property
    def is_completion(self) -> bool:
        return bool(self.prompt or self.prompt_token_ids)

    @property
    def media(self) -> list[MediaPart]:
        """The images and videos, in prompt order."""
        return [p for m in self.messages for p in m.content if not isinstance(p, str)]

    def media_in(self, num_messages: int) -> int:
        """How many images and videos the first `num_messages` messages hold."""
        return sum(not isinstance(p, str) for m in self.messages[:num_messages] for p in m.content)

    def prefix_hashes(self, routing_key: str = "") -> tuple[str, ...]:
        """The chat's prefixes, shortest first: the hash of the tools and its first
        message, then of those and its second, ... (images and videos by their
        content hashes): what the broker routes a conversation's turns by. The
        cache salt and `routing_key` (OpenAI's prompt_cache_key) come first: turns
        under another salt or key are routed on their own. A completion has one
        prefix, the key's, where it has one."""
        digest = hashlib.blake2b(repr((self.cache_salt, routing_key)).encode(), digest_size=16)
        if self.is_completion:
            return (digest.hexdigest(),) if routing_key else ()
        hashes = []
        digest.update(self.tools.encode())
        for message in self.messages:
            digest.update(repr(message).encode())
            hashes.append(digest.copy().hexdigest())
        return tuple(hashes)


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """A request's images and videos (their encoded bytes, in prompt order; the
    entries at `video_indices` are videos), for the encoder to send to
    `language_instance_id` (empty: back in the reply)."""

    request_id: str
    images: tuple[bytes, ...] = ()
    language_instance_id: str = ""
    video_indices: tuple[int, ...] = ()
    # the leading items the language instance may hold in its prefix cache: their
    # preallocation comes before they are encoded, and says which it holds
    held_items: int = 0
    cache_salt: str = ""  # the client's cache scope: it enters each item's key
    # per item: another encoder to fetch it from instead of encoding it ("": none)
    peer_addresses: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillReply:
    num_prompt_tokens: int


# -- the response stream -------------------------------------------------------


class FinishReason(enum.StrEnum):
    """Why a choice ended; its value is OpenAI's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    token_ids: tuple[int, ...] = ()
    text: str = ""  # complete UTF-8 characters only
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerateComplete:
    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    image_tokens: int = 0  # the images' and videos' embedding tokens
    cached_tokens: int = 0  # of the prompt's, taken from the prefix cache


@dataclass(frozen=True, slots=True)
class GenerateError:
    code: int  # a grpc.StatusCode value
    message: str


@dataclass(frozen=True, slots=True)
class GenerateResponse:
    """One message of a Generate stream; with n > 1 the choices' messages
    interleave, `index` naming the choice, each ending with its complete."""

    request_id: str
    kind: GenerateChunk | GenerateComplete | GenerateError
    index: int = 0
