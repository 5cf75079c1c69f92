"""Video header, frame sampling and preprocessing against transformers'
Qwen2VLVideoProcessor and Qwen3VLVideoProcessor (bit-exact pixels), and
Qwen3-VL's timestamped video prompt against its processor, on clips made here
with PyAV."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.loadgen.synthetic import random_video
from services.model.demo import build_demo_checkpoint
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer, render_chat
from services.model.video import (
    Qwen3VideoRule,
    VideoError,
    VideoRule,
    decode,
    preprocess,
    probe,
)
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


# Qwen3-VL: its own sampling (no rounding to the temporal patch), a pixel budget
# for the whole clip (capped per frame in the demo, as qwen-vl-utils does) and
# timestamps in the prompt


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("qwen3"), size="tiny", arch="qwen3_vl")


QWEN3_CLIPS = [
    random_video(num_frames=30, width=64, height=48, fps=10),  # 6 frames
    random_video(num_frames=5, width=90, height=50, fps=2, seed=1),  # 5: the last one repeated
    random_video(num_frames=7, width=90, height=50, fps=4, seed=2),  # min_frames
    random_video(num_frames=130, width=160, height=120, fps=3, seed=3),  # max_frames; the cap
]


def _uncapped(checkpoint: Path, tmp: Path) -> Path:
    """The checkpoint's configs with transformers' default per-frame rule (no cap)."""
    folder = tmp / "uncapped"
    folder.mkdir()
    for name in ("config.json", "video_preprocessor_config.json"):
        (folder / name).write_text((checkpoint / name).read_text())
    config = json.loads((folder / "video_preprocessor_config.json").read_text())
    del config["cap_pixels_per_frame"]
    (folder / "video_preprocessor_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("capped", [True, False], ids=["capped", "uncapped"])
def test_qwen3_sampling_and_pixels_equal_transformers(
    qwen3_checkpoint: Path, tmp_path: Path, capped: bool
) -> None:
    folder = qwen3_checkpoint if capped else _uncapped(qwen3_checkpoint, tmp_path)
    rule = VideoRule.from_checkpoint(folder)
    assert isinstance(rule, Qwen3VideoRule) and rule.cap_pixels_per_frame == capped
    infos = [probe(clip) for clip in QWEN3_CLIPS]
    whole = [decode(c, list(range(i.num_frames))) for c, i in zip(QWEN3_CLIPS, infos, strict=True)]
    hf = hf_video_pixels(folder, whole, [info.fps for info in infos], tmp_path)

    rows, grids = [], []
    for clip, info, indices in zip(QWEN3_CLIPS, infos, hf["indices"], strict=True):
        assert rule.frame_indices(info.num_frames, info.fps) == indices
        pixels, grid = preprocess(decode(clip, indices), rule)
        header = rule.grid(info)
        assert (grid.t, grid.h, grid.w) == (header.t, header.h, header.w)
        assert len(header.frame_seconds) == header.t
        rows.append(pixels)
        grids.append([grid.t, grid.h, grid.w])
    assert grids == hf["video_grid_thw"].tolist()
    assert torch.equal(torch.cat(rows), hf["pixel_values_videos"])
    # the cap decides the size of the long clip's frames, and nothing else here
    assert (grids[3] == [32, 8, 10]) == capped  # uncapped: a smaller frame


def test_qwen3_prompt_equals_the_processors_with_timestamps(
    qwen3_checkpoint: Path, tmp_path: Path
) -> None:
    """Two videos and text: per temporal patch `<t seconds>`, then the patch's
    tokens between vision start and end, token for token as transformers'
    Qwen3VLProcessor writes them."""
    rule = VideoRule.from_checkpoint(qwen3_checkpoint)
    tokenizer = load_tokenizer(qwen3_checkpoint)
    spec = load_spec(qwen3_checkpoint)
    clips = QWEN3_CLIPS[:2]
    infos = [probe(clip) for clip in clips]
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "video"}],
        }
    ]
    whole = [decode(c, list(range(i.num_frames))) for c, i in zip(clips, infos, strict=True)]
    hf = hf_video_pixels(
        qwen3_checkpoint,
        whole,
        [info.fps for info in infos],
        tmp_path,
        text=render_chat(tokenizer, messages),
    )
    grids = [rule.grid(info) for info in infos]
    assert [g.frame_seconds for g in grids] == [
        pytest.approx((0.3, 1.45, 2.6)),
        (0.25, 1.25, 2.0),  # 5 frames at 2 fps: the last one fills the third patch
    ]
    prompt = build_prompt(tokenizer, spec, messages, grids)
    assert prompt.token_ids == hf["input_ids"]
    assert "<|vision_start|><0.3 seconds><|vision_start|><|video_pad|>" in tokenizer.decode(
        prompt.token_ids
    )
    assert prompt.token_ids[prompt.image_offsets[1] - 1] == spec.vision_start_token_id
    assert prompt.image_token_counts == [g.num_tokens(2) for g in grids]


def test_the_video_rule_follows_the_model_family(qwen3_checkpoint: Path, tmp_path: Path) -> None:
    folder = _uncapped(qwen3_checkpoint, tmp_path)
    config = json.loads((folder / "video_preprocessor_config.json").read_text())
    del config["video_processor_type"]  # then the model's type decides, as in transformers
    (folder / "video_preprocessor_config.json").write_text(json.dumps(config))
    assert isinstance(VideoRule.from_checkpoint(folder), Qwen3VideoRule)
    assert VideoRule.from_checkpoint(folder).mean == (0.5, 0.5, 0.5)
    assert type(VideoRule()) is VideoRule and VideoRule().frame_seconds([0, 1], 2.0) == ()


def test_qwen3_sampling_spreads_frames_from_first_to_last() -> None:
    rule = Qwen3VideoRule(fps=2.0, min_frames=4, max_frames=16)
    assert rule.frame_indices(30, 10.0) == [0, 6, 12, 17, 23, 29]
    assert len(rule.frame_indices(300, 30.0)) == 16
    assert rule.frame_indices(3, 30.0) == [0, 1, 2]  # odd: the last frame fills the patch
    assert rule.frame_seconds([0, 1, 2], 2.0) == (0.25, 1.0)
    with pytest.raises(VideoError, match="at least 2 are needed"):
        rule.frame_indices(1, 25.0)
