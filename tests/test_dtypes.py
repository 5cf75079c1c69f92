"""`--dtype`: names, what `auto` picks, and one dtype for every component of a stack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.launcher import options
from services.launcher.cli import build_parser
from services.launcher.flags import DTYPE_CHOICES
from services.launcher.serve import StackConfig, components
from services.layers import backends
from services.layers.backends import attention_backend, moe_backend
from services.layers.cpu_kernels import paged_decode_attention
from services.wire import dtypes
from services.wire.dtypes import resolve_dtype


def test_names_resolve_to_their_dtype() -> None:
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16", "cuda") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="auto or one of float32"):
        resolve_dtype("int8")


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_where_the_hardware_has_it(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if native else torch.float32)


def test_auto_on_this_cpu_follows_its_capabilities() -> None:
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert dtypes.native_bf16("cpu") is native
    assert resolve_dtype("auto") is (torch.bfloat16 if native else torch.float32)


def test_the_cli_refuses_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["language", "--checkpoint", "x", "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_the_cli_offers_every_dtype_name() -> None:
    assert set(DTYPE_CHOICES) == {dtypes.AUTO, *dtypes.DTYPES_BY_NAME}


def test_the_dtype_defaults_to_epd_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_DTYPE", "bfloat16")
    assert build_parser().parse_args(["serve"]).dtype == "bfloat16"
    monkeypatch.delenv("EPD_DTYPE")
    assert build_parser().parse_args(["serve"]).dtype == "auto"


def test_every_component_of_a_stack_gets_the_same_dtype(tmp_path: Path) -> None:
    config = StackConfig(tmp_path, "m", tmp_path, dtype="bfloat16", num_encoders=2)
    parts = components(config)
    assert {p.name for p in parts} >= {"triton", "language-0", "encoder-0", "encoder-1"}
    for part in parts:
        if part.name in ("broker", "gateway"):
            assert "--dtype" not in part.args
        else:
            i = part.args.index("--dtype")
            assert part.args[i + 1] == "bfloat16", part.name
    mono = components(StackConfig(tmp_path, "m", tmp_path, dtype="bfloat16", monolithic=True))
    assert mono[0].args[mono[0].args.index("--dtype") + 1] == "bfloat16"


def test_float32_on_cuda_falls_back_to_torch_attention(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "flashinfer_installed", lambda: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attention_backend("auto", torch.bfloat16, cuda) == "flashinfer"
    kernel = "cpu" if paged_decode_attention() is not None else "torch"
    assert attention_backend("auto", torch.bfloat16, cpu) == kernel  # test_cpu_attention.py
    with caplog.at_level("INFO"):
        assert attention_backend("auto", torch.float32, cuda) == "torch"
    assert "FlashInfer has no float32 kernels" in caplog.text
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        attention_backend("flashinfer", torch.float32, cuda)


def test_cuda_without_flashinfer_falls_back_to_torch(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU host without the `gpu` extra serves, on torch's attention and experts
    (the H100 lent to this project had no FlashInfer), and says why."""
    monkeypatch.setattr(backends, "flashinfer_installed", lambda: False)
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING"):
        assert attention_backend("auto", torch.bfloat16, cuda) == "torch"
        assert moe_backend("auto", torch.float16, cuda) == "torch"
    assert caplog.text.count("FlashInfer is not installed") == 2
    assert attention_backend("flashinfer", torch.bfloat16, cuda) == "flashinfer"  # asked for


@pytest.mark.parametrize("instance", ["language", "monolithic"])
def test_serve_passes_its_engine_flags_to_the_engine(instance: str) -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--attention", "torch", "--max-num-seqs", "8"])
    args = parser.parse_args(
        [instance, "--checkpoint", "x", *options.passed(options.MONOLITHIC, serve)]
    )
    assert (args.attention, args.max_num_seqs) == ("torch", 8)
