"""`epd serve`'s supervision, on components that are real child processes."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest

from services.launcher.serve import Component, Stack, StackConfig, StackError, grpc_serving
from services.runtime.ports import free_port


def _stack(tmp_path: Path, part: Component, **config: object) -> tuple[Stack, list[str]]:
    said: list[str] = []
    stack = Stack(
        StackConfig(checkpoint=tmp_path, model_name="m", log_dir=tmp_path, **config),  # type: ignore[arg-type]
        say=said.append,
    )
    stack.parts = [part]
    part.start(stack.environment)
    return stack, said


def _watch_until(stack: Stack, done: object, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "supervision did not get there"
        stack.watch()
        time.sleep(0.05)


def test_a_component_that_dies_is_restarted_and_its_log_keeps_the_crash(tmp_path: Path) -> None:
    port = free_port()
    # The first run dies at once (`epd health` of a dead port: exit code 1); its
    # restart is a broker that comes up.
    part = Component(
        "flaky",
        ["health", "127.0.0.1:1"],
        healthy=partial(grpc_serving, f"127.0.0.1:{port}"),
        log=tmp_path / "flaky.log",
    )
    stack, said = _stack(tmp_path, part, restart_backoff_s=0.2)
    _watch_until(stack, lambda: bool(said))
    assert said[0].startswith(
        "flaky exited (exit code 1); restarting in 0.2s (restart 1 of 5 allowed within 60s)"
    )
    part.args = ["broker", "--port", str(port)]
    _watch_until(stack, lambda: said[-1] == "flaky is serving again")
    log = part.log.read_text()
    assert log.count("=== flaky started at") == 2
    assert "NOT_SERVING" in log  # the first run's output is still there
    stack.stop()


def test_a_component_that_keeps_dying_stops_the_stack(tmp_path: Path) -> None:
    part = Component(
        "doomed", ["health", "127.0.0.1:1"], healthy=lambda: False, log=tmp_path / "doomed.log"
    )
    stack, said = _stack(tmp_path, part, max_restarts=2, restart_backoff_s=0.2)
    with pytest.raises(StackError, match=r"doomed keeps failing: 2 restarts within 60s"):
        _watch_until(stack, lambda: False)
    assert len([line for line in said if "restarting in" in line]) == 2
    assert "restarting in 0.4s" in said[1]  # the backoff doubles
    stack.stop()
