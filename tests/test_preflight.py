"""`epd serve` refuses a configuration that cannot work before it starts
anything: one line on stderr naming the flag to change, exit code 2, no
traceback. A child that fails at start-up anyway is reported by its own last
error line first, then its log."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.ports import (
    TRITON_HTTP_PORT,
    PortClaims,
    free_port,
    free_serve_ports,
    serve_port_args,
)


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`epd serve ARGS`, on free ports unless ARGS give one (as a test beside
    other stacks must)."""
    given = any(arg.endswith("-port") or arg == "--port" for arg in args)
    ports = [] if given else serve_port_args(free_serve_ports())
    return subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "serve", *ports, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _refused(done: subprocess.CompletedProcess[str], *named: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("epd serve: ")
    for text in named:
        assert text in line, line
    assert "starting EPD" not in done.stdout  # nothing was started
    return line


def test_a_kv_cache_smaller_than_the_context_names_both_flags(tiny_checkpoint: Path) -> None:
    line = _refused(
        _serve("--model", str(tiny_checkpoint), "--kv-cache-mb", "1", "--dtype", "float32"),
        "--kv-cache-mb 1",
        "--max-model-len 4096",
    )
    assert "1024 tokens" in line and "--kv-cache-mb 4 or more" in line  # 1 KiB a token


def test_a_port_in_use_names_the_port_its_flag_and_its_holder(tiny_checkpoint: Path) -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        model = ("--model", str(tiny_checkpoint))
        _refused(_serve(*model, "--port", str(port)), str(port), "--port", f"pid {os.getpid()} (")
        broker = ["--broker-port", str(port)]
        _refused(_serve("--model", str(tiny_checkpoint), *broker), str(port), "--broker-port")
        # two listeners on the held port: the flags' clash is named, whatever holds it
        both = ["--port", str(port), "--broker-port", str(port)]
        line = _refused(_serve(*model, *both), f"port {port} is both --port and --broker-port")
        assert "in use" not in line and "default" not in line


def test_a_port_that_clashes_with_a_default_says_it_is_the_default(tiny_checkpoint: Path) -> None:
    """Only --port given, on Triton's default HTTP port: the message says where the
    other 8010 came from, and how to move every port at once."""
    _refused(
        _serve("--model", str(tiny_checkpoint), "--port", str(TRITON_HTTP_PORT)),
        f"port {TRITON_HTTP_PORT} is both --port and --triton-http-port (its default)",
        "--port-base",
    )


def test_a_port_another_epd_serve_claimed_names_its_flag_and_the_claimant(
    tiny_checkpoint: Path,
) -> None:
    """A port free now but claimed by an `epd serve` whose children have not bound
    it yet (two started at the same moment) is refused before anything starts."""
    ports = free_serve_ports()
    with PortClaims() as claims:
        assert claims.take(ports["broker-port"]) is None
        done = _serve("--model", str(tiny_checkpoint), *serve_port_args(ports))
    line = _refused(done, str(ports["broker-port"]), "(--broker-port)", f"pid {os.getpid()}")
    assert "claimed by another epd serve" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--encoders", "0"], "--encoders 0"),
        (["--prefill", "1"], "--decode"),
        (["--languages", "2", "--decode", "1"], "--languages"),
        (["--port", "50051"], "--broker-port"),  # two listeners on one port (the default)
    ],
)
def test_what_cannot_work_is_one_line(tiny_checkpoint: Path, flags: list[str], named: str) -> None:
    _refused(_serve("--model", str(tiny_checkpoint), *flags), named)


def test_a_model_folder_without_its_processor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "preprocessor_config.json").unlink()
    _refused(_serve("--model", str(folder)), "preprocessor_config.json", str(folder))
    _refused(_serve("--model", str(tmp_path / "none")), "is not a folder")


def test_a_child_that_fails_at_start_up_says_why_first(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """What passes the checks but cannot run here (FlashInfer attention on a
    CPU): the language instance's own error is the first line, then its log."""
    flags = ["--attention", "flashinfer", "--log-dir", str(tmp_path)]
    done = _serve("--model", str(tiny_checkpoint), *flags, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    first, second = done.stderr.strip().splitlines()[:2]
    assert first.startswith("error: language-0 exited during start-up: ValueError: "), first
    assert "FlashInfer" in first
    assert second == f"  its log: {tmp_path / 'language-0.log'}"
