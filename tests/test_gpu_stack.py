"""On one GPU, with real processes (GPU only): Triton's vision tower on the GPU
(KIND_GPU, configs/gpu.pbtxt) and a real `epd encoder` writing embeddings over
CUDA IPC into a language instance's GPU pool while its engine steps; and a cold
`epd language` start timed against compose's health-check window.

The receiving language instances run in this process, so that what landed in
their pools can be read; the same encoder's cached embeddings, sent once over
CUDA IPC and once over the gRPC stream, must arrive bit-equal."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from services.language.engine.config import EngineConfig
from services.launcher.protogen import REPO_ROOT
from services.launcher.serve import grpc_serving
from services.model.demo import build_demo_checkpoint
from services.runtime.ports import free_port
from services.triton.launcher import TritonConfig, TritonServer
from services.wire.transport import Transport
from tests.embeddings import tower_embeddings
from tests.language.test_epd_service import collect, text_request
from tests.processes import epd_process, wait_for
from tests.stack import language_stub, start_broker, start_language
from tests.transfer.test_transfer_e2e import encode_into, images

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(
    max_model_len=2048, kv_cache_bytes=256 << 20, dtype=torch.bfloat16, device="cuda"
)


async def test_cuda_ipc_lands_bit_exact_while_the_engine_steps(
    gpu_checkpoint: Path, tmp_path: Path
) -> None:
    triton_config = TritonConfig(
        checkpoint=gpu_checkpoint,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        model_config_name="gpu",
        dtype="bfloat16",
    )
    broker = await start_broker()
    ipc = await start_language(gpu_checkpoint, broker, ENGINE, transports=(Transport.CUDA_IPC,))
    grpc_in = await start_language(gpu_checkpoint, broker, ENGINE, transports=(Transport.GRPC,))
    port = free_port()
    encoder_args = [
        "encoder",
        *("--checkpoint", str(gpu_checkpoint), "--port", str(port), "--metrics-port", "0"),
        *("--broker", broker.address, "--instance-id", "encoder-gpu", "--dtype", "bfloat16"),
        *("--triton", triton_config.grpc_url, "--transports", "cuda_ipc,grpc"),
    ]
    try:
        with (
            TritonServer(triton_config),
            epd_process(encoder_args, tmp_path / "encoder.log") as encoder,
        ):
            address = f"127.0.0.1:{port}"
            await asyncio.to_thread(wait_for, lambda: grpc_serving(address), 120, "the encoder")
            # engine steps run on the receiving instance all along
            steps = asyncio.ensure_future(
                collect(
                    language_stub(ipc).Generate(
                        text_request("busy", "Tell me a story", max_tokens=256, ignore_eos=True)
                    )
                )
            )
            data = images(3, seed=5)
            landed = {}
            for name, language in (("ipc", ipc), ("grpc", grpc_in)):
                await language.receiver.expect(name, 0)
                await encode_into(broker, ("encoder-gpu", address), language, name, data)
                await language.receiver.wait(name)
                landed[name] = (await language.receiver.take(name))["embeddings"].cpu()
            assert not steps.done(), "the engine should still be stepping"
            tokens, _, finish = await steps
            assert len(tokens) == 256 and finish == "FINISH_REASON_LENGTH"
            assert encoder.poll() is None
        # the second send came from the encoder's cache: the same bytes, two transports
        assert torch.equal(landed["ipc"], landed["grpc"])
        reference = tower_embeddings(gpu_checkpoint, data)  # float32, on the CPU
        torch.testing.assert_close(landed["ipc"].float(), reference, atol=5e-2, rtol=5e-2)
        for language in (ipc, grpc_in):
            assert language.pool.allocator.num_used_blocks == 0
    finally:
        for server in (ipc, grpc_in, broker):
            await server.stop()


def _seconds(duration: str) -> float:
    """A compose duration ("20m", "90s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_a_cold_start_fits_the_compose_health_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`epd language` on the Qwen3-VL-MoE demo at head_dim 128 in bf16 (FlashInfer
    attention and fused MoE, autotuned, and CUDA graphs), from an empty
    FlashInfer workspace: serving within the time compose's health check gives
    it (its start period, then its retries)."""
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    check = compose["services"]["language"]["healthcheck"]
    window = _seconds(check["start_period"]) + check["retries"] * _seconds(check["interval"])
    checkpoint = build_demo_checkpoint(tmp_path / "moe", size="tiny-gpu", arch="qwen3_vl_moe")
    port = free_port()
    args = [
        "language",
        *("--checkpoint", str(checkpoint), "--port", str(port), "--metrics-port", "0"),
        *("--device", "cuda", "--dtype", "bfloat16", "--kv-cache-mb", "512"),
    ]
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "flashinfer"))  # empty
    started = time.monotonic()
    with epd_process(args, tmp_path / "language.log") as language:
        wait_for(lambda: grpc_serving(f"127.0.0.1:{port}"), window, "a cold language start")
        took = time.monotonic() - started
        assert language.poll() is None
    print(f"cold start from an empty FlashInfer workspace: {took:.0f} s of a {window:.0f} s window")
