"""Free ports picked where EPD_FREE_PORTS says (each test worker its own range),
and what holds a port, named."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from services.runtime import env
from services.runtime.ports import (
    PortClaims,
    free_port,
    free_port_block,
    free_serve_ports,
    holder,
)


def test_free_ports_come_from_the_range_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.FREE_PORTS.name, "21000-21399")
    assert all(21000 <= free_port() <= 21399 for _ in range(50))
    ports = free_serve_ports(encoders=2, languages=2)
    assert all(21000 <= port <= 21399 + 200 for port in ports.values()), ports
    assert 21000 <= ports["port"] <= 21399  # the block starts inside the range


def test_picks_in_a_row_never_repeat_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing binds a pick until its server starts, so each pick must differ
    from the last ones (CI once gave Triton one port for HTTP and gRPC)."""
    monkeypatch.setenv(env.FREE_PORTS.name, "23000-23199")
    picks = [free_port() for _ in range(100)]
    assert len(set(picks)) == 100 and all(23000 <= port <= 23199 for port in picks)
    base = free_port_block((0, 1, 2))
    assert not {base, base + 1, base + 2} & set(picks)
    assert free_port() not in {base, base + 1, base + 2}


@pytest.mark.parametrize("value", ["21000", "21000-21100", "80-1000", "30000-20000", "a-b"])
def test_a_range_that_cannot_be_used_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(env.FREE_PORTS.name, value)
    with pytest.raises(ValueError, match="EPD_FREE_PORTS"):
        free_port()


def test_the_holder_of_a_port_is_named() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        named = holder(port)
    assert named is not None and named.startswith(f"pid {os.getpid()} (")
    assert holder(port) is None  # closed: nothing listens there now


def test_a_claim_holds_until_its_process_ends_however_it_ends() -> None:
    port = free_port()
    claimant = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from services.runtime.ports import PortClaims\n"
            f"claims = PortClaims(); assert claims.take({port}) is None\n"
            "print('claimed', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert claimant.stdout is not None and claimant.stdout.readline() == "claimed\n"
        with PortClaims() as claims:
            assert claims.take(port) == f"pid {claimant.pid}"
            assert claims.take(port + 1) is None  # a claim is a port's alone
        claimant.send_signal(signal.SIGKILL)
        claimant.wait(10)
        with PortClaims() as claims:
            assert claims.take(port) is None
            with PortClaims() as other:  # another holder in this very process too
                assert other.take(port) == f"pid {os.getpid()}"
    finally:
        claimant.kill()
        claimant.wait(10)


@pytest.mark.parametrize("held", ["--port", "--metrics-port"])
def test_a_port_taken_before_the_bind_is_named_with_its_holder(held: str) -> None:
    """`epd serve` checks its ports, but another process can take one before its
    child binds it: the child's error names the port and what holds it."""
    ports = {"--port": free_port(), "--metrics-port": free_port()}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[held]))
        listener.listen()
        broker = subprocess.run(
            [sys.executable, "-m", "services.launcher.cli", "broker"]
            + [a for flag, port in ports.items() for a in (flag, str(port))],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert broker.returncode != 0
    what = "broker's metrics" if held == "--metrics-port" else "broker"
    assert f"{what} cannot listen on 127.0.0.1:{ports[held]}: in use by pid {os.getpid()} (" in (
        broker.stderr
    ), broker.stderr
