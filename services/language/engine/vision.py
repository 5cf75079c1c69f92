"""VisionTower: image encoding inside the engine loop, for monolithic serving.

This is what a non-disaggregated server does: before a step, the vision
tower encodes the new requests' images in one forward, and every running
request waits for it. `epd serve --monolithic` uses it as the baseline the
disaggregated stack is measured against.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from services.language.engine.request import Request


class VisionTower:
    def __init__(self, tower: torch.nn.Module, merge_size: int, device: torch.device) -> None:
        self.tower = tower
        self.merge_size = merge_size
        self.device = device

    @torch.inference_mode()
    def encode_pending(self, requests: Iterable[Request]) -> int:
        """Encodes every request that still has pixels; returns how many images."""
        pending = [r for r in requests if r.pixel_values is not None]
        if not pending:
            return 0
        pixels = torch.cat([r.pixel_values for r in pending if r.pixel_values is not None])
        grids = torch.tensor([[g.t, g.h, g.w] for r in pending for g in r.media_grids])
        out = self.tower(pixels.to(self.device), grid_thw=grids.to(self.device))
        sizes = [sum(g.num_tokens(self.merge_size) for g in r.media_grids) for r in pending]
        levels = getattr(out, "deepstack_features", None)  # Qwen3-VL: [tokens, hidden] per level
        deepstack = torch.split(torch.cat(levels, dim=-1), sizes) if levels else None
        embeds = torch.split(out.pooler_output, sizes)
        for i, request in enumerate(pending):
            request.media_embeds = embeds[i]
            request.deepstack = deepstack[i] if deepstack is not None else None
            request.pixel_values = None
        return len(grids)
