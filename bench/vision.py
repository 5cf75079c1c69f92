"""The vision tower: HF's own against the one Triton serves (vision_tower.py).

    .venv/bin/python -m bench.vision [--images 4] [--size 448] [--repeat 4]

One forward of a batch of square images through each demo's vision tower
(services/layers/vision_tower.py), in float32 and in the dtype `--dtype auto`
picks here, the two towers taking turns in the same run; ms per image, the best
of `--repeat` forwards each.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import machine
from services.layers.cpu_kernels import fused_ops
from services.layers.vision_tower import fuse_vision_tower
from services.model.checkpoint import load_vision_tower
from services.model.demo import cached_demo_checkpoint
from services.model.spec import load_spec
from services.wire.dtypes import resolve_dtype


def ms_per_image(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        tower(pixels, grid_thw=grid)
    return (time.perf_counter() - started) * 1000 / grid.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--size", type=int, default=448, help="pixels a side")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    if fused_ops() is None:
        raise SystemExit("the fused kernels could not be built here (no C compiler?)")
    print(f"{machine()}; {torch.get_num_threads()} torch threads")
    print(f"{args.images} images of {args.size}x{args.size} a forward; ms per image\n")
    print(f"{'demo':<8} {'dtype':<9} {'fused':>8} {'HF':>8} {'speed-up':>9}")
    dtypes = list(dict.fromkeys([torch.float32, resolve_dtype("auto", torch.device("cpu"))]))
    for size in ("small", "medium"):
        checkpoint = cached_demo_checkpoint(size)
        spec = load_spec(checkpoint)
        vision = spec.vision
        merge = vision.spatial_merge_size
        side = args.size // vision.patch_size // merge * merge  # patches, as the processor rounds
        grid = torch.tensor([[1, side, side]] * args.images)
        for dtype in dtypes:
            hf = load_vision_tower(checkpoint, spec, dtype=dtype)
            fused = load_vision_tower(checkpoint, spec, dtype=dtype)
            fuse_vision_tower(fused)
            patch = 3 * vision.temporal_patch_size * vision.patch_size**2
            pixels = torch.randn(int(grid.prod(-1).sum()), patch).to(dtype)
            times: dict[str, list[float]] = {"fused": [], "hf": []}
            for _ in range(args.repeat + 1):  # the first of each warms up
                times["fused"].append(ms_per_image(fused, pixels, grid))
                times["hf"].append(ms_per_image(hf, pixels, grid))
            best = {name: min(ms[1:]) for name, ms in times.items()}
            print(
                f"{size:<8} {str(dtype).removeprefix('torch.'):<9} {best['fused']:>8.1f} "
                f"{best['hf']:>8.1f} {best['hf'] / best['fused']:>8.2f}x"
            )


if __name__ == "__main__":
    main()
