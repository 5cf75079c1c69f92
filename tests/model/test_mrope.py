from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.model.mrope import decode_position, mrope_positions
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.wire.messages import MediaGrid


def _hf_rope_index(
    folder: Path, ids: list[int], grids: list[MediaGrid]
) -> tuple[torch.Tensor, int]:
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = AutoConfig.from_pretrained(folder)
    model = Qwen2_5_VLModel.__new__(Qwen2_5_VLModel)  # get_rope_index only reads the config
    model.config = config
    input_ids = torch.tensor([ids])
    images = [[g.t, g.h, g.w] for g in grids if not g.is_video]
    videos = [[g.t, g.h, g.w] for g in grids if g.is_video]
    # the processor's second_per_grid_ts: float32, one per video
    seconds = torch.tensor([g.second_per_grid_t for g in grids if g.is_video], dtype=torch.float32)
    positions, deltas = model.get_rope_index(
        input_ids,
        (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int(),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        second_per_grid_ts=seconds if videos else None,
    )
    return positions[:, 0], int(deltas[0, 0])


GRID_SETS = [
    [],
    [MediaGrid(1, 16, 16)],
    [MediaGrid(1, 4, 30)],
    [MediaGrid(1, 36, 6), MediaGrid(1, 2, 2), MediaGrid(1, 22, 36)],
    [MediaGrid(4, 8, 12, second_per_grid_t=1.0)],  # a video sampled at 2 fps
    # videos (frame rates that give fractional time steps) between images
    [
        MediaGrid(1, 4, 4),
        MediaGrid(3, 6, 4, second_per_grid_t=2 / 3.3),
        MediaGrid(8, 2, 2, second_per_grid_t=0.7),
        MediaGrid(1, 6, 8),
    ],
    [MediaGrid(30, 2, 2, second_per_grid_t=2 / 1.5)],  # time outruns the spatial extent
]


@pytest.mark.parametrize("grids", GRID_SETS)
def test_positions_equal_get_rope_index(tiny_checkpoint: Path, grids: list[MediaGrid]) -> None:
    spec = load_spec(tiny_checkpoint)
    merge = spec.vision.spatial_merge_size
    ids: list[int] = [100, 101, 102]
    for i, grid in enumerate(grids):
        placeholder = spec.video_token_id if grid.is_video else spec.image_token_id
        ids += [spec.vision_start_token_id] + [placeholder] * grid.num_tokens(merge)
        ids += [spec.vision_end_token_id] + [200 + i] * (i + 1)
    ids += [300, 301]

    positions, delta = mrope_positions(
        ids,
        spec.image_token_id,
        grids,
        merge,
        video_token_id=spec.video_token_id,
        tokens_per_second=spec.vision.tokens_per_second,
    )
    expected, expected_delta = _hf_rope_index(tiny_checkpoint, ids, grids)
    assert torch.equal(positions, expected)
    assert delta == expected_delta


def test_decode_positions_continue_with_delta() -> None:
    grids = [MediaGrid(1, 8, 4)]
    ids = [1, 2] + [9] * 8 + [3]
    positions, delta = mrope_positions(ids, 9, grids, 2)
    # text(2) + image(4x2 merged: spans 4 positions) + text(1) => last position 2+4 = 6
    assert int(positions.max()) == 6
    assert decode_position(len(ids), delta) == 7


def test_mismatched_grids_are_errors() -> None:
    with pytest.raises(ValueError, match="more image grids"):
        mrope_positions([1, 2, 3], 9, [MediaGrid(1, 2, 2)], 2)
    with pytest.raises(ValueError, match="consecutive placeholder"):
        mrope_positions([1, 9, 9, 2], 9, [MediaGrid(1, 4, 4)], 2)
    with pytest.raises(ValueError, match="video at token 1 needs 1 consecutive"):
        mrope_positions([1, 9, 2], 9, [MediaGrid(1, 2, 2, second_per_grid_t=1.0)], 2, 8, 2)


def test_qwen3_timestamped_videos_equal_get_rope_index(qwen3_checkpoint: Path) -> None:
    """Qwen3-VL: each temporal patch of a video is its own span (grid t = 1)
    after its timestamp text; images and videos mixed, as its get_rope_index."""
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    spec = load_spec(qwen3_checkpoint)
    grids = [
        MediaGrid(3, 4, 6, second_per_grid_t=1.0, frame_seconds=(0.3, 1.45, 2.6)),
        MediaGrid(1, 6, 8),
        MediaGrid(2, 8, 2, second_per_grid_t=0.8, frame_seconds=(0.2, 14.0)),
    ]
    kinds = ["video", "image", "video"]
    messages = [
        {"role": "user", "content": [*({"type": k} for k in kinds), {"type": "text", "text": "hm"}]}
    ]
    ids = build_prompt(load_tokenizer(qwen3_checkpoint), spec, messages, grids).token_ids
    positions, delta = mrope_positions(
        ids, spec.image_token_id, grids, spec.vision.spatial_merge_size, spec.video_token_id
    )

    config = AutoConfig.from_pretrained(qwen3_checkpoint)
    model = Qwen3VLModel.__new__(Qwen3VLModel)  # get_rope_index only reads the config
    model.config = config
    input_ids = torch.tensor([ids])
    expected, deltas = model.get_rope_index(
        input_ids,
        (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int(),
        image_grid_thw=torch.tensor([[1, 6, 8]]),
        video_grid_thw=torch.tensor([[3, 4, 6], [2, 8, 2]]),
    )
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(deltas[0, 0])
