"""The stack across real hosts (network namespaces): the broker and gateway on
one, an encoder (with its Triton) on each of two more, a language instance on
a fourth; or, E/P/D, a prefill and a decode instance on hosts of their own.
The embeddings (and the KV pages) cross between hosts over NIXL or the gRPC
stream, never shared memory; greedy completions through the gateway equal HF
generate(), token for token."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.multihost.conftest import (
    GATEWAY_PORT,
    cluster_of,
)
from tests.multihost.hosts import Network
from tests.test_serve import check_completion

pytestmark = pytest.mark.multihost

BROKER_AND_GATEWAY = ("--roles", "broker,gateway")
ENCODER = ("--roles", "triton,encoder")

LAYOUTS = {
    # an encoder per host, a language instance on a fourth host, over one transport
    "nixl": [BROKER_AND_GATEWAY, ENCODER, ENCODER, ("--roles", "language")],
    "grpc": [BROKER_AND_GATEWAY, ENCODER, ENCODER, ("--roles", "language")],
    # E/P/D: the KV pages cross hosts too
    "epd-nixl": [
        BROKER_AND_GATEWAY,
        ENCODER,
        ("--roles", "language", "--prefill", "1"),
        ("--roles", "language", "--decode", "1"),
    ],
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(
    request: pytest.FixtureRequest,
    network_available: None,
    tiny_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Network]:
    transport = request.param.removeprefix("epd-")
    if transport == "nixl":
        pytest.importorskip("nixl_cu12")
    shares = [
        (*share, "--language-transports", transport) if "language" in share else share
        for share in LAYOUTS[request.param]
    ]
    with cluster_of(shares, tiny_checkpoint, tmp_path_factory.mktemp("hosts")) as network:
        yield network


def url(network: Network) -> str:
    return f"http://{network.hosts[0].address}:{GATEWAY_PORT}"


@pytest.mark.parametrize("num_images", [0, 1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_equals_hf_generate(
    cluster: Network, tiny_checkpoint: Path, num_images: int, stream: bool
) -> None:
    client = OpenAI(base_url=url(cluster) + "/v1", api_key="none", max_retries=0, timeout=120)
    check_completion(client, tiny_checkpoint, num_images, stream)


def test_every_instance_registered_from_its_own_host(cluster: Network) -> None:
    health = json.load(urllib.request.urlopen(url(cluster) + "/health", timeout=10))
    assert health["status"] == "ok"
    assert all(c["state"] == "serving" for c in health["components"].values())
    roles = sorted(c["role"] for c in health["components"].values())
    assert roles in (
        ["encoder", "encoder", "language"],
        ["decode", "encoder", "prefill"],
    )
