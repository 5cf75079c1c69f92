"""Video input: the container's header, frame sampling, decoding (PyAV, which
ships FFmpeg in its wheel) and the model's video preprocessing.

The rules are transformers' `Qwen2VLVideoProcessor` (also Qwen2.5-VL's):
frames are sampled uniformly at `fps` frames per second of video, at least
`min_frames`, at most `max_frames`, rounded down to a multiple of the temporal
patch size; every frame is resized to the same size by the image resize rule
with the video processor's pixel bounds (bicubic, antialiased, on uint8 as
torchvision does on the CPU), normalised, and cut into patches of
`temporal_patch_size` consecutive frames. `VideoRule.grid` gives the token
grid from the header alone (the gateway's hint); `preprocess` gives the pixels
(the encoder). Tests hold both equal to transformers' processor.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from services.model.processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageTokenRule
from services.model.spec import CheckpointError
from services.wire.messages import ImageGrid

# Qwen2-VL's video processor: each frame's patches, merge and pixel bounds
VIDEO_FRAME = ImageTokenRule(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)


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
    """A checkpoint's video processor settings (video_preprocessor_config.json)."""

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

    def _sampling(self, info: VideoInfo) -> tuple[int, float]:
        """How many frames are sampled, and their rate."""
        count = len(self.frame_indices(info.num_frames, info.fps))
        return count, count / info.num_frames * info.fps

    def sampled_fps(self, info: VideoInfo) -> float:
        """Frames per second of the sampled clip (what M-RoPE's time axis counts in)."""
        return self._sampling(info)[1]

    def grid(self, info: VideoInfo) -> ImageGrid:
        """The patch grid of a video from its header: (sampled frames / temporal
        patch, resized height / patch, resized width / patch), and the seconds a
        temporal patch spans (temporal patch / sampled fps, as transformers'
        processor computes second_per_grid_ts)."""
        tp, p = self.frame.temporal_patch_size, self.frame.patch_size
        frames, sampled_fps = self._sampling(info)
        h, w = self.frame.resized(info.height, info.width)
        return ImageGrid(frames // tp, h // p, w // p, second_per_grid_t=tp / sampled_fps)

    def num_tokens(self, info: VideoInfo) -> int:
        return self.grid(info).num_tokens(self.frame.merge_size)

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> VideoRule:
        """From video_preprocessor_config.json, or like transformers from
        preprocessor_config.json where a checkpoint has no video config; missing
        keys take Qwen2-VL's defaults."""
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = Path(folder) / name
            if path.is_file():
                break
        else:
            raise CheckpointError(f"{folder}: missing video_preprocessor_config.json")
        config = json.loads(path.read_text())
        d = cls()
        return cls(
            frame=ImageTokenRule.from_config(config, VIDEO_FRAME),
            fps=float(config.get("fps") or d.fps),
            min_frames=config.get("min_frames", d.min_frames),
            max_frames=config.get("max_frames", d.max_frames),
            mean=tuple(config.get("image_mean", d.mean)),
            std=tuple(config.get("image_std", d.std)),
        )


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
) -> tuple[torch.Tensor, ImageGrid]:
    """An encoded video -> (pixel rows, grid with its seconds per temporal patch):
    header (`info` if already read), sampled frames decoded, preprocessed."""
    info = info or probe(data)
    header = rule.grid(info)
    pixels, grid = preprocess(decode(data, rule.frame_indices(info.num_frames, info.fps)), rule)
    if (grid.t, grid.h, grid.w) != (header.t, header.h, header.w):
        raise VideoError(f"the decoded frames ({grid}) disagree with the header ({header})")
    return pixels, header


def preprocess(frames: np.ndarray, rule: VideoRule) -> tuple[torch.Tensor, ImageGrid]:
    """Sampled uint8 RGB frames [T, H, W, 3] -> (pixel rows [t*h*w, C*tp*p*p]
    float32, grid), exactly as transformers' Qwen2VLVideoProcessor on them."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, C, H, W]
    num_frames, channels, height, width = video.shape
    h, w = rule.frame.resized(height, width)
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
    return patches.reshape(gt * gh * gw, channels * tp * p * p), ImageGrid(gt, gh, gw)
