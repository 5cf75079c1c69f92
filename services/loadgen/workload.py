"""Benchmark workloads: chat requests with synthetic or folder images or videos
and text prompts, deterministic for a seed."""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.loadgen.synthetic import encode_image, random_image, random_video

WORDS = [
    "picture",
    "image",
    "photo",
    "color",
    "light",
    "shadow",
    "street",
    "river",
    "mountain",
    "city",
    "house",
    "tree",
    "window",
    "door",
    "table",
    "chair",
    "book",
    "paper",
    "water",
    "cloud",
    "sun",
    "rain",
    "snow",
    "road",
    "car",
    "bicycle",
    "train",
    "boat",
    "bird",
    "cat",
    "dog",
    "red",
    "green",
    "blue",
    "yellow",
    "small",
    "large",
    "old",
    "new",
    "bright",
    "dark",
    "left",
    "right",
    "near",
    "far",
    "morning",
    "evening",
]
FORMATS = {
    "jpeg": ("JPEG", "image/jpeg"),
    "png": ("PNG", "image/png"),
    "webp": ("WEBP", "image/webp"),
}


# What a response_format request asks for (--schema-ratio): a small record.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "tags", "score"],
}

# What a tools request offers (--tool-ratio): one function whose argument is
# free text, so a forced call runs for the whole output_len, as a free answer does.
BENCH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "take_note",
            "description": "Keep a note about the picture or the question.",
            "parameters": {
                "type": "object",
                "properties": {"note": {"type": "string"}},
                "required": ["note"],
            },
        },
    }
]


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int = 100
    input_len: int = 64  # words in the text prompt (a server's tokenizer decides the tokens)
    output_len: int = 64
    image_ratio: float = 1.0  # share of requests with images; 0.1 is a 1:9 mix
    images_per_request: int = 1
    # > 0: each request's images are drawn from a pool of this many (repeats
    # across requests, as a cache sees them); 0: every image is new
    distinct_images: int = 0
    # > 0: the pool's images are drawn with Zipf weights 1 / rank ** image_skew (a
    # few popular images among many); 0: each as likely as the next
    image_skew: float = 0.0
    image_size: tuple[int, int] = (448, 448)
    image_format: str = "jpeg"
    image_dir: Path | None = None
    ignore_eos: bool = True
    seed: int = 0
    endpoint: Literal["chat", "completions"] = "chat"  # /v1/completions: text prompts only
    schema_ratio: float = 0.0  # share of chat requests with a response_format JSON schema
    tool_ratio: float = 0.0  # share of chat requests with tools (BENCH_TOOLS)
    tool_choice: str = "required"  # theirs: "required", "auto" or "none"
    video_ratio: float = 0.0  # share of requests with one video (of those without images)
    video_frames: int = 16
    video_size: tuple[int, int] = (224, 224)
    video_fps: int = 4
    video_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.schema_ratio <= 1 or (self.schema_ratio and self.endpoint != "chat"):
            raise ValueError("schema_ratio must be in [0, 1], with the chat endpoint")
        if not 0 <= self.tool_ratio <= 1 or (self.tool_ratio and self.endpoint != "chat"):
            raise ValueError("tool_ratio must be in [0, 1], with the chat endpoint")
        if self.tool_choice not in ("required", "auto", "none"):
            raise ValueError("tool_choice must be required, auto or none")
        if self.endpoint == "completions" and self.image_ratio:
            raise ValueError("/v1/completions takes no images: use --image-ratio 0")
        if not 0 <= self.image_ratio <= 1:
            raise ValueError("image_ratio must be in [0, 1]")
        if not 0 <= self.video_ratio <= 1 or self.image_ratio + self.video_ratio > 1:
            raise ValueError("video_ratio must be in [0, 1 - image_ratio]")
        if self.endpoint == "completions" and self.video_ratio:
            raise ValueError("/v1/completions takes no videos: use --video-ratio 0")
        if self.image_format not in FORMATS:
            raise ValueError(f"image format must be one of {', '.join(FORMATS)}")
        if self.num_prompts < 1 or self.output_len < 1:
            raise ValueError("num_prompts and output_len must be positive")
        if self.distinct_images and self.distinct_images < self.images_per_request:
            raise ValueError("distinct_images must be 0 or at least images_per_request")
        if self.image_skew < 0 or (self.image_skew and not self.distinct_images):
            raise ValueError("image_skew must be >= 0, and needs distinct_images")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int
    kind: Literal["image", "video", "text"]
    body: dict[str, Any]
    path: str = "/chat/completions"  # under the base URL


def _folder_images(folder: Path) -> list[tuple[bytes, str]]:
    mime = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in mime)
    if not files:
        raise ValueError(f"no .jpg, .png or .webp images in {folder}")
    return [(p.read_bytes(), mime[p.suffix.lower()]) for p in files]


