"""scripts/setup.sh installs what its command needs: `make serve` (serve) the
project and Triton, no test tool; `make test` (test) the dev extras, the video
reference's torchvision and Debian's kubectl, Prometheus, Docker and mmdebstrap.
The script itself runs; the installers it calls (the venv's pip, apt-get, id)
are stand-ins that record their arguments, so that the test takes a second and
installs nothing on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from services.launcher.protogen import REPO_ROOT

RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$LOG"\n'


def _run(mode: str, tmp_path: Path) -> list[str]:
    """What setup.sh MODE called, a line each, on a machine that has no kubectl,
    Prometheus or Docker yet."""
    venv, tools, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    tools.mkdir(exist_ok=True)
    for stand_in in (venv / "bin" / "python", tools / "apt-get"):
        stand_in.write_text(RECORDER)
        stand_in.chmod(0o755)
    (tools / "id").write_text("#!/bin/sh\necho 0\n")  # as root, where apt installs
    (tools / "id").chmod(0o755)
    for real in ("cat", "sha256sum", "cut", "dirname", "basename"):
        found = shutil.which(real)
        assert found is not None
        if not (tools / real).exists():
            (tools / real).symlink_to(found)
    environment = {"PATH": str(tools), "EPD_VENV": str(venv), "LOG": str(log)}
    done = subprocess.run(
        [shutil.which("bash") or "bash", "scripts/setup.sh", mode],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_serve_installs_no_test_tool(tmp_path: Path) -> None:
    calls = _run("serve", tmp_path)
    assert any(c.endswith("install --quiet --disable-pip-version-check -e .") for c in calls)
    assert any("nvidia-pytriton" in c for c in calls)
    assert not any(c.startswith("apt-get") for c in calls), calls
    assert not any("[dev]" in c or "torchvision" in c for c in calls), calls


def test_test_installs_the_tools_its_tests_run(tmp_path: Path) -> None:
    calls = _run("test", tmp_path)
    assert any(c.endswith("-e .[dev]") for c in calls)
    assert any("torchvision" in c for c in calls)
    installed = " ".join(c for c in calls if c.startswith("apt-get"))
    for package in ("kubectl", "prometheus", "docker.io", "mmdebstrap"):
        assert package in installed, calls


def test_a_second_run_does_nothing_and_a_test_install_serves_too(tmp_path: Path) -> None:
    _run("test", tmp_path)
    (tmp_path / "calls.log").unlink()
    assert _run("serve", tmp_path) == []
    assert _run("test", tmp_path) == []


def test_an_unknown_mode_is_refused() -> None:
    done = subprocess.run(
        ["bash", "scripts/setup.sh", "everything"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.parametrize("venv", [".venv", "elsewhere"])
def test_the_wheelhouse_reads_the_venv_setup_made(venv: str) -> None:
    """docker/wheelhouse.sh finds the venv where EPD_VENV put it, as setup.sh does."""
    script = (REPO_ROOT / "docker/wheelhouse.sh").read_text()
    line = next(line for line in script.splitlines() if line.startswith("PY="))
    shown = subprocess.run(
        ["bash", "-c", f'{line.split("#")[0]}\necho "$PY"'],
        env={**os.environ, "EPD_VENV": venv},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == f"{venv}/bin/python"
