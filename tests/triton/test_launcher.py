"""The Triton launcher and the vit model repository."""

from __future__ import annotations

import http.server
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from services.runtime.ports import free_port
from services.transfer.shared_memory import SHM_DIR
from services.triton.launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonConfig,
    TritonError,
    TritonInstall,
    TritonServer,
)


def _config(checkpoint: Path, **overrides: object) -> TritonConfig:
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    return TritonConfig(checkpoint=checkpoint, **{**ports, **overrides})  # type: ignore[arg-type]


def _model_config(name: str) -> model_config_pb2.ModelConfig:
    text = (DEFAULT_MODEL_REPOSITORY / "vit" / name).read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize("name", ["config.pbtxt", "configs/gpu.pbtxt", "configs/shared-cpu.pbtxt"])
def test_model_configs_parse_as_triton_model_configs(name: str) -> None:
    config = _model_config(name)
    assert config.backend == "python"
    assert [i.name for i in config.input] == ["pixel_values", "image_grid_thw"]
    assert all(i.allow_ragged_batch for i in config.input)
    assert config.dynamic_batching.max_queue_delay_microseconds > 0
    kind = config.instance_group[0].kind
    expected = (
        model_config_pb2.ModelInstanceGroup.KIND_GPU
        if "gpu" in name
        else model_config_pb2.ModelInstanceGroup.KIND_CPU
    )
    assert kind == expected


def test_the_shared_cpu_config_is_the_cpu_one_one_request_a_forward() -> None:
    cpu, shared = _model_config("config.pbtxt"), _model_config("configs/shared-cpu.pbtxt")
    assert cpu.max_batch_size > 1 and shared.max_batch_size == 1
    shared.max_batch_size = cpu.max_batch_size
    assert shared == cpu


def test_missing_model_repository_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(TritonError, match=r"no vit/config\.pbtxt in model repository"):
        TritonConfig(checkpoint=tiny_checkpoint, model_repository=tmp_path)


def test_missing_wheel_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # The only way to lose the wheel inside a test: hide it from the import system.
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytriton" else real(name, *a)
    )
    with pytest.raises(TritonError, match="install the nvidia-pytriton wheel"):
        TritonInstall.find()


def test_a_model_that_fails_to_load_is_a_clear_error(tmp_path: Path) -> None:
    """A checkpoint folder that does not exist: Triton exits, the error names the cause."""
    server = TritonServer(_config(tmp_path / "no-such-checkpoint", startup_timeout_s=120))
    started = time.monotonic()
    with pytest.raises(TritonError) as info:
        server.start()
    assert "exited" in str(info.value)
    assert "no-such-checkpoint" in str(info.value)
    assert time.monotonic() - started < 60
    assert not server.running


def test_ports_another_server_holds_are_refused(tiny_checkpoint: Path) -> None:
    """A server that answers every GET with 200 on Triton's HTTP port would pass
    the readiness check for a tritonserver that cannot bind it: refused, named,
    before anything starts."""

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        server = TritonServer(_config(tiny_checkpoint, http_port=port))
        with pytest.raises(TritonError, match=f"port\\(s\\) {port} on 127.0.0.1 are in use"):
            server.start()
        assert not server.running
    finally:
        other.shutdown()
        other.server_close()


def test_stop_removes_the_backend_shared_memory(tiny_checkpoint: Path) -> None:
    import tritonclient.grpc as triton_grpc

    server = TritonServer(_config(tiny_checkpoint))
    with server:
        prefix = server._shm_prefix
        assert list(SHM_DIR.glob(prefix + "*")), "the Python backend keeps its regions in /dev/shm"
        client = triton_grpc.InferenceServerClient(server.config.grpc_url)
        pixels = triton_grpc.InferInput("pixel_values", [1, 16, 1176], "FP32")
        pixels.set_data_from_numpy(np.zeros((1, 16, 1176), np.float32))
        grids = triton_grpc.InferInput("image_grid_thw", [1, 1, 3], "INT64")
        grids.set_data_from_numpy(np.array([[[1, 4, 4]]], np.int64))
        result = client.infer("vit", [pixels, grids])
        assert result.as_numpy("image_embeds").shape == (1, 4, 128)
        bad = triton_grpc.InferInput("image_grid_thw", [1, 1, 3], "INT64")
        bad.set_data_from_numpy(np.array([[[1, 4, 6]]], np.int64))
        with pytest.raises(Exception, match="covers 24 patches, pixel_values has 16"):
            client.infer("vit", [pixels, bad])
        client.close()
    assert not list(SHM_DIR.glob(prefix + "*"))


def test_the_failure_summary_names_the_models_import_error(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "repository"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, repository)
    model = repository / "vit" / "1" / "model.py"
    torch_import = "import torch  # noqa: E402"
    source = model.read_text().replace(torch_import, f"import epd_no_such_module\n{torch_import}")
    model.write_text(source)
    server = TritonServer(_config(tiny_checkpoint, model_repository=repository))
    with pytest.raises(TritonError) as info:
        server.start()
    summary = str(info.value).split("\n")
    assert summary[1] == "cause: ModuleNotFoundError: No module named 'epd_no_such_module'"


def test_starts_from_an_activated_venv(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`source .venv/bin/activate && epd triton`: the stub's libpython and standard
    library must still be the same Python."""
    venv_bin = Path(sys.executable).parent
    activated = {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv_bin.parent),
    }
    ports = [str(free_port()) for _ in range(3)]
    args = ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    process = subprocess.Popen(
        ["epd", "triton", "--checkpoint", str(tiny_checkpoint), *args],
        env=activated,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:  # until the banner, or the end if it exits
            output.append(line)
            if line.startswith("tritonserver ready"):
                break
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert output and output[-1].startswith("tritonserver ready"), "".join(output[-20:])
