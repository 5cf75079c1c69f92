"""deploy/observability/ against a running stack: a real Prometheus (Debian's
package) with the shipped scrape configuration scrapes every component of an
E/P/D stack under a short load of text and image requests, and every query of
every shipped dashboard panel parses and returns data."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from openai import OpenAI

from services.launcher.protogen import REPO_ROOT
from services.loadgen.synthetic import random_image
from services.proto import broker_pb2, broker_pb2_grpc
from services.runtime.ports import METRICS_OFFSET, free_port, free_serve_ports
from tests.processes import served, wait_for
from tests.test_serve import image_url

MODEL = "demo-tiny"
SHIPPED = REPO_ROOT / "deploy" / "observability"
TOKEN = "observability-test-token"


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every shipped dashboard."""
    queries = []
    for dashboard in sorted((SHIPPED / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(dashboard.read_text())["panels"]:
            for target in panel.get("targets", []):
                queries.append((f"{dashboard.stem}: {panel['title']}", target["expr"]))
    return queries


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ports = free_serve_ports(languages=2)
    flags = ("--prefill", "1", "--decode", "1")
    logs = tmp_path_factory.mktemp("logs")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPD_CLUSTER_TOKEN", TOKEN)
        with served(tiny_checkpoint, MODEL, logs, *flags, ports=ports) as url:
            yield url, ports["broker-port"]


def _targets(url: str, broker_port: int) -> list[dict[str, Any]]:
    """Every component's metrics endpoint: the gateway's API port, and each gRPC
    component's port + METRICS_OFFSET (what `epd serve` gives them)."""
    with grpc.insecure_channel(f"127.0.0.1:{broker_port}") as channel:
        reply = broker_pb2_grpc.BrokerStub(channel).ListInstances(
            broker_pb2.ListInstancesRequest(),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=10,
        )
    groups = [
        {"targets": [urllib.parse.urlsplit(url).netloc], "labels": {"component": "gateway"}},
        {
            "targets": [f"127.0.0.1:{broker_port + METRICS_OFFSET}"],
            "labels": {"component": "broker"},
        },
    ]
    for instance in reply.instances:
        host, port = instance.registration.grpc_address.rsplit(":", 1)
        component = instance.registration.instance_id.rsplit("-", 1)[0]
        groups.append(
            {
                "targets": [f"{host}:{int(port) + METRICS_OFFSET}"],
                "labels": {"component": component},
            }
        )
    return groups


@pytest.fixture(scope="module")
def prometheus(stack: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: apt-get install prometheus (scripts/setup.sh does)")
    url, broker_port = stack
    home = tmp_path_factory.mktemp("prometheus")
    shutil.copy(SHIPPED / "prometheus.yml", home / "prometheus.yml")  # as shipped
    (home / "targets").mkdir()
    (home / "targets" / "stack.yaml").write_text(json.dumps(_targets(url, broker_port)))
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(home / "log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def _query(prometheus: str, promql: str) -> dict[str, Any]:
    query = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{query}", timeout=10) as response:
        reply: dict[str, Any] = json.load(response)
    return reply


def _load(url: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    image = image_url(random_image(200, 160, seed=3))
    for i in range(6):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Say {i} nice things."}]
        if i % 2:
            content.insert(0, {"type": "image_url", "image_url": {"url": image}})
        client.chat.completions.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": content}]
        )


def test_every_dashboard_query_returns_data_after_a_short_load(
    stack: tuple[str, int], prometheus: str
) -> None:
    def all_up() -> bool:
        try:
            reply = _query(prometheus, "up")
        except OSError:  # not listening yet
            return False
        samples = reply["data"]["result"]
        return len(samples) >= 5 and all(s["value"][1] == "1" for s in samples)

    wait_for(all_up, 60, "Prometheus to scrape every component")
    _load(stack[0])
    time.sleep(12)  # two scrapes (every 5 s) after the load: rates have two samples
    queries = _panel_queries()
    assert len(queries) >= 20
    empty = []
    for title, promql in queries:
        reply = _query(prometheus, promql)
        assert reply["status"] == "success", (title, promql, reply)
        values = [float(s["value"][1]) for s in reply["data"]["result"]]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {promql} -> {reply['data']['result']}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
