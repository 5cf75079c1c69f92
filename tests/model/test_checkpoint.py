"""Loaders read only their role's tensors and refuse anything incomplete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model.checkpoint import load_language_weights, load_vision_tower, weight_files
from services.model.spec import CheckpointError, load_spec
from services.model.tokenizer import build_prompt, load_tokenizer


@pytest.fixture
def broken(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    return folder


def _rewrite(folder: Path, edit: object) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, path)


def test_language_weights_are_complete_and_exclude_vision(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    weights = load_language_weights(tiny_checkpoint, spec)
    assert not any("visual" in name for name in weights)
    assert weights["embed_tokens.weight"].shape == (spec.text.vocab_size, spec.text.hidden_size)
    on_disk = load_file(tiny_checkpoint / "model.safetensors")
    assert torch.equal(
        weights["layers.1.mlp.down_proj.weight"], on_disk["model.layers.1.mlp.down_proj.weight"]
    )
    assert torch.equal(weights["lm_head.weight"], on_disk["lm_head.weight"])


def test_vision_tower_holds_the_checkpoint_tensors(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    tower = load_vision_tower(tiny_checkpoint, spec)
    on_disk = load_file(tiny_checkpoint / "model.safetensors")
    state = tower.state_dict()
    vision = {k.removeprefix("visual."): v for k, v in on_disk.items() if k.startswith("visual.")}
    assert set(vision) == set(state)
    assert all(torch.equal(state[k], v) for k, v in vision.items())


def test_new_style_prefixes_load_too(broken: Path) -> None:
    """Newer saves use model.visual.* and model.language_model.*."""

    def rename(t: dict[str, torch.Tensor]) -> None:
        for name in list(t):
            if name.startswith("visual."):
                t["model." + name] = t.pop(name)
            elif name.startswith("model."):
                t["model.language_model." + name.removeprefix("model.")] = t.pop(name)

    _rewrite(broken, rename)
    spec = load_spec(broken)
    assert "model.visual.merger.ln_q.weight" in weight_files(broken)
    load_vision_tower(broken, spec)
    assert "layers.0.self_attn.q_proj.bias" in load_language_weights(broken, spec)


def test_missing_language_tensor_is_named(broken: Path) -> None:
    _rewrite(broken, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_proj\.bias"):
        load_language_weights(broken, load_spec(broken))


def test_wrong_language_shape_is_named(broken: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()

    _rewrite(broken, shrink)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape"):
        load_language_weights(broken, load_spec(broken))


def test_missing_vision_tensor_is_named(broken: Path) -> None:
    _rewrite(broken, lambda t: t.pop("visual.merger.ln_q.weight"))
    with pytest.raises(CheckpointError, match=r"merger\.ln_q\.weight"):
        load_vision_tower(broken, load_spec(broken))


def test_wrong_vision_shape_is_an_error(broken: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["visual.blocks.0.attn.qkv.weight"] = t["visual.blocks.0.attn.qkv.weight"][:, :-2].clone()

    _rewrite(broken, shrink)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.qkv\.weight"):
        load_vision_tower(broken, load_spec(broken))


def test_missing_weights_file(broken: Path) -> None:
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_language_weights(broken, load_spec(broken))


def test_missing_tokenizer_is_named(broken: Path) -> None:
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="missing tokenizer"):
        load_tokenizer(broken)


def test_missing_chat_template_is_named(broken: Path) -> None:
    (broken / "chat_template.jinja").unlink()
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no chat template"):
        load_tokenizer(broken)


def test_missing_config_is_named(broken: Path) -> None:
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing config\.json"):
        load_spec(broken)


def test_prompt_expands_each_image_placeholder(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    tokenizer = load_tokenizer(tiny_checkpoint)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
        }
    ]
    prompt = build_prompt(tokenizer, spec, messages, [4, 9])
    assert prompt.token_ids.count(spec.image_token_id) == 13
    assert prompt.token_ids[prompt.image_offsets[0] - 1] == spec.vision_start_token_id
    assert prompt.token_ids[prompt.image_offsets[1] + 9] == spec.vision_end_token_id
    with pytest.raises(ValueError, match="2 image placeholders"):
        build_prompt(tokenizer, spec, messages, [4])


def test_qwen3_checkpoints_load_both_expert_layouts(qwen3_checkpoint: Path, tmp_path: Path) -> None:
    """transformers 5 saves experts as [experts, out, in]; the published
    Qwen3-VL-MoE checkpoints store [experts, in, out]. Both load to the same weights,
    and the Qwen3 tensors (q_norm, k_norm, the router) are required by name."""
    spec = load_spec(qwen3_checkpoint)
    weights = load_language_weights(qwen3_checkpoint, spec)
    assert "layers.0.self_attn.q_norm.weight" in weights
    assert "layers.0.self_attn.q_proj.bias" not in weights
    folder = tmp_path / "published"
    shutil.copytree(qwen3_checkpoint, folder)

    def transpose_experts(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if ".mlp.experts." in n]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        del tensors["model.language_model.layers.1.self_attn.k_norm.weight"]

    _rewrite(folder, transpose_experts)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        load_language_weights(folder, spec)
    restore = load_file(qwen3_checkpoint / "model.safetensors")
    _rewrite(
        folder,
        lambda t: t.update(
            {
                "model.language_model.layers.1.self_attn.k_norm.weight": restore[
                    "model.language_model.layers.1.self_attn.k_norm.weight"
                ]
            }
        ),
    )
    again = load_language_weights(folder, spec)
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    if spec.text.moe is not None:
        assert weights["layers.0.mlp.experts.down_proj"].shape[1] == spec.text.hidden_size
