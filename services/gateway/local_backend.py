"""LocalBackend: the monolithic baseline, everything in the gateway's process.

No Triton, no broker, no transfer: images are preprocessed in a thread pool
(as a server's input processing does), the vision tower runs inside the
engine loop before each step (blocking every running request while it
encodes), and the engine generates. Same API and same engine as the
disaggregated stack, so the two compare like for like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.encoder.images import BadImageError
from services.encoder.limits import ImageLimits
from services.encoder.preprocess import Preprocessor
from services.gateway.backend import GenerateCall, Responses
from services.gateway.errors import ApiError
from services.language.engine.engine import (
    AsyncEngine,
    EngineConfig,
    LLMEngine,
    RequestFailedError,
)
from services.language.engine.request import new_request
from services.language.engine.vision import VisionTower
from services.language.servicer import messages_from_proto, responses, sampling_from_proto
from services.model.checkpoint import load_language_weights, load_vision_tower
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, completion_prompt, load_tokenizer


class LocalBackend:
    def __init__(
        self, checkpoint: Path, model_name: str, engine: EngineConfig, limits: ImageLimits
    ) -> None:
        self.model_name = model_name
        self.spec = load_spec(checkpoint)
        self.tokenizer = load_tokenizer(checkpoint)
        device = torch.device(engine.device)
        tower = load_vision_tower(checkpoint, self.spec, dtype=engine.dtype, device=device)
        vision = VisionTower(tower, self.spec.vision.spatial_merge_size, device)
        weights = load_language_weights(checkpoint, self.spec, engine.dtype)
        self.engine = AsyncEngine(LLMEngine(self.spec, weights, self.tokenizer, engine, vision))
        self.preprocessor = Preprocessor(checkpoint, limits)
        self.max_model_len = engine.max_model_len

    async def start(self) -> None:
        self.engine.start()

    async def close(self) -> None:
        await self.engine.stop()
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
        try:
            pre = await self.preprocessor.preprocess(
                list(enumerate(call.images)), set(call.video_indices)
            )
            grids = [p.grid for p in pre]
            if call.prompt or call.prompt_token_ids:
                prompt = completion_prompt(
                    self.tokenizer, self.spec, call.prompt, call.prompt_token_ids
                )
            else:
                messages, _ = messages_from_proto(call.messages)
                prompt = build_prompt(self.tokenizer, self.spec, messages, grids)
            sampling = sampling_from_proto(
                call.sampling, self.max_model_len - len(prompt.token_ids)
            )
            grammar = await self.engine.compile_grammar(sampling)
            pixels = torch.cat([torch.from_numpy(p.pixel_values) for p in pre]) if pre else None
            request = new_request(
                call.request_id,
                prompt.token_ids,
                sampling,
                self.spec,
                grids,
                pixel_values=pixels,
                grammar=grammar,
            )
            outputs = self.engine.generate(request)
            first = await anext(outputs)  # validation errors surface here
        except (BadImageError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        except RequestFailedError as exc:
            raise ApiError(500, f"generation failed: {exc}") from None
        for response in responses(first, prompt.num_image_tokens):
            yield response
        try:
            async for output in outputs:
                for response in responses(output, prompt.num_image_tokens):
                    yield response
        except RequestFailedError as exc:
            raise ApiError(500, f"generation failed: {exc}") from None
