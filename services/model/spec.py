"""ModelSpec: the architecture facts every role needs, read once from a checkpoint.

Parsed by transformers' AutoConfig, so old (flat) and new (text_config /
vision_config) Qwen2-VL / Qwen2.5-VL config.json layouts both work; the rest
of the project only sees these frozen dataclasses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class CheckpointError(ValueError):
    """A checkpoint folder is missing something or holds something wrong."""


@dataclass(frozen=True, slots=True)
class TextSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise CheckpointError(
                f"mrope_section {list(self.mrope_section)} does not cover head_dim {self.head_dim}"
            )


@dataclass(frozen=True, slots=True)
class VisionSpec:
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    deepstack_levels: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    text: TextSpec
    vision: VisionSpec
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def has_deepstack(self) -> bool:
        return self.vision.deepstack_levels > 0


def _require(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"{folder}: missing {name}")
    return path


def load_spec(folder: str | Path) -> ModelSpec:
    from transformers import AutoConfig

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    _require(folder, "config.json")
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise CheckpointError(f"{folder}/config.json: {exc}") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{folder}: model_type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
        )
    text, vision = config.text_config, config.vision_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = text.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{folder}: rope_type {rope.get('rope_type')!r} is not supported")
    return ModelSpec(
        model_type=config.model_type,
        text=TextSpec(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=text.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))),
            tie_word_embeddings=bool(
                config.tie_word_embeddings or getattr(text, "tie_word_embeddings", False)
            ),
            max_position_embeddings=text.max_position_embeddings,
        ),
        vision=VisionSpec(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            spatial_merge_size=vision.spatial_merge_size,
            out_hidden_size=getattr(vision, "out_hidden_size", None) or text.hidden_size,
            deepstack_levels=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
        ),
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        eos_token_ids=_eos_token_ids(folder, text),
    )


def _eos_token_ids(folder: Path, text_config: object) -> tuple[int, ...]:
    """generation_config.json's eos ids when present (what generate() stops on)."""
    path = folder / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if eos is None:
        eos = getattr(text_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
