"""Role-specific weight loading: each role reads only the tensors it needs.

Qwen2.5-VL checkpoints store `visual.*`, `model.*` and `lm_head.weight`;
newer saves (and every Qwen3-VL checkpoint) use `model.visual.*` and
`model.language_model.*`. Both are accepted. Every load is strict: a
missing, unexpected or misshapen tensor is a CheckpointError naming it, never
a silently random weight.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from services.model.spec import CheckpointError, ModelSpec

logger = logging.getLogger(__name__)

VISION_PREFIXES = ("visual.", "model.visual.")
LANGUAGE_PREFIXES = ("model.language_model.", "model.")


def weight_files(folder: Path) -> dict[str, Path]:
    """Maps every tensor name in the checkpoint to the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{folder}: missing weight shard {path.name}")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def expected_language_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical language tensor names (no prefix) and their shapes."""
    t = spec.text
    q_dim, kv_dim = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (t.vocab_size, t.hidden_size),
        "norm.weight": (t.hidden_size,),
    }
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = (t.vocab_size, t.hidden_size)
    for i in range(t.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (t.hidden_size,),
            p + "post_attention_layernorm.weight": (t.hidden_size,),
            p + "self_attn.q_proj.weight": (q_dim, t.hidden_size),
            p + "self_attn.k_proj.weight": (kv_dim, t.hidden_size),
            p + "self_attn.v_proj.weight": (kv_dim, t.hidden_size),
            p + "self_attn.o_proj.weight": (t.hidden_size, q_dim),
        }
        if t.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_dim,),
                p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.bias": (kv_dim,),
            }
        if t.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (t.hidden_size,)
        if t.qk_norm:
            shapes |= {
                p + "self_attn.q_norm.weight": (t.head_dim,),
                p + "self_attn.k_norm.weight": (t.head_dim,),
            }
        if t.moe is not None and i in t.moe.layers:
            e, inter = t.moe.num_experts, t.moe.intermediate_size
            shapes |= {
                p + "mlp.gate.weight": (e, t.hidden_size),
                p + "mlp.experts.gate_up_proj": (e, 2 * inter, t.hidden_size),
                p + "mlp.experts.down_proj": (e, t.hidden_size, inter),
            }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (t.intermediate_size, t.hidden_size),
                p + "mlp.up_proj.weight": (t.intermediate_size, t.hidden_size),
                p + "mlp.down_proj.weight": (t.hidden_size, t.intermediate_size),
            }
    return shapes


def _as_expected(
    tensor: torch.Tensor, canonical: str, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The tensor in its expected shape, or None. Expert tensors come in either
    layout: [experts, out, in] as transformers 5 keeps and saves them, or
    [experts, in, out] as the published Qwen3-VL-MoE checkpoints store them;
    like transformers' loader, a tensor already in the expected shape is taken
    as it is (so a square one is read as transformers reads it), otherwise its
    last two dimensions are swapped."""
    if tuple(tensor.shape) == shape:
        return tensor
    if ".mlp.experts." in canonical and tuple(tensor.transpose(1, 2).shape) == shape:
        return tensor.transpose(1, 2).contiguous()
    return None


def _canonical_language_name(name: str) -> str | None:
    if name == "lm_head.weight":
        return name
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix in LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def load_language_weights(
    folder: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The language model's tensors by canonical name; the vision tower is never read.

    With tied embeddings `lm_head.weight` is the embedding tensor itself.
    """
    folder = Path(folder)
    files = weight_files(folder)
    expected = expected_language_shapes(spec)
    located: dict[str, tuple[str, Path]] = {}
    for name, path in files.items():
        canonical = _canonical_language_name(name)
        if canonical is None:
            continue
        if canonical == "lm_head.weight" and spec.text.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy
        if canonical not in expected:
            raise CheckpointError(f"{folder}: unexpected language tensor {name}")
        located[canonical] = (name, path)
    missing = sorted(set(expected) - set(located))
    if missing:
        raise CheckpointError(f"{folder}: missing language tensors: {', '.join(missing[:8])}")

    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for canonical, (name, path) in located.items():
        by_file.setdefault(path, []).append((canonical, name))
    for path, names in by_file.items():
        with safe_open(path, "pt") as f:
            for canonical, name in names:
                tensor = f.get_tensor(name)
                shaped = _as_expected(tensor, canonical, expected[canonical])
                if shaped is None:
                    raise CheckpointError(
                        f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {expected[canonical]}"
                    )
                weights[canonical] = shaped.to(dtype)
    if spec.text.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """from_pretrained prints a load report listing every language tensor it skipped."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def vision_tower_class(model_type: str) -> type[torch.nn.Module]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    classes: dict[str, type[torch.nn.Module]] = {
        "qwen2_vl": Qwen2VisionTransformerPretrainedModel,
        "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
        "qwen3_vl": Qwen3VLVisionModel,
        "qwen3_vl_moe": Qwen3VLMoeVisionModel,
    }
    return classes[model_type]


def _tensor_shapes(files: dict[str, Path], names: list[str]) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers, without reading any data."""
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        with safe_open(path, "pt") as f:
            for name in file_names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _check_vision_tensors(folder: Path, cls: type[torch.nn.Module], config: object) -> None:
    """Compares the checkpoint's vision tensors with the tower's own, by name and shape."""
    files = weight_files(folder)
    stored: dict[str, str] = {}
    for name in files:
        for prefix in VISION_PREFIXES:
            if name.startswith(prefix):
                stored[name[len(prefix) :]] = name
                break
    if not stored:
        raise CheckpointError(f"{folder}: no vision tensors (visual.* or model.visual.*)")
    with torch.device("meta"):
        reference = cls._from_config(config)  # type: ignore[attr-defined]
    wanted = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(stored[n] for n in set(stored) - set(wanted))
    shapes = _tensor_shapes(files, [stored[n] for n in set(wanted) & set(stored)])
    wrong = sorted(
        f"{stored[n]} has shape {shapes[stored[n]]}, expected {wanted[n]}"
        for n in set(wanted) & set(stored)
        if shapes[stored[n]] != wanted[n]
    )
    problems = [f"missing vision tensors: {', '.join(missing[:8])}"] if missing else []
    problems += [f"unexpected vision tensors: {', '.join(unexpected[:8])}"] if unexpected else []
    problems += wrong[:8]
    if problems:
        raise CheckpointError(f"{folder}: " + "; ".join(problems))


def load_vision_tower(
    folder: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """The vision tower alone, every tensor checked loaded; language tensors are skipped."""
    from transformers import AutoConfig

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder).vision_config
    cls = vision_tower_class(spec.model_type)
    _check_vision_tensors(folder, cls, config)
    key_mapping = {"^" + re.escape(p): "" for p in VISION_PREFIXES}
    with _quiet_transformers():
        model, info = cls.from_pretrained(  # type: ignore[attr-defined]
            folder, config=config, key_mapping=key_mapping, dtype=dtype, output_loading_info=True
        )
    # Belt and braces: from_pretrained must agree that nothing was left random.
    if info["missing_keys"] or info["mismatched_keys"] or info["error_msgs"]:
        raise CheckpointError(f"{folder}: vision tower not fully loaded: {info}")
    return model.to(device).eval()
