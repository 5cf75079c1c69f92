"""Several hosts on this one machine: Linux network namespaces, each with its
own address on a bridge in the root namespace (a veth pair per host), each
running its share of the stack with `epd serve --roles ...`. Nothing crosses
hosts over loopback: every host dials the others at their bridge addresses,
and each has its own EPD_HOST_ID, so shared memory is never chosen between
them. Needs root (`ip netns`); without it the tests skip and say why."""

from __future__ import annotations

import concurrent.futures
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services import env
from services.serve import launch

MODEL = "demo-tiny"
BROKER_PORT = 50051  # the default: every host has its own ports
GATEWAY_PORT = 8000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    name: str  # its network namespace
    address: str
    process: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.name, sys.executable, "-m", "services.cli"]


@dataclass
class Network:
    """A bridge and the namespaces on it; `hosts[i]` has address prefix.(10 + i)."""

    bridge: str
    prefix: str  # "10.88.N"
    hosts: list[Host]
    # The threads that start the hosts' `epd serve`: alive until the hosts stop (a
    # child started with die_with_parent dies with the thread that started it).
    starters: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(8)
    )

    @property
    def gateway(self) -> str:
        return self.prefix + ".1"


def make_network(num_hosts: int) -> Network:
    tag = secrets.token_hex(2)
    prefix = f"10.{random.randint(100, 199)}.{random.randint(1, 250)}"
    network = Network(f"epb{tag}", prefix, [])
    _ip("link", "add", network.bridge, "type", "bridge")
    _ip("addr", "add", f"{network.gateway}/24", "dev", network.bridge)
    _ip("link", "set", network.bridge, "up")
    for i in range(num_hosts):
        host = Host(f"epd{tag}h{i}", f"{prefix}.{10 + i}")
        network.hosts.append(host)
        veth = f"epv{tag}{i}"
        _ip("netns", "add", host.name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        _ip("link", "set", veth, "master", network.bridge, "up")
        inside = ("netns", "exec", host.name, "ip")
        _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
    return network


def remove_network(network: Network) -> None:
    for host in network.hosts:
        subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", network.bridge], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def network_available() -> None:
    if os.geteuid() != 0:
        pytest.skip("multihost tests make network namespaces: they need root")
    probe = f"epdprobe{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make a network namespace here: {exc}")
    _ip("netns", "del", probe)


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


@pytest.fixture
def network_factory(network_available: None) -> Iterator[list[Network]]:
    made: list[Network] = []
    yield made
    for network in made:
        stop_hosts(network)
        remove_network(network)
