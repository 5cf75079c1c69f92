"""`epd demo-model`: a small checkpoint built locally, no downloads, of one of
the served architectures: Qwen2.5-VL, Qwen3-VL (deepstack) or Qwen3-VL-MoE.

Random weights from a config (transformers' own model class and
save_pretrained), a byte-level BPE tokenizer trained on demo_corpus.txt with
Qwen2-VL's special tokens and chat template, and an image processor config
(patch 14 for Qwen2.5-VL, 16 for Qwen3-VL). The model's vocabulary is exactly
the tokenizer's, so every id the model can emit decodes to text. The same seed
gives the same files.
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from services.model.processor import (
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
)

# Qwen2-VL's special tokens, in the order its tokenizer adds them.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKENIZER_VOCAB_SIZE = 1024
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# bumped when what a demo checkpoint holds changes, so that caches are rebuilt
# (2: Qwen3-VL demos have Qwen3-VL's video processor; 3: the chat template renders tools)
DEMO_VERSION = 3


@dataclass(frozen=True, slots=True)
class DemoSize:
    """Layer sizes of a demo model; vision and text towers are set apart."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    num_experts: int  # Qwen3-VL-MoE: experts per sparse layer, 2 chosen per token

    @property
    def mrope_section(self) -> list[int]:
        # Qwen2.5-VL splits the rotary half-dimension 2:3:3 over (t, h, w).
        half = self.text_hidden // self.text_heads // 2
        t = half // 4
        h = (half - t) // 2
        return [t, h, half - t - h]

    @property
    def interleaved_mrope_section(self) -> list[int]:
        # Qwen3-VL's [24, 20, 20] of 64, scaled: h and w take 5/16 each.
        half = self.text_hidden // self.text_heads // 2
        hw = half * 5 // 16
        return [half - 2 * hw, hw, hw]

    @property
    def deepstack_visual_indexes(self) -> list[int]:
        return list(range(min(3, self.vision_layers)))

    @property
    def fullatt_block_indexes(self) -> list[int]:
        # Like the real model: full attention in every fourth block, windowed elsewhere.
        return [i for i in range(self.vision_layers) if i % 4 == 3] or [self.vision_layers - 1]


SIZES = {
    "tiny": DemoSize(128, 2, 4, 2, 256, 64, 2, 2, 128, 4),
    "small": DemoSize(512, 8, 8, 4, 1376, 512, 8, 8, 1024, 8),
    # ~0.32 B parameters (text 0.24 B, vision 0.08 B): where a decode step is bound
    # by its GEMMs' weights, as a real checkpoint's is, not by per-step overhead
    "medium": DemoSize(1024, 20, 16, 8, 2816, 768, 12, 12, 3072, 8),
    # For GPUs: FlashInfer's kernels take head_dim 64 and up (fa2's prefill rejects
    # tiny's 32), and real checkpoints decode with head_dim 128 and 4 to 8 query
    # heads a KV head (Qwen2.5-VL-3B and Qwen3-VL-30B-A3B: 8; 7B: 7); this is the
    # tiny model at those shapes (`gpu_size` for other head ratios)
    "tiny-gpu": DemoSize(1024, 2, 8, 1, 512, 64, 2, 2, 128, 4),
}


def gpu_size(heads_per_kv_head: int) -> DemoSize:
    """tiny-gpu with another query/KV head ratio (head_dim 128, one KV head)."""
    return replace(
        SIZES["tiny-gpu"], text_hidden=128 * heads_per_kv_head, text_heads=heads_per_kv_head
    )


# The chat templates a demo can carry: the project's, which renders tools as the
# Qwen3-VL and later Qwen2.5-VL templates do, or the one the Qwen2.5-VL checkpoints
# were released with, which renders none (what `--chat-template` is for).
TEMPLATES = {"tools": "chat_template.jinja", "released": "chat_template_released.jinja"}