def _folder_videos(folder: Path) -> list[tuple[bytes, str]]:
    mime = {".mp4": "video/mp4", ".webm": "video/webm", ".mkv": "video/x-matroska"}
    mime |= {".mov": "video/quicktime", ".avi": "video/x-msvideo"}
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in mime)
    if not files:
        raise ValueError(f"no .mp4, .webm, .mkv, .mov or .avi videos in {folder}")
    return [(p.read_bytes(), mime[p.suffix.lower()]) for p in files]


class _Images:
    """The workload's n-th image as a data URL: from its folder, or random."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.folder = _folder_images(workload.image_dir) if workload.image_dir else []
        self._urls: dict[int, str] = {}

    def url(self, n: int) -> str:
        if n not in self._urls:
            if self.folder:
                data, kind = self.folder[n % len(self.folder)]
            else:
                pil_format, kind = FORMATS[self.workload.image_format]
                width, height = self.workload.image_size
                seed = self.workload.seed * 100_003 + n
                data = encode_image(random_image(width, height, seed=seed), pil_format)
            self._urls[n] = f"data:{kind};base64,{base64.b64encode(data).decode()}"
        return self._urls[n]


def _video_url(workload: Workload, videos: list[tuple[bytes, str]], index: int) -> str:
    """Request `index`'s video: from the folder, else a random clip of the workload's."""
    if videos:
        data, kind = videos[index % len(videos)]
    else:
        width, height = workload.video_size
        data = random_video(workload.video_frames, width, height, workload.video_fps, seed=index)
        kind = "video/mp4"
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _body(
    workload: Workload,
    model: str,
    text: str,
    content: list[dict[str, Any]],
    schema: bool,
    tools: bool,
) -> dict[str, Any]:
    """A request's JSON body: streamed, greedy, `output_len` tokens."""
    prompt: dict[str, Any] = (
        {"prompt": text}
        if workload.endpoint == "completions"
        else {"messages": [{"role": "user", "content": content}]}
    )
    body = {
        "model": model,
        **prompt,
        "max_tokens": workload.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": BENCH_SCHEMA},
        }
    if tools:
        body["tools"] = BENCH_TOOLS
        body["tool_choice"] = workload.tool_choice
        body["parallel_tool_calls"] = False
    return body


def _from_pool(draw: random.Random, workload: Workload) -> list[int]:
    """A request's images from the pool, none twice: evenly, or by Zipf weights."""
    pool, wanted = workload.distinct_images, workload.images_per_request
    if not workload.image_skew:
        return draw.sample(range(pool), wanted)
    weights = [1 / (rank + 1) ** workload.image_skew for rank in range(pool)]
    picks: list[int] = []
    while len(picks) < wanted:
        (pick,) = draw.choices(range(pool), weights)
        if pick not in picks:
            picks.append(pick)
    return picks


def build_requests(workload: Workload, model: str) -> list[BenchRequest]:
    rng = random.Random(workload.seed)
    with_images = set(
        rng.sample(range(workload.num_prompts), round(workload.image_ratio * workload.num_prompts))
    )
    rest = sorted(set(range(workload.num_prompts)) - with_images)
    video_rng = random.Random(workload.seed + 2)
    with_videos = set(video_rng.sample(rest, round(workload.video_ratio * workload.num_prompts)))
    videos = _folder_videos(workload.video_dir) if workload.video_dir else []
    schema_rng = random.Random(workload.seed + 1)
    count = round(workload.schema_ratio * workload.num_prompts)
    with_schema = set(schema_rng.sample(range(workload.num_prompts), count))
    count = round(workload.tool_ratio * workload.num_prompts)
    with_tools = set(random.Random(workload.seed + 2).sample(range(workload.num_prompts), count))
    image = _Images(workload)
    draw = random.Random(workload.seed + 3)
    requests = []
    used = 0
    for index in range(workload.num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(workload.input_len))
        content: list[dict[str, Any]] = []
        if index in with_images:
            if workload.distinct_images:
                picks = _from_pool(draw, workload)
            else:
                picks = list(range(used, used + workload.images_per_request))
                used += workload.images_per_request
            for pick in picks:
                content.append({"type": "image_url", "image_url": {"url": image.url(pick)}})
        if index in with_videos:
            url = _video_url(workload, videos, index)
            content.append({"type": "video_url", "video_url": {"url": url}})
        content.append({"type": "text", "text": text})
        body = _body(workload, model, text, content, index in with_schema, index in with_tools)
        path = "/completions" if workload.endpoint == "completions" else "/chat/completions"
        of: Literal["image", "video", "text"] = (
            "image" if index in with_images else "video" if index in with_videos else "text"
        )
        requests.append(BenchRequest(index, of, body, path))
    return requests
