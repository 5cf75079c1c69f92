"""`epd serve --prefill 1 --decode 1` as a user runs it, over each KV transport
this machine runs (chosen by --language-transports): greedy chat completions
through the official openai client equal HF generate(), streamed and not, with
text, one image and two images; the instances' health shows their roles, and
every KV page is back afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.processes import served
from tests.test_serve import check_completion

MODEL = "demo-tiny"
TRANSPORTS = ["shm", "nixl", "grpc"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def url(
    request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    flags = ("--prefill", "1", "--decode", "1", "--language-transports", request.param)
    with served(tiny_checkpoint, MODEL, tmp_path_factory.mktemp("logs"), *flags) as url:
        yield url


@pytest.mark.parametrize("num_images", [0, 1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_greedy_equals_hf_generate(
    url: str, tiny_checkpoint: Path, num_images: int, stream: bool
) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    check_completion(client, tiny_checkpoint, num_images, stream)


def test_health_shows_the_roles(url: str) -> None:
    health = json.load(urllib.request.urlopen(url + "/health", timeout=10))
    roles = {name: c["role"] for name, c in health["components"].items()}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "encoder-0": "encoder"}
    assert health["status"] == "ok"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--prefill", "1", "--languages", "2"), "mutually exclusive"),
        (("--prefill", "1"), "both at least 1"),
        (("--decode", "2"), "both at least 1"),
    ],
)
def test_serve_refuses_a_half_split(flags: tuple[str, ...], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and message in done.stderr, done.stderr
