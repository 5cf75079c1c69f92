"""The compiled decode step (cpu_decode.py, csrc/decode.c) against the Python
path it replaces, on each projection kernel it calls (bfloat16's, float32's):
the same kernels in the same order, so the same bits."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
import torch.nn.functional as F

from services.language.engine.engine import LLMEngine
from services.language.engine.request import Request, SamplingParams
from services.layers import cpu_kernels
from services.layers.cpu_decode import unsupported
from services.layers.cpu_kernels import silu_table
from services.layers.language_model import MLP
from services.layers.linear import KERNEL_MAX_ROWS
from services.loadgen.synthetic import random_image
from tests.language.engine_fixtures import make_engine, make_request
from tests.reference import chat

# EPD's projection kernels the compiled step calls, and the dtype each runs
KERNELS = {
    "amx": torch.bfloat16,
    "avx512bf16": torch.bfloat16,
    "avx512": torch.float32,
    "cpu": torch.float32,
}


def _kernel(linear: str) -> object:
    if linear in cpu_kernels.BF16_KINDS:
        return cpu_kernels.bf16_linear(linear)
    return cpu_kernels.f32_linear() if linear == "avx512" else cpu_kernels.linear_kernel()


@pytest.fixture(scope="module", params=list(KERNELS))
def linear(request: pytest.FixtureRequest) -> str:
    """Each projection kernel of the compiled step, where the CPU (and its build) has it."""
    if _kernel(request.param) is None:
        pytest.skip(f"this CPU has no {request.param} kernel: decode steps stay layer by layer")
    return str(request.param)


def requests(folder: Path, dtype: torch.dtype) -> list[Request]:
    """Prompts of several lengths, one with an image, one sampling two choices."""
    out = []
    for i, words in enumerate([3, 11, 40, 90]):
        prompt = " ".join(f"word{j}" for j in range(words))
        sampling = SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True, n=2 if i == 1 else 1)
        out.append(make_request(folder, f"r{i}", chat(prompt, 0), [], sampling, dtype))
    image = random_image(200, 160, seed=3)
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    out.append(make_request(folder, "img", chat("Describe it.", 1), [image], sampling, dtype))
    return out


def with_biases(engine: LLMEngine) -> LLMEngine:
    """Random QKV biases (the demo's are zeros), the same in every engine."""
    generator = torch.Generator().manual_seed(0)
    for layer in engine.runner.model.layers:
        bias = layer.self_attn.qkv_proj.bias
        bias.copy_(torch.randn(bias.shape, generator=generator))
    return engine


def step_logits(engine: LLMEngine, batch: list[Request]) -> list[torch.Tensor]:
    """Each step's logits, the requests run together to the end."""
    logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recorded(scheduled):  # type: ignore[no-untyped-def]
        out = execute(scheduled)
        logits.append(out.clone())
        return out

    engine.runner.execute = recorded  # type: ignore[method-assign]
    for request in batch:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return logits


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "small_checkpoint"])
def test_compiled_decode_steps_are_bit_equal_to_the_python_path(
    linear: str, checkpoint: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(checkpoint)
    # a small token budget: some steps mix prefill chunks with decodes (the Python path)
    python, compiled = (
        with_biases(
            make_engine(
                folder,
                dtype=KERNELS[linear],
                linear=linear,
                decode_layers=how,
                max_num_batched_tokens=64,
            )
        )
        for how in ("python", "compiled")
    )
    assert python.runner.decode is None and compiled.runner.decode is not None
    compiled.runner.decode = counting = Mock(wraps=compiled.runner.decode)
    expected = step_logits(python, requests(folder, KERNELS[linear]))
    got = step_logits(compiled, requests(folder, KERNELS[linear]))
    assert counting.call_count > 10  # the decode-only steps
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ"


def test_silu_table_is_torchs_silu_of_every_bfloat16() -> None:
    x = torch.cat([torch.randn(4096) * 8, torch.tensor([0.0, -0.0, 1e-40, -100.0, 100.0])])
    x = x.to(torch.bfloat16)
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(silu_table()[bits], F.silu(x).float())


def test_what_the_compiled_decode_does_not_run(
    tiny_checkpoint: Path, qwen3_checkpoint: Path
) -> None:
    runner = make_engine(tiny_checkpoint, dtype=torch.float32, linear="onednn").runner
    expected = "the projections are not on one of EPD's torch.float32 kernels"
    assert unsupported(runner.model, runner.attention, torch.float32) == expected
    with pytest.raises(ValueError, match="compiled decode step cannot run here: the projections"):
        make_engine(tiny_checkpoint, dtype=torch.float32, linear="onednn", decode_layers="compiled")
    runner = make_engine(tiny_checkpoint, dtype=torch.float16, linear="torch").runner
    assert "float16" in str(unsupported(runner.model, runner.attention, torch.float16))
    qwen3 = make_engine(qwen3_checkpoint, dtype=torch.bfloat16).runner
    first = qwen3.model.layers[0].mlp
    expected = "q/k norms" if isinstance(first, MLP) else "MoE layers"
    assert unsupported(qwen3.model, qwen3.attention, torch.bfloat16) == expected
    assert qwen3.decode is None


def test_a_kv_slot_outside_the_cache_fails_the_step(linear: str, tiny_checkpoint: Path) -> None:
    dtype = KERNELS[linear]
    engine = make_engine(tiny_checkpoint, dtype=dtype, linear=linear, decode_layers="compiled")
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(make_request(tiny_checkpoint, "r", chat("Hi", 0), [], sampling, dtype))
    engine.step()  # the prompt: the Python path
    runner = engine.runner
    metadata = runner._metadata

    def one_slot_past_the_cache(batch):  # type: ignore[no-untyped-def]
        meta = metadata(batch)
        meta.slot_mapping[0] = runner.kv_cache.layers[0][0].shape[0] * meta.page_size
        return meta

    runner._metadata = one_slot_past_the_cache  # type: ignore[method-assign]
    before = [keys.clone() for keys, _ in runner.kv_cache.layers]
    with pytest.raises(IndexError, match="outside the cache"):
        engine.step()
    after = [keys for keys, _ in runner.kv_cache.layers]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_compiled_step_takes_as_many_sequences_as_its_kernel(
    linear: str, tiny_checkpoint: Path
) -> None:
    """AMX's kernel takes up to 128 rows (oneDNN above, so the Python path); the
    AVX512-BF16 and float32 AVX-512 kernels any number; float32's AVX2 one up to 64
    (F.linear above)."""
    decode = make_engine(tiny_checkpoint, dtype=KERNELS[linear], linear=linear).runner.decode
    assert decode is not None
    limits = {"cpu": KERNEL_MAX_ROWS, "avx512": None, **cpu_kernels.Bf16Linear.MAX_ROWS}
    limit = limits[linear]
    assert decode.takes(64)
    assert decode.takes(65) == (limit != 64)
    assert decode.takes(129) == (limit is None)
    assert decode.takes(4096) == (limit is None)
