"""Session fixtures: demo checkpoints are built once per test run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from services.model.demo import build_demo_checkpoint
from services.runtime.ports import LOWEST, ephemeral_range, free_port
from services.triton.launcher import TritonConfig, TritonServer
from tests.otlp import Collector, receiving

# Token-exact tests compare with HF in float32: every component a test starts
# (in-process or as `epd ...`) uses it, whatever `auto` would pick on this CPU.
os.environ["EPD_DTYPE"] = "float32"

# Side by side (pytest-xdist), each worker picks free ports from its own range,
# so two workers' stacks never race for one port between the pick and the bind.
if "PYTEST_XDIST_WORKER" in os.environ:
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    _share = (ephemeral_range()[0] - LOWEST) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _low = LOWEST + _worker * _share
    os.environ["EPD_FREE_PORTS"] = f"{_low}-{_low + _share - 1}"

# Side by side, tests that share what they start run on one worker, one after
# another: a package whose fixture is package- or session-wide, and the hosts
# and containers one machine holds once. Every other module is a group of its
# own. The longest groups start first, so that none is left alone at the end.
SHARED = ("tests/gateway/", "tests/chaos/", "tests/multihost/")
FIRST = (  # groups, as group() names them
    "tests/test_containers.py",
    "tests/multihost/",
    "tests/test_serve_epd.py",
    "tests/test_serve_qwen3.py",
    "tests/test_serve_video.py",
    "tests/chaos/",
)


def group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((package for package in SHARED if path.startswith(package)), path)


class _Grouped(LoadScopeScheduling):
    """xdist's scope scheduling with `group()` as the scope, in collection order."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        config.option.loadscopereorder = False
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return group(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> _Grouped:
    return _Grouped(config, log)


def _rank(item: pytest.Item) -> int:
    name = group(item.nodeid)
    return FIRST.index(name) if name in FIRST else len(FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first (FIRST); `gpu` tests need CUDA: without it they
    are skipped, and say so."""
    import torch

    items.sort(key=_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU path: written, not verified on this machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not a parameter id
            item.add_marker(skip)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    """An OTLP receiver (gRPC on the port given, HTTP on its `http_port`), one a module."""
    with receiving() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("small"), size="small", seed=0)


@pytest.fixture(scope="session")
def gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo at head_dim 128 (FlashInfer takes 64 and up), 8 query heads a
    KV head: the engine's gpu tests run on it."""
    return build_demo_checkpoint(tmp_path_factory.mktemp("tiny-gpu"), size="tiny-gpu", seed=0)


@pytest.fixture(scope="session", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Tiny Qwen3-VL and Qwen3-VL-MoE demo checkpoints (deepstack in both)."""
    arch = request.param
    return build_demo_checkpoint(tmp_path_factory.mktemp(arch), size="tiny", seed=0, arch=arch)


@pytest.fixture(scope="session")
def triton(tiny_checkpoint: Path) -> Iterator[TritonServer]:
    """One real tritonserver (from the nvidia-pytriton wheel) for the whole run."""
    config = TritonConfig(
        checkpoint=tiny_checkpoint,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    with TritonServer(config) as server:
        yield server
