"""One `epd serve` stack for the chaos suite, started the way many users do (from
an activated venv): two language instances, two encoders, the tiny checkpoint;
and for E/P/D one prefill and two decode instances beside one encoder. Its
components are real processes that the tests kill with SIGKILL."""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.launcher.serve import grpc_serving, http_ok, launch
from services.loadgen.synthetic import encode_image, random_image
from services.runtime import env
from services.runtime.ports import free_port_block
from services.transfer.shared_memory import SHM_DIR
from tests.processes import family

MODEL = "demo-tiny"
LANGUAGES = 2
ENCODERS = 2
# A request that fails must fail within this; one that a fault did not touch
# finishes well inside it.
BOUND_S = 30.0


@dataclass
class Stack:
    process: subprocess.Popen[str]
    ports: dict[str, int]
    output: list[str]
    shm_prefix: str
    num_languages: int = LANGUAGES
    num_encoders: int = ENCODERS

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def metric(self, port: int, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def language_ports(self) -> list[int]:
        """Every language instance's (E/P/D: the prefill instances', then the decode ones')."""
        return [self.ports["language"] + i for i in range(self.num_languages)]

    def encoder_ports(self) -> list[int]:
        return [self.ports["encoder"] + i for i in range(self.num_encoders)]

    def pid(self, *markers: str) -> int:
        """The one process of this stack (a descendant of its `epd serve`: other
        stacks may run beside it) whose command line holds every marker."""
        found = [
            pid
            for pid, cmdline in family(self.process.pid).items()
            if all(marker in cmdline for marker in markers)
        ]
        assert len(found) == 1, f"{markers}: {found}"
        return found[0]

    def segments(self) -> set[str]:
        """This stack's shared-memory segments (under its own EPD_SHM_PREFIX)."""
        return {p.name for p in SHM_DIR.glob(self.shm_prefix + "*")}

    def healthy(self, name: str) -> bool:
        """A component's own health check, as `epd serve` runs it."""
        if name == "triton":
            return http_ok(f"http://127.0.0.1:{self.ports['triton_http']}/v2/models/vit/ready")
        if name == "broker":
            return grpc_serving(f"127.0.0.1:{self.ports['broker']}")
        role, index = name.rsplit("-", 1)
        port = self.ports[role] + int(index)
        service = "Encoder" if role == "encoder" else "Language"
        return grpc_serving(f"127.0.0.1:{port}", f"epd.v1.{service}")

    def serving(self) -> dict[str, str]:
        """The gateway's view: instance id -> state."""
        report = httpx.get(self.url + "/health", timeout=10).json()
        return {name: c["state"] for name, c in report.get("components", {}).items()}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:.0f}s")
        time.sleep(0.2)


def image_url(seed: int) -> str:
    image = encode_image(random_image(96 + seed % 64, 80 + seed % 48, seed=seed))
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_body(kind: str, seed: int, max_tokens: int = 16) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Tell me about {seed}."}]
    if kind == "image":  # a new image each time: the encoder's cache never answers
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url(seed)}})
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }


@dataclass(frozen=True)
class Outcome:
    kind: str
    started: float
    ended: float
    status: int
    body: Any
    retry_after: str | None

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def in_flight_at(self, moment: float) -> bool:
        return self.started <= moment <= self.ended


@dataclass
class Load:
    """Workers each sending one request after another, text and images alternating."""

    url: str
    workers: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _work(self, worker: int) -> None:
        with httpx.Client(timeout=BOUND_S * 2) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                kind = "image" if (n + worker) % 2 else "text"
                started = time.monotonic()
                try:
                    reply = http.post(
                        self.url + "/v1/chat/completions",
                        json=chat_body(kind, worker * 1_000_000 + n, max_tokens=48),
                    )
                    status, body = reply.status_code, reply.json()
                    retry = reply.headers.get("retry-after")
                except (httpx.HTTPError, ValueError) as exc:
                    status, body, retry = -1, repr(exc), None
                self.outcomes.append(Outcome(kind, started, time.monotonic(), status, body, retry))

    def __enter__(self) -> Load:
        self._threads = [
            threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(BOUND_S * 2)


def launch_stack(
    checkpoint: Path, logs: Path, layout: tuple[str, ...], num_languages: int, num_encoders: int
) -> Stack:
    """`epd serve` from an activated venv, its instances as `layout`'s flags say."""
    language_offsets = [11 + i for i in range(num_languages)]
    base = free_port_block(
        (
            0,
            1,
            2,
            10,
            20,
            21,
            30,
            110,
            120,
            121,
            *language_offsets,
            *(o + 100 for o in language_offsets),
        )
    )
    ports = {
        "gateway": base,
        "triton_http": base + 1,
        "triton_grpc": base + 2,
        "triton_metrics": base + 30,
        "broker": base + 10,
        "encoder": base + 20,
        "language": base + 11,  # + 1 for the next; metrics at + 100
    }
    venv_bin = Path(sys.executable).parent
    activated = {  # what `source .venv/bin/activate` does
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv_bin.parent),
        env.SHM_PREFIX.name: f"epd_chaos{secrets.token_hex(3)}_",
    }
    # fmt: off
    process = launch(
        [
            "--model", str(checkpoint),
            "--model-name", MODEL,
            "--port", str(ports["gateway"]),
            "--broker-port", str(ports["broker"]),
            "--encoder-port", str(ports["encoder"]),
            "--language-port", str(ports["language"]),
            "--triton-http-port", str(ports["triton_http"]),
            "--triton-grpc-port", str(ports["triton_grpc"]),
            "--triton-metrics-port", str(ports["triton_metrics"]),
            *layout,
            "--encoders", str(num_encoders),
            "--max-model-len", "512",
            "--kv-cache-mb", "32",
            "--log-dir", str(logs),
        ],
        command=["epd"],
        env=activated,
        timeout_s=300,
    )
    # fmt: on
    output: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: output.extend(process.stdout or ()), daemon=True)
    reader.start()  # the supervisor's messages: read, or its pipe fills up
    return Stack(
        process, ports, output, activated[env.SHM_PREFIX.name], num_languages, num_encoders
    )


def stop(stack: Stack) -> None:
    if stack.process.poll() is None:
        stack.process.send_signal(signal.SIGINT)
        stack.process.wait(90)


@pytest.fixture(scope="session")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("chaos-logs")
    stack = launch_stack(
        tiny_checkpoint, logs, ("--languages", str(LANGUAGES)), LANGUAGES, ENCODERS
    )
    yield stack
    stop(stack)
