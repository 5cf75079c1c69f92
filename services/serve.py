"""`epd serve`: the whole stack on this machine, as child processes.

Starts tritonserver, the broker, the encoder and language instances and the
gateway, waits for every health check while showing progress, prints the
endpoints, and on Ctrl-C / SIGTERM stops everything in reverse order. If a
component dies or never becomes healthy, it stops the rest and shows that
component's log tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import env
from services.children import die_with_parent
from services.transfer.shared_memory import remove_segments


class StackError(RuntimeError):
    """A component did not come up."""


def grpc_serving(address: str, service: str = "") -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Component:
    name: str
    args: list[str]
    healthy: Callable[[], bool]
    log: Path
    cpus: str = ""
    nice: int = 0
    process: subprocess.Popen[bytes] | None = None

    def start(self, environment: dict[str, str]) -> None:
        if self.cpus:
            environment = {**environment, env.CPUS.name: self.cpus}
        if self.nice:
            environment = {**environment, env.NICE.name: str(self.nice)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops us in order
                preexec_fn=die_with_parent,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass(frozen=True, slots=True)
class StackConfig:
    checkpoint: Path
    model_name: str
    log_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    broker_port: int = 50051
    encoder_port: int = 50061
    language_port: int = 50071
    triton_ports: tuple[int, int, int] = (8010, 8011, 8012)  # http, grpc, metrics
    num_encoders: int = 1
    num_languages: int = 1
    api_key: str = ""
    startup_timeout_s: float = 300.0
    language_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    monolithic: bool = False
    metrics_offset: int = 100  # a gRPC component's Prometheus port is its own + this
    # CPU sets ("0-3") for the vision side (Triton, encoders) and the language
    # instances; empty: every CPU. On CPUs, this is what giving each stage its
    # own device means.
    encoder_cpus: str = ""
    language_cpus: str = ""
    encoder_nice: int = 0  # > 0: Triton and the encoders yield the CPU to the language engine

    def metrics_port(self, port: int) -> int:
        return port + self.metrics_offset


def _instance(config: StackConfig, role: str, index: int, port: int, extra: list[str]) -> Component:
    """An encoder or language instance: the same flags but for its own."""
    name = f"{role}-{index}"
    args = [
        role,
        "--checkpoint", str(config.checkpoint),
        "--model-name", config.model_name,
        "--port", str(port),
        "--metrics-port", str(config.metrics_port(port)),
        "--broker", f"{config.host}:{config.broker_port}",
        "--instance-id", name,
        *extra,
    ]  # fmt: skip
    service = f"epd.v1.{role.capitalize()}"
    cpus = config.language_cpus if role == "language" else config.encoder_cpus
    nice = 0 if role == "language" else config.encoder_nice
    return Component(
        name,
        args,
        partial(grpc_serving, f"{config.host}:{port}", service),
        config.log_dir / f"{name}.log",
        cpus,
        nice,
    )


def components(config: StackConfig) -> list[Component]:
    """In start order; each waits only for its own health."""
    ck, model, logs = str(config.checkpoint), config.model_name, config.log_dir
    broker = f"{config.host}:{config.broker_port}"
    gateway_args = ["--port", str(config.port), "--checkpoint", ck, *config.gateway_args]
    if config.api_key:
        gateway_args += ["--api-key", config.api_key]
    gateway_url = f"http://{config.host}:{config.port}/health"
    if config.monolithic:
        return [
            Component(
                "monolithic",
                ["monolithic", *gateway_args, "--model-name", model, *config.language_args],
                lambda: http_ok(gateway_url),
                logs / "monolithic.log",
            )
        ]
    http, grpc_port, metrics = config.triton_ports
    parts = [
        Component(
            "broker",
            [
                "broker",
                "--host",
                config.host,
                "--port",
                str(config.broker_port),
                "--metrics-port",
                str(config.metrics_port(config.broker_port)),
            ],
            lambda: grpc_serving(broker),
            logs / "broker.log",
        ),
        Component(
            "triton",
            [
                "triton",
                "--checkpoint",
                ck,
                "--http-port",
                str(http),
                "--grpc-port",
                str(grpc_port),
                "--metrics-port",
                str(metrics),
            ],
            lambda: http_ok(f"http://{config.host}:{http}/v2/models/vit/ready"),
            logs / "triton.log",
            config.encoder_cpus,
            config.encoder_nice,
        ),
    ]
    for i in range(config.num_languages):
        parts.append(
            _instance(config, "language", i, config.language_port + i, [*config.language_args])
        )
    for i in range(config.num_encoders):
        triton = ["--triton", f"{config.host}:{grpc_port}"]
        parts.append(_instance(config, "encoder", i, config.encoder_port + i, triton))
    parts.append(
        Component(
            "gateway",
            ["gateway", *gateway_args, "--broker", broker, "--served-model", model],
            lambda: http_ok(gateway_url),
            logs / "gateway.log",
        )
    )
    return parts


@dataclass
class Stack:
    config: StackConfig
    say: Callable[[str], None] = print
    parts: list[Component] = field(default_factory=list)
    # Every shared-memory segment the children create carries this prefix, so
    # whatever a crashed child leaves is removed when the stack stops.
    shm_prefix: str = field(default_factory=lambda: f"epd_{secrets.token_hex(3)}_")

    def start(self) -> None:
        self.parts = components(self.config)
        environment = {**os.environ, env.SHM_PREFIX.name: self.shm_prefix}
        if not self.config.monolithic:
            # Several torch processes share these cores: idle OpenMP threads must
            # sleep, not spin on a core another process needs (measured: image
            # TTFT halves, text TPOT p99 drops ~20% on 2 cores).
            environment.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for part in self.parts:  # all at once: they come up in parallel
            part.start(environment)
        started = time.monotonic()
        for part in self.parts:
            self.say(f"  {part.name:<12} starting ...")
            while not part.healthy():
                if not part.alive:
                    raise StackError(
                        f"{part.name} exited during start-up; its log ({part.log}):\n{part.tail()}"
                    )
                if time.monotonic() - started > self.config.startup_timeout_s:
                    limit = self.config.startup_timeout_s
                    raise StackError(
                        f"{part.name} not healthy after {limit:.0f}s; its log:\n{part.tail()}"
                    )
                time.sleep(0.2)
            self.say(f"  {part.name:<12} ready ({time.monotonic() - started:.1f}s)")

    def dead(self) -> Component | None:
        return next((p for p in self.parts if not p.alive), None)

    def stop(self) -> None:
        for part in reversed(self.parts):
            part.stop()
        leftovers = remove_segments(self.shm_prefix)
        if leftovers:
            self.say(
                f"  removed {len(leftovers)} shared-memory segments left by stopped components"
            )


def banner(config: StackConfig) -> str:
    url = f"http://{config.host}:{config.port}"
    auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
    body = json.dumps(
        {
            "model": config.model_name,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 32,
        }
    )
    lines = [
        "",
        f"EPD is serving {config.model_name!r}:",
        f"  OpenAI API   {url}/v1   (metrics {url}/metrics, logs in {config.log_dir})",
    ]
    if not config.monolithic:
        lines += [
            f"  broker gRPC  {config.host}:{config.broker_port}   (grpcurl -plaintext ... list)",
            f"  metrics      each gRPC component on its own port + {config.metrics_offset}",
        ]
    lines += [
        "",
        "try:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"    -d '{body}'",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def run(config: StackConfig) -> int:
    """Runs the stack until SIGINT/SIGTERM or until a component dies."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(config, say=lambda line: print(line, flush=True))
    mode = "monolithic" if config.monolithic else "disaggregated"
    print(
        f"starting EPD ({mode}) with model {config.model_name!r} from {config.checkpoint}",
        flush=True,
    )
    try:
        stack.start()
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        stack.stop()
        return 1
    except BaseException:
        stack.stop()
        raise
    print(banner(config), flush=True)
    try:
        while not stop.wait(0.5):
            dead = stack.dead()
            if dead is not None:
                print(
                    f"error: {dead.name} exited; its log:\n{dead.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
        print("stopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        print("stopped.", flush=True)


def launch(args: list[str], timeout_s: float = 300.0) -> subprocess.Popen[str]:
    """`epd serve ARGS` as a child process, returned once it serves; its banner
    has been read. For tests and benchmarks that drive the stack as a user does."""
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert process.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        output.append(line)
        if "Ctrl-C stops everything" in line:
            return process
        if time.monotonic() > deadline:
            break
    process.kill()
    process.wait()
    raise StackError("epd serve did not come up:\n" + "".join(output))
