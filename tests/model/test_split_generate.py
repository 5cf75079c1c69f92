"""The disaggregated split, checked against HF generate() before any service exists:
the vision tower and the language weights loaded separately by the project's
loaders, embeddings spliced at the placeholders, the project's 3-D positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.loadgen.synthetic import random_image
from services.model.checkpoint import load_language_weights, load_vision_tower
from services.model.mrope import decode_position, mrope_positions
from services.model.processor import load_image_processor
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.wire.messages import MediaGrid
from tests.reference import chat, hf_greedy


def split_greedy(
    folder: Path, messages: list[dict[str, Any]], images: list[Image.Image], max_new_tokens: int
) -> list[int]:
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    spec = load_spec(folder)
    tokenizer = load_tokenizer(folder)
    embeds = torch.empty(0, spec.text.hidden_size)
    grids: list[MediaGrid] = []
    if images:
        pixels = load_image_processor(folder)(images=images, return_tensors="pt")
        grids = [MediaGrid(*map(int, g)) for g in pixels["image_grid_thw"]]
        tower = load_vision_tower(folder, spec)
        with torch.no_grad():
            embeds = tower(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output
    merge = spec.vision.spatial_merge_size
    prompt = build_prompt(tokenizer, spec, messages, [g.num_tokens(merge) for g in grids])
    positions, delta = mrope_positions(prompt.token_ids, spec.image_token_id, grids, merge)

    weights = load_language_weights(folder, spec)
    lm_head = weights.pop("lm_head.weight")
    text_model = Qwen2_5_VLTextModel._from_config(AutoConfig.from_pretrained(folder).text_config)
    text_model.load_state_dict(weights, strict=True)
    text_model.eval()

    ids = list(prompt.token_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token_ids = torch.tensor(ids)
            x = text_model.embed_tokens(token_ids)
            x[token_ids == spec.image_token_id] = embeds
            pos = torch.cat(
                [
                    positions,
                    torch.tensor(
                        [decode_position(i, delta) for i in range(len(prompt.token_ids), len(ids))],
                        dtype=torch.long,
                    ).expand(3, -1),
                ],
                dim=1,
            )
            hidden = text_model(inputs_embeds=x[None], position_ids=pos[:, None, :])
            next_id = int((hidden.last_hidden_state[0, -1] @ lm_head.T).argmax())
            out.append(next_id)
            ids.append(next_id)
            if next_id in spec.eos_token_ids:
                break
    return out


CASES = [
    (0, "Hello there! Tell me a story about the sea."),
    (1, "Describe this image in one sentence."),
    (3, "Compare the three pictures."),
]


def _images(n: int) -> list[Image.Image]:
    sizes = [(224, 224), (320, 200), (150, 420)]
    return [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes[:n])]


@pytest.mark.parametrize(("num_images", "text"), CASES)
def test_split_equals_hf_generate_tiny(tiny_checkpoint: Path, num_images: int, text: str) -> None:
    messages = chat(text, num_images)
    images = _images(num_images)
    expected = hf_greedy(tiny_checkpoint, messages, images, max_new_tokens=24)
    assert len(expected) > 0
    assert split_greedy(tiny_checkpoint, messages, images, max_new_tokens=24) == expected


@pytest.mark.slow
@pytest.mark.parametrize(("num_images", "text"), CASES)
def test_split_equals_hf_generate_small(small_checkpoint: Path, num_images: int, text: str) -> None:
    messages = chat(text, num_images)
    images = _images(num_images)
    expected = hf_greedy(small_checkpoint, messages, images, max_new_tokens=12)
    assert split_greedy(small_checkpoint, messages, images, max_new_tokens=12) == expected


def test_images_change_the_output(tiny_checkpoint: Path) -> None:
    """The comparison above means something only if the image embeddings matter."""
    messages = chat("Describe this image.", 1)
    a = hf_greedy(tiny_checkpoint, messages, [random_image(224, 224, seed=1)], 12)
    b = hf_greedy(tiny_checkpoint, messages, [random_image(224, 224, seed=2)], 12)
    assert a != b
