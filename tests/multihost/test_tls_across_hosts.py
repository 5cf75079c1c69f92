"""Security across hosts: the hosts' gRPC is mutual TLS, with a certificate that
names every host's address, and the cluster token; the stack serves over it
between namespaces, and a host without the token and a certificate cannot
attach (its instance gives up within its attach deadline, the broker never
lists it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from services.runtime import env
from tests.multihost.conftest import (
    BROKER_PORT,
    GATEWAY_PORT,
    cluster_of,
)
from tests.multihost.hosts import Network
from tests.test_security import make_certificates
from tests.test_serve import check_completion

pytestmark = pytest.mark.multihost

SHARES = [
    ("--roles", "broker,gateway"),
    ("--roles", "triton,encoder"),
    ("--roles", "language", "--language-transports", "grpc"),
]


@pytest.fixture(scope="module")
def cluster(
    network_available: None, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Network]:
    folder = tmp_path_factory.mktemp("tls")

    def tls(network: Network) -> dict[str, str]:
        """A certificate naming every host's address."""
        certificates = make_certificates(folder, [host.address for host in network.hosts])
        return {
            env.TLS_CERT.name: str(certificates.cert),
            env.TLS_KEY.name: str(certificates.key),
            env.TLS_CA.name: str(certificates.ca),
        }

    logs = tmp_path_factory.mktemp("hosts")
    # the last host is the intruder's: it runs nothing of the stack
    with cluster_of(SHARES, tiny_checkpoint, logs, tls, spare_hosts=1) as network:
        yield network


def test_the_stack_serves_over_mutual_tls_across_hosts(
    cluster: Network, tiny_checkpoint: Path
) -> None:
    url = f"http://{cluster.hosts[0].address}:{GATEWAY_PORT}/v1"
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    check_completion(client, tiny_checkpoint, 1, False)


def test_a_host_without_the_token_or_a_certificate_cannot_attach(
    cluster: Network, tiny_checkpoint: Path
) -> None:
    intruder = cluster.hosts[-1]
    outsider = {
        k: v
        for k, v in os.environ.items()
        if k not in (env.CLUSTER_TOKEN.name, env.TLS_CERT.name, env.TLS_KEY.name, env.TLS_CA.name)
    }
    done = subprocess.run(
        [
            *("ip", "netns", "exec", intruder.name, sys.executable, "-m", "services.launcher.cli"),
            *("language", "--checkpoint", str(tiny_checkpoint), "--model-name", "demo-tiny"),
            *("--broker", f"{cluster.hosts[0].address}:{BROKER_PORT}", "--host", "0.0.0.0"),
            *("--advertise-host", intruder.address, "--instance-id", "intruder"),
            *("--max-model-len", "64", "--kv-cache-mb", "8"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**outsider, env.HOST_ID.name: intruder.name},
    )
    assert done.returncode != 0
    assert "could not attach to the broker" in done.stderr, done.stderr[-2000:]
    report = json.load(
        urllib.request.urlopen(f"http://{cluster.hosts[0].address}:{GATEWAY_PORT}/health")
    )
    assert "intruder" not in report["components"]
