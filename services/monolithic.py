"""LocalBackend: the monolithic baseline, everything in the gateway's process.

No Triton, no broker, no transfer: images are preprocessed in a thread pool
(as a server's input processing does), the vision tower runs inside the
engine loop before each step (blocking every running request while it
encodes), and the engine generates. The gateway's API and the language
side's frontend and engine are the disaggregated stack's own, so the two
compare like for like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.encoder.preprocess import Preprocessor
from services.gateway.backend import GenerateCall, MediaData, Responses
from services.gateway.errors import ApiError
from services.language.engine.async_engine import AsyncEngine
from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.outputs import RequestFailedError
from services.language.engine.vision import VisionTower
from services.language.frontend import Frontend, Media
from services.layers.vision_tower import fuse_vision_tower
from services.media.decode import BadImageError
from services.media.limits import ImageLimits
from services.model.checkpoint import load_language_weights, load_vision_tower
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer


class LocalBackend:
    def __init__(
        self,
        checkpoint: Path,
        model_name: str,
        engine: EngineConfig,
        limits: ImageLimits,
        chat_template: Path | None = None,
    ) -> None:
        self.model_name = model_name
        spec = load_spec(checkpoint)
        tokenizer = load_tokenizer(checkpoint, chat_template)
        device = torch.device(engine.device)
        tower = load_vision_tower(checkpoint, spec, dtype=engine.dtype, device=device)
        fuse_vision_tower(tower)  # as Triton's tower is
        vision = VisionTower(tower, spec.vision.spatial_merge_size, device)
        weights = load_language_weights(checkpoint, spec, engine.dtype)
        self.engine = AsyncEngine(LLMEngine(spec, weights, tokenizer, engine, vision))
        self.frontend = Frontend(self.engine, tokenizer, spec)
        self.preprocessor = Preprocessor(checkpoint, limits)

    async def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        await self.engine.stop()
        self.frontend.close()
        self.preprocessor.close()

    async def models(self) -> list[str]:
        return [self.model_name]

    async def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; served: {self.model_name}",
                param="model",
                code="model_not_found",
            )

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "components": {"monolithic": {"state": "serving"}}}

    async def generate(self, call: GenerateCall) -> Responses:
        """The frontend's steps, with the images preprocessed here (their pixels
        encoded by the engine's own vision tower) in place of receiving them."""
        call.record.language = "monolithic"
        try:
            rendered = await self.frontend.render(call.request)
            media = await self._preprocess(call.media)
            rendered = await self.frontend.rebuild(rendered, media.grids)
            request = self.frontend.engine_request(rendered, media)
            outputs = self.frontend.stream(self.frontend.outputs(request))
            first = await anext(outputs)  # validation errors surface here
        except (BadImageError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        except RequestFailedError as exc:
            raise ApiError(500, f"generation failed: {exc}") from None
        yield first
        try:
            async for response in outputs:
                yield response
        except RequestFailedError as exc:
            raise ApiError(500, f"generation failed: {exc}") from None

    async def _preprocess(self, media: tuple[MediaData, ...]) -> Media:
        videos = {i for i, m in enumerate(media) if m.is_video}
        pre = await self.preprocessor.preprocess(list(enumerate(m.data for m in media)), videos)
        if not pre:
            return Media()
        pixels = torch.cat([torch.from_numpy(p.pixel_values) for p in pre])
        return Media(tuple(p.grid for p in pre), pixel_values=pixels)
