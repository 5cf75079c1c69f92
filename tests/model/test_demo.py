from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher.cli import main
from services.launcher.flags import DEMO_SIZES
from services.model.demo import (
    DEMO_VERSION,
    SIZES,
    build_demo_checkpoint,
    cached_demo_checkpoint,
    gpu_size,
)
from services.model.spec import load_spec
from services.model.tokenizer import load_tokenizer
from services.model.video import Qwen3VideoRule, VideoRule


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_files(tmp_path: Path, tiny_checkpoint: Path) -> None:
    assert main(["demo-model", str(tmp_path / "again"), "--size", "tiny", "--seed", "0"]) == 0
    assert _digest(tmp_path / "again") == _digest(tiny_checkpoint)


def test_other_seed_other_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    main(["demo-model", str(tmp_path / "seed1"), "--seed", "1"])
    a, b = _digest(tmp_path / "seed1"), _digest(tiny_checkpoint)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_vocabulary_covers_every_model_id(tiny_checkpoint: Path) -> None:
    spec = load_spec(tiny_checkpoint)
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert len(tokenizer) == spec.text.vocab_size
    assert all(tokenizer.convert_ids_to_tokens(i) is not None for i in range(spec.text.vocab_size))
    assert tokenizer.convert_ids_to_tokens(spec.image_token_id) == "<|image_pad|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in spec.eos_token_ids


def test_text_round_trips(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    text = "Describe this café, 你好 😀 — 42 apples!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_sizes(small_checkpoint: Path, tiny_checkpoint: Path) -> None:
    tiny, small = load_spec(tiny_checkpoint), load_spec(small_checkpoint)
    assert (tiny.text.hidden_size, tiny.text.num_layers) == (128, 2)
    assert (small.text.hidden_size, small.text.num_layers) == (512, 8)
    assert small.vision.out_hidden_size == 512


def test_the_flags_offer_every_size() -> None:
    assert set(DEMO_SIZES) == set(SIZES)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("ratio", [4, 7, 8])
def test_gpu_sizes_have_the_head_shapes_flashinfer_takes(
    tmp_path: Path, arch: str, ratio: int
) -> None:
    """head_dim 128 (FlashInfer's prefill rejects head dims under 64), one KV head
    for `ratio` query heads; tiny-gpu itself is Qwen3-VL-30B-A3B's ratio, 8."""
    size = SIZES["tiny-gpu"] if ratio == 8 else gpu_size(ratio)
    text = load_spec(build_demo_checkpoint(tmp_path, size=size, arch=arch)).text
    assert text.head_dim == 128
    assert (text.num_heads, text.num_kv_heads) == (ratio, 1)


def test_a_cached_demo_from_an_older_version_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3-VL demo cached before it had Qwen3-VL's video processor must not
    keep serving Qwen2-VL's video rules."""
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    folder = cached_demo_checkpoint("tiny", "qwen3_vl")
    assert isinstance(VideoRule.from_checkpoint(folder), Qwen3VideoRule)
    built = (folder / "model.safetensors").stat().st_mtime_ns
    assert cached_demo_checkpoint("tiny", "qwen3_vl") == folder  # current: kept
    assert (folder / "model.safetensors").stat().st_mtime_ns == built
    old = '{"video_processor_type": "Qwen2VLVideoProcessor"}'  # as version 1 built it
    (folder / "video_preprocessor_config.json").write_text(old)
    (folder / "epd_demo_version").unlink()
    assert type(VideoRule.from_checkpoint(folder)) is VideoRule
    cached_demo_checkpoint("tiny", "qwen3_vl")
    assert isinstance(VideoRule.from_checkpoint(folder), Qwen3VideoRule)
    assert (folder / "epd_demo_version").read_text().strip() == str(DEMO_VERSION)


def test_two_processes_wanting_the_demo_at_once_build_it_once(tmp_path: Path) -> None:
    """Two `epd serve` started together on an empty cache: one builds, the other
    waits for that build and uses it."""
    counted = (
        "import services.model.demo as demo\n"
        "build = demo.build_demo_checkpoint\n"
        "def counted(*args, **kwargs):\n"
        "    print('built', flush=True)\n"
        "    return build(*args, **kwargs)\n"
        "demo.build_demo_checkpoint = counted\n"
        "print(demo.cached_demo_checkpoint('tiny'))\n"
    )
    environment = {**os.environ, "EPD_CACHE_DIR": str(tmp_path)}
    both = [
        subprocess.Popen(
            [sys.executable, "-c", counted], stdout=subprocess.PIPE, text=True, env=environment
        )
        for _ in range(2)
    ]
    printed = [process.communicate(timeout=300)[0].splitlines() for process in both]
    assert [process.returncode for process in both] == [0, 0]
    assert sorted(lines[-1] for lines in printed) == [str(tmp_path / "demo-tiny")] * 2
    assert sum(lines.count("built") for lines in printed) == 1
    assert load_spec(tmp_path / "demo-tiny").text.num_layers > 0


def test_every_demo_size_is_a_choice_of_the_cli() -> None:
    from services.launcher.cli import build_parser
    from services.model.demo import SIZES

    for size in SIZES:
        assert build_parser().parse_args(["serve", "--demo-size", size]).demo_size == size
        assert build_parser().parse_args(["demo-model", "out", "--size", size]).size == size
