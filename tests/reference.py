"""The Hugging Face reference: greedy `generate()` on a whole checkpoint.

The processor's placeholder expansion is done here by hand (AutoProcessor
needs torchvision, which does not load beside the CPU torch): each
`<|image_pad|>` becomes grid.prod() / merge^2 copies, as Qwen2VLProcessor does,
and a Qwen3-VL video its timestamped frames as Qwen3VLProcessor writes them
(tests/model/test_video.py holds the project's prompt equal to that processor's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import torch
from PIL import Image

from services.wire.messages import MediaGrid

T = TypeVar("T")


@cache
def _hf_model(folder: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).eval()


@cache
def _hf_parts(folder: str) -> tuple[Any, Any]:
    from transformers import AutoImageProcessor, AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)


def hf_greedy(
    folder: str | Path,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image] = (),
    max_new_tokens: int = 16,
    **processors: Any,
) -> list[int]:
    """Greedy tokens from HF generate() for a chat (image parts in order of `images`);
    `processors`: generate()'s logits-processor arguments (repetition_penalty, ...)."""
    out = _generate(folder, torch.float32, messages, images, max_new_tokens, **processors)
    return [int(t) for t in out.sequences[0, -len(out.scores) :]]


async def on_a_thread(reference: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A reference (hf_greedy, hf_greedy_videos, or what calls them), or other
    seconds of a test's own work (64 images encoded and hashed), on a worker
    thread, for a test whose servers share its event loop: they keep serving and
    sending heartbeats meanwhile (the tests' broker drops an instance silent for
    2 s, and such work took longer on a loaded machine)."""
    return await asyncio.to_thread(reference, *args, **kwargs)


# The bf16 contract's near-tie, in nats. bf16's roundings (kernels, reduction orders)
# move the small demo's top-20 logprobs by up to ~0.19 nats against HF's in bf16 (measured:
# 12 prompts x 24 tokens, the same with torch's SDPA as with the compiled paged
# kernel), so two tokens closer than twice that may swap. The demos' random weights
# make such ties common (their top logits lie a bf16 step or two apart, often six
# within 0.2 nats), and a rank cut (each side's token among the other's top 5) then
# fails on rounding alone (seen on an AMX Xeon: HF's token 0.25 nats below ours, 6th).
NEAR_TIE = 0.4
# how many of the engine's most likely tokens a step reports (the most it gives)
TOP = 20


def hf_greedy_logprobs(
    folder: str | Path,
    dtype: torch.dtype,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image],
    max_new_tokens: int,
) -> list[tuple[int, torch.Tensor]]:
    """HF generate() in `dtype`: per step, the greedy token and the log-softmax
    of the step's logits over the whole vocabulary (float32)."""
    out = _generate(folder, dtype, messages, images, max_new_tokens)
    tokens = out.sequences[0, -len(out.scores) :]
    return [
        (int(t), torch.log_softmax(scores[0].float(), dim=-1))
        for t, scores in zip(tokens, out.scores, strict=True)
    ]


def assert_close_to_hf(
    got: Sequence[tuple[int, dict[int, float]]],
    expected: Sequence[tuple[int, torch.Tensor]],
    label: str,
) -> None:
    """The bf16 contract (vLLM's model tests', with the near-tie by value): per
    step, (greedy token, the engine's top logprobs) against HF's (greedy token,
    logprobs). Up to the first difference the tokens are equal and each of the
    engine's top logprobs is within NEAR_TIE of HF's for that token; at the first
    difference each side's token is within NEAR_TIE of the other side's best;
    past it the contexts differ and nothing is compared."""
    for step, ((ours, our_top), (theirs, their_logprobs)) in enumerate(
        zip(got, expected, strict=False)
    ):
        where = f"{label}, step {step}"
        for token, logprob in our_top.items():
            hf = float(their_logprobs[token])
            assert abs(logprob - hf) <= NEAR_TIE, (
                f"{where}: token {token} {logprob:.3f}, HF {hf:.3f}"
            )
        if ours == theirs:
            continue
        assert theirs in our_top, f"{where}: engine {ours}, HF {theirs} not in its top {TOP}"
        our_gap = our_top[ours] - our_top[theirs]
        their_gap = float(their_logprobs[theirs] - their_logprobs[ours])
        assert our_gap <= NEAR_TIE and their_gap <= NEAR_TIE, (
            f"{where}: engine {ours}, HF {theirs}: {our_gap:.3f} nats apart in the engine's "
            f"logprobs, {their_gap:.3f} in HF's (a near-tie is within {NEAR_TIE})"
        )
        return
    assert len(got) == len(expected), f"{label}: same tokens, different lengths"


@dataclass(frozen=True)
class HfVideo:
    """A video as transformers' processor hands it to the model: its pixel rows
    (pixel_values_videos), its grid and seconds per temporal patch, and for
    Qwen3-VL the timestamps its prompt spells out."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]
    second_per_grid_t: float
    frame_seconds: tuple[float, ...] = ()

    @classmethod
    def of(cls, pixels: torch.Tensor, grid: MediaGrid) -> HfVideo:
        """The video the project's preprocessing made (equal to the processor's)."""
        return cls(pixels, (grid.t, grid.h, grid.w), grid.second_per_grid_t, grid.frame_seconds)

    def text(self, merge: int) -> str:
        """What the video's `<|video_pad|>` becomes in the prompt."""
        t, h, w = self.grid
        if not self.frame_seconds:
            return "<|video_pad|>" * (t * h * w // merge**2)
        frame = "<|vision_start|>" + "<|video_pad|>" * (h * w // merge**2) + "<|vision_end|>"
        return "".join(f"<{s:.1f} seconds>" + frame for s in self.frame_seconds)


def hf_greedy_videos(
    folder: str | Path,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image],
    videos: Sequence[HfVideo],
    max_new_tokens: int = 16,
) -> list[int]:
    """Greedy tokens from HF generate() for a chat with images and videos."""
    out = _generate(folder, torch.float32, messages, images, max_new_tokens, videos=videos)
    return [int(t) for t in out.sequences[0, -len(out.scores) :]]


def _expand(text: str, pad: str, replacements: Sequence[str]) -> str:
    pieces = text.split(pad)
    assert len(pieces) == len(replacements) + 1, f"one {pad} per item"
    return pieces[0] + "".join(r + rest for r, rest in zip(replacements, pieces[1:], strict=True))


def _generate(
    folder: str | Path,
    dtype: torch.dtype,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image],
    max_new_tokens: int,
    videos: Sequence[HfVideo] = (),
    **processors: Any,
) -> Any:
    folder = str(folder)
    model = _hf_model(folder, dtype)
    tokenizer, image_processor = _hf_parts(folder)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    merge = model.config.vision_config.spatial_merge_size
    kwargs: dict[str, Any] = {}
    if images:
        pixels = image_processor(images=list(images), return_tensors="pt")
        counts = [int(g.prod()) // merge**2 for g in pixels["image_grid_thw"]]
        text = _expand(text, "<|image_pad|>", ["<|image_pad|>" * n for n in counts])
        kwargs |= {
            "pixel_values": pixels["pixel_values"].to(dtype),
            "image_grid_thw": pixels["image_grid_thw"],
        }
    if videos:
        text = _expand(text, "<|video_pad|>", [v.text(merge) for v in videos])
        kwargs |= {
            "pixel_values_videos": torch.cat([v.pixels for v in videos]).to(dtype),
            "video_grid_thw": torch.tensor([v.grid for v in videos]),
        }
        if not any(v.frame_seconds for v in videos):  # Qwen2.5-VL's time scale
            # the processor's float32 tensor
            kwargs["second_per_grid_ts"] = torch.tensor(
                [v.second_per_grid_t for v in videos], dtype=torch.float32
            )
    enc = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"]
    mm_token_type_ids = (ids == model.config.image_token_id).int()
    mm_token_type_ids += 2 * (ids == model.config.video_token_id).int()
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=enc["attention_mask"],
            mm_token_type_ids=mm_token_type_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
            **processors,
        )


def hf_greedy_prompt(
    folder: str | Path, token_ids: Sequence[int], max_new_tokens: int, **processors: Any
) -> list[int]:
    """Greedy tokens from HF generate() continuing raw token ids (no chat template)."""
    model = _hf_model(str(folder))
    input_ids = torch.tensor([list(token_ids)])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=torch.zeros_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **processors,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :]]


def chat(text: str, num_images: int = 0) -> list[dict[str, Any]]:
    """One user turn: the images first, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]
