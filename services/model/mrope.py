"""M-RoPE positions (Qwen2-VL's 3-D rotary positions), computed in the project.

Text tokens advance all three axes together. An image of merged grid
(t, gh, gw) starting at position p takes positions

    temporal: p + ti      height: p + hi      width: p + wi

for its tokens in (t, h, w) raster order, and the text after it resumes at
p + max(gh, gw). A decode step at sequence index n has position n + delta on
all three axes, where delta = max(position) + 1 - prompt_length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.wire.messages import ImageGrid


def mrope_positions(
    token_ids: Sequence[int],
    image_token_id: int,
    grids: Sequence[ImageGrid],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Returns (positions [3, len(token_ids)] int64, delta for decode steps)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    n = ids.numel()
    positions = torch.empty(3, n, dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    pos = 0  # next position id
    i = 0  # next sequence index
    grid_iter = iter(grids)
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
        if i + count > n or not all(is_image[i : i + count]):
            raise ValueError(f"image at token {i} needs {count} consecutive placeholder tokens")
        positions[0, i : i + count] = pos + torch.arange(gt).repeat_interleave(gh * gw)
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
