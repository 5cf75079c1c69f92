"""Triton Python-backend model: the vision tower of a Qwen2-VL / Qwen2.5-VL checkpoint.

One execute() gets every request the dynamic batcher gathered (one with
configs/shared-cpu.pbtxt, which says why); their patches are concatenated, the
tower runs once, and the output is split back by image_grid_thw. Tensors cross
the backend boundary by DLPack: this Triton's as_numpy() is wrong under numpy 2.
A bad request gets an error response of its own; the others in the batch still
run.
"""

from __future__ import annotations

import json
import os
import site

# The stub runs Python in isolated mode (PYTHONPATH is ignored): the launcher
# names the site-packages that hold torch, transformers and this project.
for _path in filter(None, os.environ.get("EPD_SITE_PACKAGES", "").split(os.pathsep)):
    site.addsitedir(_path)

import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from torch.utils.dlpack import from_dlpack, to_dlpack  # noqa: E402

from services.layers.vision_tower import fuse_vision_tower  # noqa: E402
from services.model.checkpoint import load_vision_tower  # noqa: E402
from services.model.spec import load_spec  # noqa: E402
from services.runtime.malloc import keep_freed_memory  # noqa: E402
from services.wire.dtypes import resolve_dtype  # noqa: E402


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        keep_freed_memory()  # the tower's activations are megabytes each (malloc.py)
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        checkpoint = os.environ.get("EPD_VIT_CHECKPOINT") or params["checkpoint"]
        if args["model_instance_kind"] == "GPU":
            self.device = torch.device("cuda", int(args["model_instance_device_id"]))
        else:
            self.device = torch.device("cpu")
        name = os.environ.get("EPD_VIT_DTYPE") or params.get("dtype", "auto")
        dtype = resolve_dtype(name, self.device)
        self.spec = load_spec(checkpoint)
        self.merge = self.spec.vision.spatial_merge_size
        self.tower = load_vision_tower(checkpoint, self.spec, dtype=dtype, device=self.device)
        fuse_vision_tower(self.tower)  # on the CPU: faster, as vision_tower.py says
        self.dtype = dtype
        self.patch_dim = 3 * self.spec.vision.temporal_patch_size * self.spec.vision.patch_size**2

    def _read(self, request: object) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = from_dlpack(pb_utils.get_input_tensor_by_name(request, "pixel_values").to_dlpack())
        grids = from_dlpack(
            pb_utils.get_input_tensor_by_name(request, "image_grid_thw").to_dlpack()
        )
        pixels = pixels.reshape(-1, pixels.shape[-1])
        grids = grids.reshape(-1, 3).to(torch.long)
        if pixels.shape[-1] != self.patch_dim:
            raise ValueError(
                f"pixel_values rows have {pixels.shape[-1]} values, expected {self.patch_dim}"
            )
        if grids.numel() == 0 or bool((grids <= 0).any()):
            raise ValueError("image_grid_thw must hold positive (t, h, w) rows")
        if int(grids.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(
                f"image_grid_thw covers {int(grids.prod(-1).sum())} patches, "
                f"pixel_values has {pixels.shape[0]}"
            )
        if bool((grids[:, 1:] % self.merge != 0).any()):
            raise ValueError(f"grid height and width must be multiples of {self.merge}")
        return pixels, grids

    def execute(self, requests: list[object]) -> list[object]:
        responses: list[object] = [None] * len(requests)
        good: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for i, request in enumerate(requests):
            try:
                pixels, grids = self._read(request)
            except Exception as exc:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
                continue
            good.append((i, pixels, grids))
        if good:
            try:
                outputs = self._forward([p for _, p, _ in good], [g for _, _, g in good])
            except Exception as exc:
                for i, _, _ in good:
                    responses[i] = pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"vision tower failed: {exc}")
                    )
            else:
                for (i, _, _), tensors in zip(good, outputs, strict=True):
                    responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
        return responses

    @torch.inference_mode()
    def _forward(self, pixels: list[torch.Tensor], grids: list[torch.Tensor]) -> list[list[object]]:
        all_pixels = torch.cat(pixels).to(self.device, self.dtype)
        all_grids = torch.cat(grids).to(self.device)
        out = self.tower(all_pixels, grid_thw=all_grids)
        embeds = out.pooler_output  # [sum tokens, out_hidden]
        deepstack = getattr(out, "deepstack_features", None)
        tokens = [int(g.prod(-1).sum()) // (self.merge * self.merge) for g in grids]
        split_embeds = torch.split(embeds, tokens)
        split_deep = torch.split(torch.cat(list(deepstack), dim=-1), tokens) if deepstack else None
        results = []
        for j, e in enumerate(split_embeds):
            tensors = [self._output("image_embeds", e)]
            if split_deep is not None:
                tensors.append(self._output("deepstack_embeds", split_deep[j]))
            results.append(tensors)
        return results

    def _output(self, name: str, value: torch.Tensor) -> object:
        # [1, tokens, hidden]: the leading 1 is this request's batch dimension.
        value = value.to(torch.float32).unsqueeze(0).contiguous()
        return pb_utils.Tensor.from_dlpack(name, to_dlpack(value))
