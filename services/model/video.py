"""Video input: the container's header, frame sampling, decoding (PyAV, which
ships FFmpeg in its wheel) and the model's video preprocessing.

Two families of rules, each transformers' video processor of its models:
- `VideoRule`, Qwen2-VL's `Qwen2VLVideoProcessor` (also Qwen2.5-VL's): frames
  are sampled uniformly at `fps` frames per second of video, at least
  `min_frames`, at most `max_frames`, rounded down to a multiple of the temporal
  patch size; every frame is resized by the image resize rule with the video
  processor's pixel bounds per frame.
- `Qwen3VideoRule`, Qwen3-VL's `Qwen3VLVideoProcessor`: the frame count is not
  rounded (the last frame is repeated to fill a temporal patch), the pixel
  bounds hold for the whole clip, and each temporal patch has a timestamp that
  the prompt spells out before the patch's tokens (`MediaGrid.frame_seconds`).
Either way frames are resized bicubic, antialiased, on uint8 as torchvision
does on the CPU, normalised, and cut into patches of `temporal_patch_size`
consecutive frames. `VideoRule.grid` gives the token grid from the header alone
(the gateway's hint); `preprocess` gives the pixels (the encoder). Tests hold
both equal to transformers' processors.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.model.processor import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageTokenRule,
    check_aspect_ratio,
)
from services.model.spec import QWEN3_MODEL_TYPES, CheckpointError
from services.wire.messages import MediaGrid

# Qwen2-VL's video processor: each frame's patches, merge and pixel bounds
VIDEO_FRAME = ImageTokenRule(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)
# Qwen3-VL's: its patches and merge, and pixel bounds for the whole clip
QWEN3_VIDEO_FRAME = ImageTokenRule(
    patch_size=16, min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32
)
# the processor config's keys that are VideoRule fields of the same name
_SETTINGS = ("fps", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens")


class VideoError(ValueError):
    """The bytes are not a video this server can decode, or it has no frames."""


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a container's header says about its first video stream."""

    num_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True, slots=True)
