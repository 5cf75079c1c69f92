"""M-RoPE positions (Qwen2-VL's 3-D rotary positions), computed in the project.

Text tokens advance all three axes together. An image or video of merged grid
(t, gh, gw) starting at position p takes positions

    temporal: p + floor(ti * interval)      height: p + hi      width: p + wi

for its tokens in (t, h, w) raster order, and the text after it resumes at
p + max(gh, gw). The interval is 1 for an image; for a video it is
tokens_per_second * second_per_grid_t (Qwen2.5-VL: time positions follow the
clip's seconds), or 1 for a model without tokens_per_second (Qwen2-VL). A
Qwen3-VL video (its grid has frame_seconds) is one span per temporal patch,
each placed like an image of grid (1, gh, gw), with the patch's timestamp text
between them (transformers' Qwen3-VL get_rope_index). A decode step at
sequence index n has position n + delta on all three axes, where
delta = max(position) + 1 - prompt_length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from services.wire.messages import MediaGrid


def _spans(grids: Sequence[MediaGrid]) -> Iterator[MediaGrid]:
    """Each run of placeholders in prompt order: a grid, or each temporal patch of
    a video whose patches the prompt spells out apart (with their timestamps)."""
    for grid in grids:
        if grid.frame_seconds:
            yield from [dataclasses.replace(grid, t=1, frame_seconds=())] * grid.t
        else:
            yield grid


def mrope_positions(
    token_ids: Sequence[int],
    image_token_id: int,
    grids: Sequence[MediaGrid],
    spatial_merge_size: int,
    video_token_id: int | None = None,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """Returns (positions [3, len(token_ids)] int64, delta for decode steps).
    `grids` lists the images and videos in prompt order; a video's placeholders
    are `video_token_id`."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    n = ids.numel()
    positions = torch.empty(3, n, dtype=torch.long)
    media = {image_token_id} if video_token_id is None else {image_token_id, video_token_id}
    is_image = [t in media for t in ids.tolist()]
    pos = 0  # next position id
    i = 0  # next sequence index
    grid_iter = _spans(grids)
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            positions[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        grid = next(grid_iter, None)
        if grid is None:
            raise ValueError("more image placeholder tokens than image grids")
        gt, gh, gw = grid.t, grid.h // spatial_merge_size, grid.w // spatial_merge_size
        count = gt * gh * gw
        token = video_token_id if grid.is_video else image_token_id
        if token is None:
            raise ValueError("a video grid, but the model has no video placeholder token")
        if i + count > n or not bool((ids[i : i + count] == token).all()):
            kind = "video" if grid.is_video else "image"
            raise ValueError(f"{kind} at token {i} needs {count} consecutive placeholder tokens")
        times = torch.arange(gt)
        if grid.is_video and tokens_per_second:
            # in float32, as transformers (its processor gives second_per_grid_ts as float32)
            second = torch.tensor(grid.second_per_grid_t, dtype=torch.float32)
            times = (times * (tokens_per_second * second)).long()
        positions[0, i : i + count] = pos + times.repeat_interleave(gh * gw)
        positions[1, i : i + count] = pos + torch.arange(gh).repeat_interleave(gw).repeat(gt)
        positions[2, i : i + count] = pos + torch.arange(gw).repeat(gt * gh)
        pos += max(gh, gw)
        i += count
    if next(grid_iter, None) is not None:
        raise ValueError("more image grids than images in the prompt")
    delta = (int(positions.max()) + 1 - n) if n else 0
    return positions, delta


def decode_position(seq_index: int, delta: int) -> int:
    """Position (on all three axes) of the token at sequence index seq_index >= prompt length."""
    return seq_index + delta
