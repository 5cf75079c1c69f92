"""Session fixtures: demo checkpoints are built once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.model.demo import build_demo_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_checkpoint(tmp_path_factory.mktemp("small"), size="small", seed=0)
