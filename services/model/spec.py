"""ModelSpec: the architecture facts every role needs, read once from a checkpoint.

Parsed by transformers' AutoConfig, so old (flat) and new (text_config /
vision_config) config.json layouts both work; the rest of the project only
sees these frozen dataclasses. Two families: Qwen2-VL / Qwen2.5-VL, and
Qwen3-VL / Qwen3-VL-MoE (QK-norm, no attention biases, interleaved M-RoPE,
deepstack features from the vision tower, and in the MoE model sparse MLPs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN3_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


class CheckpointError(ValueError):
    """A checkpoint folder is missing something or holds something wrong."""


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Sparse MLPs: each token goes to its top_k experts (weights renormalised)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]  # the decoder layers whose MLP is sparse


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
    qkv_bias: bool = True  # Qwen2: q/k/v projections with bias, o_proj without
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before the rotary
    mrope_interleaved: bool = False  # Qwen3-VL: t/h/w frequencies interleaved, not in blocks
    moe: MoeSpec | None = None

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
    # Qwen2.5-VL: video M-RoPE time positions per second; None: one per temporal patch.
    tokens_per_second: float | None = None


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
    qwen3 = config.model_type in QWEN3_MODEL_TYPES
    bias = bool(getattr(text, "attention_bias", False))
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
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20) if qwen3 else (16, 24, 24))),
            # As transformers decides it: the whole model's flag, not text_config's
            # (Qwen3-VL-MoE's text config defaults to True under an untied model).
            tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=text.max_position_embeddings,
            qkv_bias=bias if qwen3 else True,
            o_bias=bias if qwen3 else False,
            qk_norm=qwen3,
            mrope_interleaved=qwen3,
            moe=_moe(text) if config.model_type == "qwen3_vl_moe" else None,
        ),
        vision=VisionSpec(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            spatial_merge_size=vision.spatial_merge_size,
            out_hidden_size=getattr(vision, "out_hidden_size", None) or text.hidden_size,
            deepstack_levels=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
            tokens_per_second=getattr(vision, "tokens_per_second", None),
        ),
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        eos_token_ids=_eos_token_ids(folder, text),
    )


def _moe(text: Any) -> MoeSpec | None:
    """Which layers are sparse: as transformers decides it (Qwen3VLMoeTextDecoderLayer)."""
    num_experts = int(getattr(text, "num_experts", 0))
    if num_experts <= 0:
        return None
    step = int(getattr(text, "decoder_sparse_step", 1))
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    layers = tuple(
        i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0
    )
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(text.num_experts_per_tok),
        intermediate_size=int(text.moe_intermediate_size),
        layers=layers,
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
