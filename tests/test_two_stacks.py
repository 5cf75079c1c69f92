"""Two `epd serve` stacks on one machine, each on its own block of ports
(--port-base): each answers, each broker lists only its own instances, and
stopping one leaves the other serving. A twin started at the same moment on
the same ports, and a third on a port the first holds once it serves, are
refused before they start anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.launcher.serve import list_instances, spawn, wait_serving
from services.runtime import env
from services.runtime.ports import MAX_INSTANCES, METRICS_OFFSET, SERVE_PORTS, free_port_block

MODEL = "demo-tiny"
# one stack's block: every port flag's offset, its instances', their metrics ports
BLOCK = sorted(
    {*SERVE_PORTS.values(), *range(10, 20 + MAX_INSTANCES)}
    | {p + METRICS_OFFSET for p in (1, *range(10, 20 + MAX_INSTANCES))}
)


def _spawn(checkpoint: Path, base: int, token: str, logs: Path) -> subprocess.Popen[str]:
    return spawn(
        [
            *("--model", str(checkpoint), "--model-name", MODEL, "--port-base", str(base)),
            *("--max-model-len", "256", "--kv-cache-mb", "16", "--log-dir", str(logs)),
        ],
        env={**os.environ, env.CLUSTER_TOKEN.name: token},
    )


def _one_refused(
    twins: list[subprocess.Popen[str]], timeout_s: float = 120
) -> tuple[subprocess.Popen[str], str]:
    """Of two `epd serve` started together on the same ports: the one that was
    refused (what it printed), and the other, once it serves."""
    deadline = time.monotonic() + timeout_s
    while all(twin.poll() is None for twin in twins):
        assert time.monotonic() < deadline, "neither twin was refused"
        time.sleep(0.05)
    (refused,) = [twin for twin in twins if twin.poll() is not None]
    (serving,) = [twin for twin in twins if twin is not refused]
    printed = refused.communicate(timeout=10)[0]
    assert refused.returncode == 2, printed
    wait_serving(serving)
    return serving, printed


def _answers(base: int) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    reply = httpx.post(f"http://127.0.0.1:{base}/v1/chat/completions", json=body, timeout=60)
    return reply.status_code == 200 and bool(reply.json()["choices"])


def _instances(base: int, token: str, monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """The broker's instances: each one's id and address."""
    monkeypatch.setenv(env.CLUSTER_TOKEN.name, token)
    reply = list_instances(f"127.0.0.1:{base + SERVE_PORTS['broker-port']}")
    assert reply is not None
    return {(i.registration.instance_id, i.registration.grpc_address) for i in reply.instances}


def test_two_stacks_side_by_side(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = free_port_block(BLOCK)
    second = first
    while abs(second - first) <= max(BLOCK):  # two blocks apart
        second = free_port_block(BLOCK)
    stacks = {first: "token-one", second: "token-two"}
    twins = [_spawn(tiny_checkpoint, first, stacks[first], tmp_path / f"twin{i}") for i in (0, 1)]
    processes = {second: _spawn(tiny_checkpoint, second, stacks[second], tmp_path / "second")}
    try:
        processes[first], printed = _one_refused(twins)
        assert f"port {first} (--port) is claimed by another epd serve" in printed
        wait_serving(processes[second])
        for base, token in stacks.items():
            assert _answers(base)
            ports = {
                base + SERVE_PORTS["encoder-port"],
                base + SERVE_PORTS["language-port"],
            }
            listed = _instances(base, token, monkeypatch)
            assert {name for name, _ in listed} == {"encoder-0", "language-0"}
            assert {int(address.rsplit(":", 1)[1]) for _, address in listed} == ports
        third = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.launcher.cli",
                "serve",
                "--model",
                str(tiny_checkpoint),
                "--port-base",
                str(first),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert third.returncode == 2 and f"port {first} (--port) is in use" in third.stderr
        processes[first].send_signal(signal.SIGINT)
        assert processes[first].wait(60) == 0
        assert _answers(second)  # the other one serves on
    finally:
        for process in [*twins, *processes.values()]:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(60)