class VideoRule:
    """A checkpoint's video processor settings (video_preprocessor_config.json),
    with Qwen2-VL's rules; `from_checkpoint` picks the family's class."""

    frame: ImageTokenRule = VIDEO_FRAME  # each frame's patches, merge and pixel bounds
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    def frame_indices(self, num_frames: int, fps: float) -> list[int]:
        """The frames sampled from a video of `num_frames` at `fps` (Qwen2-VL's rule)."""
        step = self.frame.temporal_patch_size
        most = math.floor(min(self.max_frames, num_frames) / step) * step
        wanted = min(max(num_frames / fps * self.fps, self.min_frames), most, num_frames)
        count = math.floor(wanted / step) * step
        if count <= 0:
            raise VideoError(
                f"the video has {num_frames} frames; at least {step} are needed to sample it"
            )
        return torch.arange(0, num_frames, num_frames / count).int().tolist()

    def resized(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Every sampled frame's size: the image rule with the video's pixel bounds."""
        return self.frame.resized(height, width)

    def frame_seconds(self, indices: list[int], fps: float) -> tuple[float, ...]:
        """Timestamps the prompt spells out per temporal patch: none in Qwen2-VL."""
        return ()

    def sampled_fps(self, info: VideoInfo) -> float:
        """Frames per second of the sampled clip (what M-RoPE's time axis counts in)."""
        return _sampled_fps(len(self.frame_indices(info.num_frames, info.fps)), info)

    def grid(self, info: VideoInfo) -> MediaGrid:
        """The patch grid of a video from its header: (temporal patches of the
        sampled frames, resized height / patch, resized width / patch), the seconds
        a temporal patch spans (temporal patch / sampled fps, as transformers'
        processor computes second_per_grid_ts) and the patches' timestamps."""
        tp, p = self.frame.temporal_patch_size, self.frame.patch_size
        indices = self.frame_indices(info.num_frames, info.fps)
        frames = len(indices)
        h, w = self.resized(frames, info.height, info.width)
        return MediaGrid(
            -(-frames // tp),
            h // p,
            w // p,
            second_per_grid_t=tp / _sampled_fps(frames, info),
            frame_seconds=self.frame_seconds(indices, info.fps),
        )

    def num_tokens(self, info: VideoInfo) -> int:
        return self.grid(info).num_tokens(self.frame.merge_size)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> VideoRule:
        """From video_preprocessor_config.json, or like transformers from
        preprocessor_config.json where a checkpoint has no video config; the
        family from its video_processor_type, else the model's type; missing keys
        take the family's defaults."""
        folder = Path(folder)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = folder / name
            if path.is_file():
                break
        else:
            raise CheckpointError(f"{folder}: missing video_preprocessor_config.json")
        config = json.loads(path.read_text())
        kind = config.get("video_processor_type")
        if kind is None and (folder / "config.json").is_file():
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
            kind = "Qwen3VLVideoProcessor" if model_type in QWEN3_MODEL_TYPES else None
        if kind is not None and kind.startswith("Qwen3VL"):
            return Qwen3VideoRule.from_config(config)
        if config.get("cap_pixels_per_frame"):
            raise CheckpointError(f"{path}: Qwen2-VL's cap_pixels_per_frame is not supported")
        return VideoRule.from_config(config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VideoRule:
        """From a video processor config; missing keys take the class's defaults."""
        d = cls()
        return dataclasses.replace(
            d,
            frame=ImageTokenRule.from_config(config, d.frame),
            mean=tuple(config.get("image_mean", d.mean)),
            std=tuple(config.get("image_std", d.std)),
            **{
                f.name: config[f.name]
                for f in dataclasses.fields(cls)
                if f.name in _SETTINGS and config.get(f.name) is not None
            },
        )


@dataclass(frozen=True, slots=True)
class Qwen3VideoRule(VideoRule):
    """Qwen3-VL's video processor (transformers' `Qwen3VLVideoProcessor`)."""

    frame: ImageTokenRule = QWEN3_VIDEO_FRAME  # min/max pixels: the whole clip's
    mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    std: tuple[float, float, float] = IMAGENET_STANDARD_STD
    # qwen-vl-utils' per-frame cap: a frame costs at most max_video_tokens, and
    # at most its even share of the clip's budget
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def frame_indices(self, num_frames: int, fps: float) -> list[int]:
        """`fps` frames a second, at least min_frames, at most max_frames and the
        video's frames, spread evenly from the first frame to the last."""
        count = min(max(int(num_frames / fps * self.fps), self.min_frames), self.max_frames)
        count = min(count, num_frames)
        if count < self.frame.temporal_patch_size:
            raise VideoError(
                f"the video has {num_frames} frames; at least "
                f"{self.frame.temporal_patch_size} are needed to sample it"
            )
        return np.linspace(0, num_frames - 1, count).round().astype(int).tolist()

    def resized(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL's video smart_resize: sides multiples of the merged patch, the
        clip's pixels (frames rounded to the temporal patch) within the bounds."""
        rule, tp = self.frame, self.frame.temporal_patch_size
        factor, min_pixels, max_pixels = rule.factor, rule.min_pixels, rule.max_pixels
        if self.cap_pixels_per_frame:
            cap = self.max_video_tokens * factor * factor
            per_frame = max(min(cap, max_pixels // num_frames), int(min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        if height <= 0 or width <= 0:
            raise ValueError(f"video frame size {width}x{height} is empty")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        check_aspect_ratio(height, width)
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        t_bar = round(num_frames / tp) * tp
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt((num_frames * height * width) / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (num_frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def frame_seconds(self, indices: list[int], fps: float) -> tuple[float, ...]:
        """Each temporal patch's time: the mean of its first and last frame's
        (the last frame repeated to fill the final patch)."""
        tp = self.frame.temporal_patch_size
        indices = indices + [indices[-1]] * (-len(indices) % tp)
        seconds = [i / fps for i in indices]
        return tuple((seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp))


def _sampled_fps(count: int, info: VideoInfo) -> float:
    return count / info.num_frames * info.fps


def probe(data: bytes) -> VideoInfo:
    """The header of a container's first video stream, without decoding frames."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoError("the container has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = stream.frames
            if not frames and stream.duration and stream.time_base and rate:
                frames = round(float(stream.duration * stream.time_base * rate))
            width, height = stream.codec_context.width, stream.codec_context.height
    except av.FFmpegError as exc:
        raise VideoError(f"cannot read the video: {exc}") from exc
    if not rate or not frames or frames <= 0:
        raise VideoError("the video has no frames")
    if width <= 0 or height <= 0:
        raise VideoError(f"the video's frame size {width}x{height} is empty")
    return VideoInfo(int(frames), float(rate), int(width), int(height))


def decode(data: bytes, indices: list[int]) -> np.ndarray:
    """The frames at `indices` (ascending) as uint8 RGB [len(indices), H, W, 3];
    decoding stops after the last one."""
    import av

    wanted = set(indices)
    last = max(indices)
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if i >= last:
                    break
    except av.FFmpegError as exc:
        raise VideoError(f"cannot decode the video: {exc}") from exc
    if len(frames) != len(indices):
        raise VideoError(f"the video has {len(frames)} decodable frames of {len(indices)} sampled")
    return np.stack(frames)


def load_video(
    data: bytes, rule: VideoRule, info: VideoInfo | None = None
) -> tuple[torch.Tensor, MediaGrid]:
    """An encoded video -> (pixel rows, grid with its seconds per temporal patch):
    header (`info` if already read), sampled frames decoded, preprocessed."""
    info = info or probe(data)
    header = rule.grid(info)
    pixels, grid = preprocess(decode(data, rule.frame_indices(info.num_frames, info.fps)), rule)
    if (grid.t, grid.h, grid.w) != (header.t, header.h, header.w):
        raise VideoError(f"the decoded frames ({grid}) disagree with the header ({header})")
    return pixels, header


def preprocess(frames: np.ndarray, rule: VideoRule) -> tuple[torch.Tensor, MediaGrid]:
    """Sampled uint8 RGB frames [T, H, W, 3] -> (pixel rows [t*h*w, C*tp*p*p]
    float32, grid), exactly as transformers' Qwen2VLVideoProcessor on them."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, C, H, W]
    num_frames, channels, height, width = video.shape
    h, w = rule.resized(num_frames, height, width)
    if (h, w) != (height, width):
        video = F.interpolate(
            video.contiguous(), size=(h, w), mode="bicubic", align_corners=False, antialias=True
        )
    mean = torch.tensor(rule.mean).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(rule.std).view(1, 3, 1, 1) * 255.0
    video = (video.to(torch.float32) - mean) / std
    tp, p, m = rule.frame.temporal_patch_size, rule.frame.patch_size, rule.frame.merge_size
    if pad := -num_frames % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        num_frames += pad
    gt, gh, gw = num_frames // tp, h // p, w // p
    patches = video.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, channels * tp * p * p), MediaGrid(gt, gh, gw)
