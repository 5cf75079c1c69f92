"""What a network does to the stack, under load, across five hosts (broker and
gateway; two encoder hosts; two language hosts): a language host cut off for
20 s, an encoder host frozen (every process SIGSTOPped) for 20 s, a language
host killed outright. Each time the requests that touched it fail cleanly or
move elsewhere within a bounded time (gRPC keepalive: a ping every 5 s, 3 s to
answer, so about 8 s to notice a silent peer; the broker drops an instance
after 5 s without a heartbeat), the rest finish, the broker takes the host back
when it returns, and nothing leaks on the surviving hosts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.chaos.conftest import Load, Outcome, wait_for
from tests.multihost.conftest import (
    GATEWAY_PORT,
    cluster_of,
)
from tests.multihost.hosts import Host, Network

pytestmark = pytest.mark.multihost

SHARES = [
    ("--roles", "broker,gateway"),
    ("--roles", "triton,encoder"),
    ("--roles", "triton,encoder"),
    ("--roles", "language", "--language-transports", "grpc"),
    ("--roles", "language", "--language-transports", "grpc"),
]
OUTAGE_S = 20.0
BOUND_S = 40.0  # a request a fault touched ends within this (keepalive, broker timeouts)
RECOVERY_S = 90.0
ENCODER_METRICS, LANGUAGE_METRICS = 50161, 50171  # each host's first instance's


@pytest.fixture(scope="module")
def cluster(
    network_available: None, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Network]:
    with cluster_of(SHARES, tiny_checkpoint, tmp_path_factory.mktemp("hosts")) as network:
        yield network


def url(network: Network) -> str:
    return f"http://{network.hosts[0].address}:{GATEWAY_PORT}"


def serving(network: Network) -> dict[str, str]:
    report = httpx.get(url(network) + "/health", timeout=10).json()
    return {name: c["state"] for name, c in report.get("components", {}).items()}


def all_back(network: Network, instances: int) -> None:
    wait_for(
        lambda: sorted(serving(network).values()) == ["serving"] * instances,
        RECOVERY_S,
        f"{instances} instances registered and serving",
    )


def pids(host: Host) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", host.name], capture_output=True, text=True, check=True
    ).stdout
    return [int(p) for p in out.split()]


def signal_host(host: Host, sig: signal.Signals) -> None:
    for pid in pids(host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def metric(address: str, port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5).read().decode()
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
    )


def whole(network: Network, languages: list[Host], encoders: list[Host]) -> bool:
    """Every KV page and receive block back, no send buffer held, nothing in flight."""
    for host in languages:
        for name in ("epd_language_kv_blocks_used", "epd_language_embedding_blocks_used"):
            if metric(host.address, LANGUAGE_METRICS, name) != 0:
                return False
    for host in encoders:
        if metric(host.address, ENCODER_METRICS, "epd_encoder_send_buffer_bytes") != 0:
            return False
    return metric(network.hosts[0].address, GATEWAY_PORT, "epd_gateway_in_flight") == 0


def clean(outcomes: list[Outcome]) -> None:
    for o in outcomes:
        assert o.seconds < BOUND_S, f"{o.kind} took {o.seconds:.1f}s"
        if o.status != 200:
            assert o.status in (502, 503, 504), o
            assert isinstance(o.body, dict) and o.body["error"]["message"], o


def served_after(load: Load, moment: float) -> None:
    """Requests started once the fault is over all succeed."""
    deadline = time.monotonic() + RECOVERY_S
    while time.monotonic() < deadline:
        after = [o for o in load.outcomes if o.started > moment]
        if sum(o.status == 200 for o in after) >= 6:
            break
        time.sleep(0.2)
    after = [o for o in load.outcomes if o.started > moment]
    assert after and all(o.status == 200 for o in after), [o for o in after if o.status != 200]


def dropped(network: Network, host: Host) -> None:
    """The broker no longer lists the host's instance."""
    wait_for(
        lambda: not any(name.endswith("@" + host.name) for name in serving(network)),
        OUTAGE_S,
        f"{host.name} dropped by the broker",
    )


def test_a_cut_a_freeze_and_a_death(cluster: Network) -> None:
    _, encoder_a, encoder_b, language_a, language_b = cluster.hosts
    all_back(cluster, 4)
    with Load(url(cluster)) as load:
        time.sleep(3)
        # a language host cut off, then back
        veth = "epv" + cluster.bridge.removeprefix("epb") + "3"
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        cut = time.monotonic()
        dropped(cluster, language_a)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - cut)))
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        all_back(cluster, 4)
        served_after(load, time.monotonic())
        # an encoder host frozen, then thawed
        signal_host(encoder_a, signal.SIGSTOP)
        frozen = time.monotonic()
        dropped(cluster, encoder_a)
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - frozen)))
        signal_host(encoder_a, signal.SIGCONT)
        all_back(cluster, 4)
        served_after(load, time.monotonic())
        # a language host killed outright: the broker drops it, the other serves on
        signal_host(language_b, signal.SIGKILL)
        dropped(cluster, language_b)
        all_back(cluster, 3)
        served_after(load, time.monotonic())
    clean(load.outcomes)
    assert sum(o.status == 200 for o in load.outcomes) > len(load.outcomes) // 2
    wait_for(
        lambda: whole(cluster, [language_a], [encoder_a, encoder_b]), 30, "surviving pools whole"
    )
