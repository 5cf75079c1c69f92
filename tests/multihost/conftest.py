"""Several hosts on this one machine: Linux network namespaces, each with its
own address on a bridge in the root namespace (a veth pair per host), each
running its share of the stack with `epd serve --roles ...`. Nothing crosses
hosts over loopback: every host dials the others at their bridge addresses,
and each has its own EPD_HOST_ID, so shared memory is never chosen between
them. Needs root (`ip netns`); without it the tests skip and say why."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from services.launcher.serve import launch
from services.runtime import env
from tests.multihost.hosts import Host, Network, ip, make_network, remove_network

MODEL = "demo-tiny"
BROKER_PORT = 50051  # the default: every host has its own ports
GATEWAY_PORT = 8000


@pytest.fixture(scope="session")
def network_available() -> None:
    if os.geteuid() != 0:
        pytest.skip("multihost tests make network namespaces: they need root")
    probe = f"epdprobe{secrets.token_hex(2)}"
    try:
        ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a network namespace here: {exc}")
    ip("netns", "del", probe)


def start_hosts(
    network: Network,
    shares: Sequence[tuple[str, ...]],
    checkpoint: Path,
    logs: Path,
    environment: dict[str, str] | None = None,
) -> str:
    """`epd serve` on each host with its share's flags: the first host's (the
    broker's) first, the others once its broker answers, all of them then coming
    up together (the first host's gateway is healthy once instances attached).
    `environment` is every host's too (TLS); returns the cluster token."""
    token = secrets.token_urlsafe(16)
    broker = f"{network.hosts[0].address}:{BROKER_PORT}"

    def start(host: Host, share: tuple[str, ...]) -> None:
        host_environment = {
            **os.environ,
            **(environment or {}),
            env.HOST_ID.name: host.name,
            env.CLUSTER_TOKEN.name: token,
            env.SHM_PREFIX.name: f"{host.name}_",
            # UCX sees one machine and would share memory between the namespaces:
            # NIXL crosses these hosts over TCP, as between machines without RDMA
            "UCX_TLS": "tcp",
        }
        args = [
            *share,
            "--model", str(checkpoint),
            "--model-name", MODEL,
            "--broker", broker,
            "--advertise-host", host.address,
            "--host", "0.0.0.0",
            "--max-model-len", "512",
            "--kv-cache-mb", "64",
            "--log-dir", str(logs / host.name),
        ]  # fmt: skip
        host.process = launch(
            args, timeout_s=300, command=host.command(), banner=host.output, env=host_environment
        )

    pool = network.starters
    starting = [pool.submit(start, network.hosts[0], shares[0])]
    deadline = time.monotonic() + 120
    while not _answers(network.hosts[0].address, BROKER_PORT):
        if time.monotonic() > deadline or starting[0].done():
            starting[0].result()  # its error, if it failed
            raise AssertionError("the broker host did not come up")
        time.sleep(0.2)
    starting += [
        pool.submit(start, h, s)
        for h, s in zip(network.hosts[1 : len(shares)], shares[1:], strict=True)
    ]
    for future in starting:
        future.result()
    return token


def _answers(address: str, port: int) -> bool:
    """A TCP connect from the root namespace (there is no ping here)."""
    try:
        socket.create_connection((address, port), timeout=1).close()
    except OSError:
        return False
    return True


def stop_hosts(network: Network) -> None:
    for host in network.hosts:
        if host.process is not None and host.process.poll() is None:
            host.process.send_signal(signal.SIGINT)
    for host in network.hosts:
        if host.process is not None:
            try:
                host.process.wait(60)
            except subprocess.TimeoutExpired:
                host.process.kill()
    network.starters.shutdown()


@contextlib.contextmanager
def cluster_of(
    shares: Sequence[tuple[str, ...]],
    checkpoint: Path,
    logs: Path,
    environment: Callable[[Network], dict[str, str]] = lambda network: {},
    spare_hosts: int = 0,
) -> Iterator[Network]:
    """Hosts running these shares (and `spare_hosts` more, running nothing), every
    host's environment with `environment(network)` (TLS); torn down at the end."""
    network = make_network(len(shares) + spare_hosts)
    try:
        start_hosts(network, shares, checkpoint, logs, environment(network))
        yield network
    finally:
        stop_hosts(network)
        remove_network(network)
