"""Tokenizer + chat template, and the prompt with image and video placeholders
expanded.

The chat template renders one `<|image_pad|>` per image and one `<|video_pad|>`
per video; build_prompt repeats each once per embedding token of its image or
video, which is what the HF processor does. A Qwen3-VL video (a grid with
frame_seconds) becomes, per temporal patch, its timestamp as text and the
patch's tokens between `<|vision_start|>` and `<|vision_end|>`:

    <0.3 seconds><|vision_start|><|video_pad|>...<|vision_end|><1.4 seconds>...

inside the template's own `<|vision_start|>`..`<|vision_end|>`, as
transformers' Qwen3VLProcessor (and vLLM) write it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.spec import CheckpointError, ModelSpec
from services.wire.messages import MediaGrid

# Chat messages: {"role": ..., "content": str | [{"type": "text" | "image" | "video", ...}]}
ChatMessages = Sequence[dict[str, Any]]


def load_tokenizer(folder: str | Path, chat_template: str | Path | None = None) -> Any:
    """The checkpoint's tokenizer, with its chat template (from tokenizer_config.json,
    chat_template.jinja or the processor's chat_template.json), or the one in the
    `chat_template` file (Jinja, or a processor's chat_template.json), as vLLM's
    --chat-template: checked here, so a template that cannot render a chat fails
    at start-up, not on the first request (CheckpointError)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        raise CheckpointError(f"{folder}: missing tokenizer (tokenizer.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"{folder}: cannot load the tokenizer: {exc}") from exc
    if not tokenizer.chat_template:
        processor_template = folder / "chat_template.json"
        if processor_template.is_file():
            tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
    if chat_template is not None:
        tokenizer.chat_template = _template_file(Path(chat_template))
    if not tokenizer.chat_template:
        raise CheckpointError(f"{folder}: the tokenizer has no chat template")
    if chat_template is not None:
        _check_template(tokenizer, Path(chat_template))
    return tokenizer


def _template_file(path: Path) -> str:
    try:
        text = path.read_text()
        return str(json.loads(text)["chat_template"]) if path.suffix == ".json" else text
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot read a chat template: {exc}") from exc


# What a template given at start-up must render: a system prompt, an image, a
# function's call and its result, and the next turn (tools where it renders them).
_PROBE: ChatMessages = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
]
_PROBE_TOOLS: Tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def _check_template(tokenizer: Any, path: Path) -> None:
    tools = _PROBE_TOOLS if "tools" in tokenizer.chat_template else ()
    try:
        text = render_chat(tokenizer, _PROBE, tools)
    except Exception as exc:
        raise CheckpointError(f"{path}: the chat template does not render a chat: {exc}") from exc
    if text.count("<|image_pad|>") != 1:
        raise CheckpointError(f"{path}: the chat template does not render an image placeholder")


@dataclass(frozen=True, slots=True)
class Prompt:
    """Token ids with placeholders expanded; "image" lists below are the images
    and videos in prompt order (a video is one item)."""

    token_ids: list[int]
    image_offsets: list[int]  # index of each image's first placeholder token
    image_token_counts: list[int]

    @property
    def num_image_tokens(self) -> int:
        return sum(self.image_token_counts)


# Function definitions as OpenAI's `tools` list them: {"type": "function", "function": {...}}
Tools = Sequence[dict[str, Any]]


def render_chat(tokenizer: Any, messages: ChatMessages, tools: Tools = ()) -> str:
    """The chat template's text; `tools`, when given, rendered by the template
    (ValueError if it cannot: such a template would silently leave them out)."""
    if tools and "tools" not in tokenizer.chat_template:
        raise ValueError("tools: this checkpoint's chat template does not render tools")
    return str(
        tokenizer.apply_chat_template(
            list(messages), tools=list(tools) or None, tokenize=False, add_generation_prompt=True
        )
    )


def completion_prompt(
    tokenizer: Any, spec: ModelSpec, text: str, token_ids: Sequence[int]
) -> Prompt:
    """A completion's prompt as it is (no chat template): its text tokenized, or
    its token ids, checked against the vocabulary."""
    if text and token_ids:
        raise ValueError("a prompt is text or token ids, not both")
    ids = list(token_ids) if token_ids else tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty")
    vocab = spec.text.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if spec.image_token_id in ids:
        raise ValueError("a completion prompt holds no image placeholder tokens: no image comes")
    return Prompt(ids, [], [])


def build_prompt(
    tokenizer: Any,
    spec: ModelSpec,
    messages: ChatMessages,
    items: Sequence[MediaGrid | int],
    tools: Tools = (),
) -> Prompt:
    """Token ids of the templated chat with the placeholder of vision item i (an
    image or a video, in prompt order) expanded for items[i]: its grid, or only
    its token count (a hint: a Qwen3-VL video's timestamps then stay out)."""
    text = render_chat(tokenizer, messages, tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pads = (spec.image_token_id, spec.video_token_id)
    placeholders = [i for i, t in enumerate(ids) if t in pads]
    if len(placeholders) != len(items):
        raise ValueError(
            f"prompt has {len(placeholders)} image placeholders "
            f"but {len(items)} image token counts were given"
        )
    out: list[int] = []
    offsets: list[int] = []
    counts: list[int] = []
    last = 0
    for position, item in zip(placeholders, items, strict=True):
        out.extend(ids[last:position])
        expansion = _expand(tokenizer, spec, ids[position], item)
        offsets.append(len(out) + expansion.index(ids[position]))
        counts.append(expansion.count(ids[position]))
        out.extend(expansion)
        last = position + 1
    out.extend(ids[last:])
    return Prompt(out, offsets, counts)


def _expand(tokenizer: Any, spec: ModelSpec, pad: int, item: MediaGrid | int) -> list[int]:
    """The tokens that stand for one image or video in the prompt."""
    merge = spec.vision.spatial_merge_size
    count = item if isinstance(item, int) else item.num_tokens(merge)
    if count <= 0:
        raise ValueError(f"image token count must be positive, got {count}")
    if isinstance(item, int) or not item.frame_seconds:
        return [pad] * count
    if pad != spec.video_token_id or len(item.frame_seconds) != item.t:
        raise ValueError(
            f"frame timestamps are for a video's {item.t} temporal patches, "
            f"got {len(item.frame_seconds)}"
        )
    stamps = tokenizer([f"<{s:.1f} seconds>" for s in item.frame_seconds], add_special_tokens=False)
    frame = [spec.vision_start_token_id, *[pad] * (count // item.t), spec.vision_end_token_id]
    return [t for stamp in stamps["input_ids"] for t in (*stamp, *frame)]