def build_tokenizer(out_dir: Path, template_name: str = "tools") -> dict[str, int]:
    """Trains the BPE tokenizer, saves it with the chat template; returns special-token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = resources.files("services.model")
    corpus = files.joinpath("demo_corpus.txt").read_text("utf-8")
    template = files.joinpath(TEMPLATES[template_name]).read_text("utf-8")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert all(i is not None for i in ids.values()), "special tokens are trained in"
    return {t: int(i) for t, i in ids.items() if i is not None}


def build_processor_configs(out_dir: Path, arch: str = "qwen2_5_vl") -> None:
    """The image and video processor configs, with a demo's pixel bounds: Qwen2-VL's
    for qwen2_5_vl (a video frame pair is at most 256 tokens, at most 64 frames);
    for Qwen3-VL its image config with patches of 16 and its own video processor
    (a clip is at most 512 tokens, frames capped as qwen-vl-utils does)."""
    patch_size = 14 if arch == "qwen2_5_vl" else 16
    unit = patch_size * 2  # a merged token's side
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "do_convert_rgb": True,
        "resample": 3,
        "min_pixels": 4 * unit * unit,
        "max_pixels": 1280 * unit * unit,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    video = config | {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": 4 * unit * unit, "longest_edge": 256 * unit * unit},
        "fps": 2.0,
        "min_frames": 4,
        "max_frames": 64,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,
    }
    if arch != "qwen2_5_vl":
        video |= {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 32 * unit * unit, "longest_edge": 1024 * unit * unit},
            "image_mean": list(IMAGENET_STANDARD_MEAN),
            "image_std": list(IMAGENET_STANDARD_STD),
            "cap_pixels_per_frame": True,
        }
    for key in ("image_processor_type", "min_pixels", "max_pixels"):
        del video[key]
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def cached_demo_checkpoint(size: str, arch: str = "qwen2_5_vl") -> Path:
    """The demo checkpoint of a size (seed 0), built once into $EPD_CACHE_DIR, and
    again when it was built by an older DEMO_VERSION."""
    from services.runtime import env

    name = f"demo-{size}" if arch == "qwen2_5_vl" else f"demo-{arch}-{size}"
    folder = Path(env.CACHE_DIR.get()) / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One process builds it; another that wants it meanwhile (two `epd serve`
    # started together) waits for that build instead of writing the same files.
    with (folder.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the build ends, or its process
        stamp = folder / "epd_demo_version"
        current = stamp.is_file() and stamp.read_text().strip() == str(DEMO_VERSION)
        if not (folder / "model.safetensors").is_file() or not current:
            build_demo_checkpoint(folder, size=size, seed=0, arch=arch)
            stamp.write_text(f"{DEMO_VERSION}\n")
    return folder


def build_demo_checkpoint(
    out_dir: Path,
    size: str | DemoSize = "tiny",
    seed: int = 0,
    arch: str = "qwen2_5_vl",
    template: str = "tools",
) -> Path:
    """Writes a complete checkpoint folder and returns it (`size`: a name in SIZES,
    or the layer sizes themselves; `template`: a name in TEMPLATES)."""
    from transformers import GenerationConfig

    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose from {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; choose from {ARCHS}")
    spec = SIZES[size] if isinstance(size, str) else size
    out_dir.mkdir(parents=True, exist_ok=True)

    if template not in TEMPLATES:
        raise ValueError(
            f"unknown demo chat template {template!r}; choose from {sorted(TEMPLATES)}"
        )
    ids = build_tokenizer(out_dir, template)
    vocab_size = len(json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"])
    build = _qwen2_5_vl if arch == "qwen2_5_vl" else _qwen3_vl
    torch.manual_seed(seed)
    model = build(spec, vocab_size, ids, arch).eval()
    model.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out_dir)
    build_processor_configs(out_dir, arch)
    return out_dir


def _token_ids(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen2_5_vl(spec: DemoSize, vocab_size: int, ids: dict[str, int], arch: str) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_intermediate,
            "num_hidden_layers": spec.text_layers,
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": spec.text_kv_heads,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": spec.mrope_section,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            # Wider than the 0.02 default: a random model then writes varied
            # text instead of one repeated token, which makes token-for-token
            # comparisons (and the demo) say more.
            "initializer_range": 0.1,
        },
        vision_config={
            "depth": spec.vision_layers,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.text_hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": spec.fullatt_block_indexes,
            "tokens_per_second": 2,
        },
        tie_word_embeddings=False,
        **_token_ids(ids),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


# Long: the demo's config, one literal field by field, as the released checkpoints' config.json
def _qwen3_vl(spec: DemoSize, vocab_size: int, ids: dict[str, int], arch: str) -> Any:
    """Qwen3-VL, or with arch qwen3_vl_moe its MoE variant (every MLP sparse)."""
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    text: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_intermediate,
        # Deeper than the deepstack: a level added after the last layer would
        # reach no other token, and the tests could not tell it from none.
        "num_hidden_layers": max(spec.text_layers, len(spec.deepstack_visual_indexes) + 1),
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_kv_heads,
        "head_dim": spec.text_hidden // spec.text_heads,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": spec.interleaved_mrope_section,
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "initializer_range": 0.1,  # see _qwen2_5_vl
    }
    if arch == "qwen3_vl_moe":
        text |= {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": 2,
            # Neither it nor twice it equals the hidden size, like the published
            # models: an expert tensor's layout then shows in its shape (see
            # checkpoint._as_expected).
            "moe_intermediate_size": spec.text_intermediate * 3 // 8,
            "decoder_sparse_step": 1,
        }
    vision = {
        "depth": spec.vision_layers,
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_intermediate,
        "num_heads": spec.vision_heads,
        "out_hidden_size": spec.text_hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 1024,  # a 32 x 32 learned grid, interpolated per image
        "deepstack_visual_indexes": spec.deepstack_visual_indexes,
        "initializer_range": 0.1,
    }
    if arch == "qwen3_vl_moe":
        moe = Qwen3VLMoeConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **_token_ids(ids)
        )
        return Qwen3VLMoeForConditionalGeneration(moe)
    dense = Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **_token_ids(ids)
    )
    return Qwen3VLForConditionalGeneration(dense)
