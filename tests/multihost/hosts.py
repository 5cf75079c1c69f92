"""Hosts made of Linux network namespaces on one machine: a bridge in the root
namespace, and per host a namespace joined to it by a veth pair, with its own
address (`ip netns`, `ip link`; needs root). tests/multihost/ runs one host's
share of the stack in each; bench/transfer.py --across-hosts measures between two."""

from __future__ import annotations

import concurrent.futures
import random
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


RESERVED_PORTS = "/proc/sys/net/ipv4/ip_local_reserved_ports"
RESERVED = "8000-8199,50000-50299"


@dataclass
class Host:
    name: str  # its network namespace
    address: str
    process: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.name, sys.executable, "-m", "services.launcher.cli"]


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


def _forwarding(bridge: str, action: str) -> None:
    """Traffic between the bridge's hosts let through the root namespace's
    firewall (`action`: -I to add the rule, -D to remove it). Where Docker runs,
    bridged frames go through iptables (br_netfilter) and its FORWARD policy is
    DROP: the hosts could not reach one another."""
    if shutil.which("iptables") is not None:
        rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", action, *rule], capture_output=True, timeout=30)


def make_network(num_hosts: int) -> Network:
    tag = secrets.token_hex(2)
    prefix = f"10.{random.randint(100, 199)}.{random.randint(1, 250)}"
    network = Network(f"epb{tag}", prefix, [])
    ip("link", "add", network.bridge, "type", "bridge")
    ip("addr", "add", f"{network.gateway}/24", "dev", network.bridge)
    ip("link", "set", network.bridge, "up")
    _forwarding(network.bridge, "-I")
    for i in range(num_hosts):
        host = Host(f"epd{tag}h{i}", f"{prefix}.{10 + i}")
        network.hosts.append(host)
        veth = f"epv{tag}{i}"
        ip("netns", "add", host.name)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        ip("link", "set", veth, "master", network.bridge, "up")
        inside = ("netns", "exec", host.name, "ip")
        ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "link", "set", "lo", "up")
        # EPD's default ports (8000-8012, 50051-50171) lie in Linux's ephemeral range: a
        # client socket could take one before its server binds it (it did, once in CI)
        subprocess.run(
            ["ip", "netns", "exec", host.name, "sh", "-c", f"echo {RESERVED} > {RESERVED_PORTS}"],
            check=True,
            timeout=30,
        )
    return network


def remove_network(network: Network) -> None:
    for host in network.hosts:
        subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", network.bridge], capture_output=True, timeout=30)
    _forwarding(network.bridge, "-D")
