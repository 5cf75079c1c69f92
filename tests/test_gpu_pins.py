"""What the GPU image installs: one CUDA major version (12) throughout, and
FlashInfer at the release its prebuilt JIT cache is built for."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from services.launcher.protogen import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "docker" / "epd.Dockerfile").read_text()


@pytest.fixture(scope="module")
def gpu_extra() -> dict[str, Requirement]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    requirements = map(Requirement, pyproject["project"]["optional-dependencies"]["gpu"])
    return {r.name: r for r in requirements}


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, f"docker/epd.Dockerfile has no ARG {name}"
    return match[1]


def test_flashinfer_is_pinned_with_its_cuda_12_extra(gpu_extra: dict[str, Requirement]) -> None:
    flashinfer = gpu_extra["flashinfer-python"]
    assert "cu12" in flashinfer.extras
    assert [s.operator for s in flashinfer.specifier] == ["=="]


@pytest.mark.parametrize("name", ["cuda-python", "cuda-bindings"])
def test_cuda_bindings_stay_on_cuda_12(gpu_extra: dict[str, Requirement], name: str) -> None:
    """FlashInfer asks for cuda-python>=12, which alone resolves to CUDA 13's."""
    specifier = gpu_extra[name].specifier
    assert specifier.contains("12.9.4") and not specifier.contains("13.0.0")


def test_the_image_installs_the_jit_cache_of_the_pinned_release(
    gpu_extra: dict[str, Requirement],
) -> None:
    version = _arg("FLASHINFER_VERSION")
    assert gpu_extra["flashinfer-python"].specifier == SpecifierSet(f"=={version}")
    assert '"flashinfer-jit-cache==$FLASHINFER_VERSION"' in DOCKERFILE
    # the cache's CUDA build is torch's
    assert _arg("FLASHINFER_INDEX").rsplit("/", 1)[1] == _arg("TORCH_INDEX").rsplit("/", 1)[1]
