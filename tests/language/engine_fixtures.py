"""Building engine requests the way the language service does, for engine-level tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.outputs import RequestOutput
from services.language.engine.request import Request, SamplingParams, new_request
from services.language.engine.scheduler import SchedulerConfig
from services.model.checkpoint import load_language_weights, load_vision_tower
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.wire.messages import MediaGrid


def make_engine(
    checkpoint: Path,
    kv_cache_bytes: int = 64 << 20,
    max_model_len: int = 1024,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    linear: str = "auto",
    attention: str = "auto",
    ops: str = "auto",
    cuda_graphs: bool = True,
    prefix_caching: bool = True,
    decode_threads: int = 0,
    decode_layers: str = "auto",
) -> LLMEngine:
    spec = load_spec(checkpoint)
    return LLMEngine(
        spec,
        load_language_weights(checkpoint, spec),
        load_tokenizer(checkpoint),
        EngineConfig(
            max_model_len=max_model_len,
            kv_cache_bytes=kv_cache_bytes,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            dtype=dtype,
            device=device,
            linear=linear,
            attention=attention,
            ops=ops,
            cuda_graphs=cuda_graphs,
            prefix_caching=prefix_caching,
            decode_threads=decode_threads,
            decode_layers=decode_layers,
        ),
    )


def make_request(
    checkpoint: Path,
    request_id: str,
    messages: list[dict[str, Any]],
    images: list[Image.Image],
    sampling: SamplingParams,
    dtype: torch.dtype = torch.float32,
    media_keys: Sequence[str] = (),
) -> Request:
    spec = load_spec(checkpoint)
    grids: list[MediaGrid] = []
    embeds = deepstack = None
    if images:
        pixels = load_image_processor(checkpoint)(images=images, return_tensors="pt")
        grids = [MediaGrid(*map(int, g)) for g in pixels["image_grid_thw"]]
        with torch.no_grad():
            out = load_vision_tower(checkpoint, spec, dtype=dtype)(
                pixels["pixel_values"].to(dtype), grid_thw=pixels["image_grid_thw"]
            )
        embeds = out.pooler_output
        if spec.has_deepstack:
            deepstack = torch.cat(out.deepstack_features, dim=-1)
    merge = spec.vision.spatial_merge_size
    prompt = build_prompt(
        load_tokenizer(checkpoint), spec, messages, [g.num_tokens(merge) for g in grids]
    )
    return new_request(
        request_id,
        prompt.token_ids,
        sampling,
        spec,
        grids,
        embeds,
        deepstack=deepstack,
        media_keys=media_keys,
    )


def run_to_completion(engine: LLMEngine, requests: list[Request]) -> dict[str, list[RequestOutput]]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        step_outputs, _ = engine.step()
        for output in step_outputs:
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def check_batch(
    engine: LLMEngine, requests: list[Request], expected: list[list[int]], preempts: bool
) -> None:
    """Runs the requests together: request i's tokens are expected[i], the engine
    preempted iff `preempts`, and every KV page came back."""
    out = run_to_completion(engine, requests)
    for i, request in enumerate(requests):
        assert tokens(out[request.request_id]) == expected[i], f"request {i}"
    assert (engine.scheduler.num_preemptions > 0) == preempts
    engine.blocks.allocator.check_integrity()
    assert engine.blocks.num_used_pages == 0


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def count_replays(engine: LLMEngine) -> list[int]:
    """The bucket of every decode step the engine replays from a CUDA graph, from now on."""
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs, "no decode graphs were captured"
    replayed: list[int] = []
    replay = graphs.replay

    def counting(size: int, *args: Any) -> torch.Tensor:
        replayed.append(size)
        return replay(size, *args)

    graphs.replay = counting  # type: ignore[method-assign]
    return replayed


def top_tokens(outputs: list[RequestOutput]) -> list[tuple[int, dict[int, float]]]:
    """Per token: it and its top logprobs by id (what assert_close_to_hf compares)."""
    return [
        (lp.token_id, {top.token_id: top.logprob for top in lp.top})
        for o in outputs
        for lp in o.logprobs
    ]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def pinned_request(request: Request, checkpoint: Path) -> Request:
    """The same request streamed (its embeddings to come), pinning its prefix."""
    return new_request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        load_spec(checkpoint),
        request.media_grids,
        media_keys=request.media_keys,
        streamed=True,
        pin_prefix=True,
    )
