"""Video header, frame sampling and preprocessing against transformers'
Qwen2VLVideoProcessor (bit-exact pixels), on clips made here with PyAV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.bench.images import random_video
from services.model.demo import build_demo_checkpoint
from services.model.video import VideoError, VideoRule, decode, preprocess, probe
from tests.videos import hf_video_pixels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), size="tiny")


def test_the_header_gives_frames_rate_and_size_without_decoding() -> None:
    info = probe(random_video(num_frames=30, width=64, height=48, fps=10))
    assert (info.num_frames, info.fps, info.width, info.height) == (30, 10.0, 64, 48)
    assert info.duration_s == 3.0


def test_sampling_and_pixels_equal_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """Three clips (frame counts that round, a short one padded up to min_frames'
    rule, another size and rate): the same frame indices, grids and bit-equal pixels."""
    rule = VideoRule.from_checkpoint(checkpoint)
    clips = [
        random_video(num_frames=30, width=64, height=48, fps=10),
        random_video(num_frames=7, width=90, height=50, fps=4, seed=1),
        random_video(num_frames=45, width=120, height=200, fps=15, seed=2),
    ]
    infos = [probe(clip) for clip in clips]
    whole = [
        decode(clip, list(range(info.num_frames))) for clip, info in zip(clips, infos, strict=True)
    ]
    hf = hf_video_pixels(checkpoint, whole, [info.fps for info in infos], tmp_path)

    rows, grids = [], []
    for clip, info, indices in zip(clips, infos, hf["indices"], strict=True):
        assert rule.frame_indices(info.num_frames, info.fps) == indices
        assert rule.sampled_fps(info) == pytest.approx(hf["sampled_fps"][len(rows)])
        pixels, grid = preprocess(decode(clip, indices), rule)
        header = rule.grid(info)  # the header alone gives the grid
        assert (grid.t, grid.h, grid.w) == (header.t, header.h, header.w)
        rows.append(pixels)
        grids.append([grid.t, grid.h, grid.w])
    assert grids == hf["video_grid_thw"].tolist()
    assert torch.equal(torch.cat(rows), hf["pixel_values_videos"])


def test_decode_keeps_only_the_sampled_frames_in_order() -> None:
    clip = random_video(num_frames=12)
    every = decode(clip, list(range(12)))
    picked = decode(clip, [1, 4, 9])
    assert picked.shape == (3, 48, 64, 3)
    assert np.array_equal(picked, every[[1, 4, 9]])


@pytest.mark.parametrize(
    "data",
    [b"", b"not a video at all" * 100, random_video()[:200]],
    ids=["empty", "garbage", "truncated"],
)
def test_bytes_that_are_no_video_are_a_video_error(data: bytes) -> None:
    with pytest.raises(VideoError):
        probe(data)


def test_a_still_image_container_has_no_video_to_sample() -> None:
    rule = VideoRule()
    with pytest.raises(VideoError, match="at least 2 are needed"):
        rule.frame_indices(1, 25.0)


def test_frame_counts_follow_fps_bounds_and_the_temporal_patch() -> None:
    rule = VideoRule(fps=2.0, min_frames=4, max_frames=16)
    assert len(rule.frame_indices(300, 30.0)) == 16  # 20 wanted, capped at max_frames
    assert len(rule.frame_indices(50, 25.0)) == 4  # 4 wanted: min_frames
    assert len(rule.frame_indices(3, 30.0)) == 2  # fewer frames than min_frames: rounded down
    assert len(rule.frame_indices(110, 10.0)) == 16
    assert all(len(rule.frame_indices(n, 7.0)) % 2 == 0 for n in range(2, 80))
