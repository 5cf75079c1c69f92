"""`epd serve`: the whole stack on this machine, as supervised child processes.

Starts tritonserver, the broker, the encoder and language instances and the
gateway, waits for every health check while showing progress, prints the
endpoints, and on Ctrl-C / SIGTERM stops everything in reverse order. A
component that fails to come up stops the start with its log tail.

Once up, a component that dies is restarted on its own (its exit cause and
log tail shown), after a backoff that doubles with each recent restart; the
others keep serving, and restarted instances attach to the broker again. A
component that keeps dying (`max_restarts` within `restart_window_s`) stops
the stack. Each component creates its shared memory under a prefix of its
own, which is swept before it restarts and when the stack stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.planner import Planner, PlannerConfig, Reading
from services.proto import broker_pb2, broker_pb2_grpc, common_pb2
from services.runtime import env, tracing
from services.runtime.children import die_with_parent
from services.runtime.ports import (
    BROKER_PORT,
    ENCODER_PORT,
    GATEWAY_PORT,
    LANGUAGE_PORT,
    METRICS_OFFSET,
    TRITON_GRPC_PORT,
    TRITON_HTTP_PORT,
    TRITON_METRICS_PORT,
)
from services.runtime.security import current, sync_channel
from services.transfer.shared_memory import remove_segments

ENCODER = common_pb2.ROLE_ENCODER
PLAN_EVERY_S = 1.0  # how often the encoder planner reads the broker

# Every component but the gateway listens here: only the gateway is exposed.
LOCAL = "127.0.0.1"
# What a host's `epd serve --roles` may run (all of them: the whole stack)
ROLES = ("broker", "triton", "encoder", "language", "gateway")


GOMP_DEFAULT_SPIN_COUNT = 300_000  # libgomp's, where OMP_WAIT_POLICY is unset

# Where the vision tower shares the language engine's cores, a step that only decodes
# waits, while images wait for the tower, what this TPOT target leaves over a decode
# step's measured time (Pacing): the tower computes in between, and the running
# requests' tokens stay inside the target. 100 ms a token is faster than people read.
TPOT_SLO_MS = 100
# It waits only as the oldest image awaiting the tower needs it by this TTFT target: a
# request far from late costs the running ones little. 3 s is what a chat user waits.
TTFT_SLO_MS = 3000

STOP_MARGIN_S = 5.0  # past the grace: what has not left by then is killed

# A line that says what went wrong: an exception's (`ValueError: ...`, `grpc.RpcError:`)
# or a command's own (`error: ...`, `epd language: error: ...`)
ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception|Exit)\b.*:|(\S+ )*error:)", re.IGNORECASE)


class StackError(RuntimeError):
    """A component did not come up."""


def grpc_serving(address: str, service: str = "") -> bool:
    try:
        with sync_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def attached(broker: str, instance_id: str) -> bool:
    """Whether the broker lists the instance: it has registered on its attach
    stream, so requests can be routed to it."""
    reply = list_instances(broker)
    return reply is not None and any(
        i.registration.instance_id == instance_id for i in reply.instances
    )


def list_instances(broker: str) -> broker_pb2.ListInstancesReply | None:
    """What the broker lists (None if it cannot be reached)."""
    security = current()
    try:
        with sync_channel(broker, security) as channel:
            return broker_pb2_grpc.BrokerStub(channel).ListInstances(
                broker_pb2.ListInstancesRequest(), timeout=1, metadata=security.metadata
            )
    except grpc.RpcError:
        return None


def instance_ready(address: str, service: str, broker: str, instance_id: str) -> bool:
    return grpc_serving(address, service) and attached(broker, instance_id)


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
    # > 0: its OpenMP threads spin this long between parallel regions before they
    # sleep (GOMP_SPINCOUNT, over the stack's OMP_WAIT_POLICY=PASSIVE)
    spin_count: int = 0
    process: subprocess.Popen[bytes] | None = None
    shm_prefix: str = ""  # its shared-memory segments' names start with this
    restarts: list[float] = field(default_factory=list)  # when it was restarted
    restart_at: float | None = None  # a restart is due then
    ready: bool = False  # healthy since its last start
    # The encoder planner's: not running until it adds it (parked), or being
    # stopped by it (retiring: draining, not to be restarted)
    parked: bool = False
    retiring: bool = False

    def environment(self, stack: dict[str, str]) -> dict[str, str]:
        """The environment it starts in: the stack's, with its own placement and its
        own shared-memory prefix (what a killed predecessor left under it is its to
        reclaim)."""
        environment = {**stack, env.SHM_PREFIX.name: self.shm_prefix, env.SHM_RECLAIM.name: "1"}
        if self.cpus:
            environment = {**environment, env.CPUS.name: self.cpus}
        if self.nice:
            environment = {**environment, env.NICE.name: str(self.nice)}
        if self.spin_count:  # unless the stack was given one
            environment = {"GOMP_SPINCOUNT": str(self.spin_count), **environment}
        return environment

    def start(self, environment: dict[str, str]) -> None:
        environment = self.environment(environment)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.ready = False
        with self.log.open("ab") as out:  # a restart appends: the crash stays readable
            out.write(f"=== {self.name} started at {time.strftime('%H:%M:%S')} ===\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                die_with_parent([sys.executable, "-m", "services.launcher.cli", *self.args]),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops us in order
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def exit_cause(self) -> str:
        code = self.process.returncode if self.process is not None else None
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def first_error(self) -> str:
        """The first line of its log since it last started that reads as an error
        (an exception's, an `error:` line): the cause, where what follows is its
        consequences (a child process's ValueError, then its parent's "exited
        during start-up"); else its exit cause."""
        lines = self.tail(400).splitlines()
        marker = f"=== {self.name} started"
        starts = [i for i, line in enumerate(lines) if line.startswith(marker)]
        for line in lines[starts[-1] if starts else 0 :]:
            if ERROR_LINE.match(line.strip()):
                return line.strip()
        return self.exit_cause

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        self.terminate()
        self.reap(time.monotonic() + timeout_s)

    def terminate(self) -> None:
        """Asks it to stop (SIGTERM to its process group): it finishes what it can."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Waits for it until the deadline, then kills what is left of its group."""
        if self.process is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(max(0.0, deadline - time.monotonic()))
        # What is left of its process group when it was killed on its own, and
        # until it is gone: only then can its shared memory be swept.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.process.wait()


@dataclass(frozen=True, slots=True)
class StackConfig:
    checkpoint: Path
    model_name: str
    log_dir: Path
    host: str = "127.0.0.1"  # the gateway's; the rest listen on LOCAL only
    port: int = GATEWAY_PORT
    broker_port: int = BROKER_PORT
    encoder_port: int = ENCODER_PORT  # the first encoder's; the next ones count up
    language_port: int = LANGUAGE_PORT
    triton_http_port: int = TRITON_HTTP_PORT
    triton_grpc_port: int = TRITON_GRPC_PORT
    triton_metrics_port: int = TRITON_METRICS_PORT
    num_encoders: int = 1  # at the start; with `planner`, its min_encoders
    planner: PlannerConfig | None = None  # --encoders auto: the planner adds and retires them
    num_languages: int = 1
    # E/P/D: this many prefill and decode instances in place of num_languages
    num_prefill: int = 0
    num_decode: int = 0
    # Several machines: this host's share of the stack (ROLES: all of it), the
    # broker's address when it runs elsewhere, and the address peers on other
    # hosts dial this host's gRPC components at (they then listen on every address)
    roles: tuple[str, ...] = ROLES
    broker: str = ""
    advertise_host: str = ""
    api_key: str = ""
    dtype: str = "float32"  # every component's: the embeddings cross with it
    startup_timeout_s: float = 300.0
    language_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    broker_args: tuple[str, ...] = ()
    encoder_args: tuple[str, ...] = ()
    # the language engine's threads while its requests await embeddings (None: auto,
    # language_threads_while_encoding)
    threads_while_encoding: int | None = None
    # and how long a step that only decodes waits meanwhile: a fixed interval
    # (None: paced by the TPOT target: language_pacing)
    decode_interval_while_encoding_ms: int | None = None
    tpot_slo_ms: int = TPOT_SLO_MS
    ttft_slo_ms: int = TTFT_SLO_MS
    monolithic: bool = False
    metrics_offset: int = METRICS_OFFSET  # a gRPC component's metrics port: its own + this
    # CPU sets ("0-3") for the vision side (Triton, encoders) and the language
    # instances; empty: every CPU. On CPUs, this is what giving each stage its
    # own device means. Language CPU sets separated by "/" go to the instances
    # in turn (prefill instances first): "0/1" gives each of two its own core.
    encoder_cpus: str = ""
    language_cpus: str = ""
    encoder_nice: int = 0  # > 0: Triton and the encoders yield the CPU to the language engine
    # Supervision: a component that dies is restarted after restart_backoff_s,
    # doubled for each restart within restart_window_s (at most 10 s); the stack
    # stops when one is restarted max_restarts times within the window.
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5
    # Stopping: every component at once, each giving its requests in flight this
    # long (EPD_SHUTDOWN_GRACE, which the children inherit); then it is killed.
    shutdown_grace_s: float = field(default_factory=env.SHUTDOWN_GRACE.get)

    def __post_init__(self) -> None:
        if set(self.roles) == set(ROLES) and (self.num_prefill > 0) != (self.num_decode > 0):
            raise ValueError("E/P/D needs at least one prefill and one decode instance")
        if unknown := set(self.roles) - set(ROLES):
            raise ValueError(f"unknown roles {sorted(unknown)}; choose from {', '.join(ROLES)}")
        if "broker" not in self.roles and not self.broker and not self.monolithic:
            raise ValueError("a host without the broker needs --broker HOST:PORT")

    @property
    def listen_host(self) -> str:
        """Where the gRPC components listen: this machine only, unless peers on
        other hosts dial them."""
        return "0.0.0.0" if self.advertise_host else LOCAL

    @property
    def broker_address(self) -> str:
        return self.broker or f"{LOCAL}:{self.broker_port}"

    def instance_id(self, name: str) -> str:
        """An instance's id at the broker: its name, and on one host's share of a
        deployment its host's too (encoder-0 runs on every encoder host)."""
        return name if set(self.roles) == set(ROLES) else f"{name}@{env.HOST_ID.get()}"

    @property
    def languages(self) -> list[tuple[str, str]]:
        """Each language instance's name and role, in start order."""
        if self.num_prefill or self.num_decode:
            return [(f"prefill-{i}", "prefill") for i in range(self.num_prefill)] + [
                (f"decode-{i}", "decode") for i in range(self.num_decode)
            ]
        return [(f"language-{i}", "both") for i in range(self.num_languages)]

    @property
    def vision_shares_cores(self) -> bool:
        """Whether one language instance shares all this host's CPUs with the vision
        side (Triton here, no CPU sets apart)."""
        return (
            {"triton", "language"} <= set(self.roles)
            and not self.monolithic
            and not (self.encoder_cpus or self.language_cpus)
            and len(self.languages) == 1
        )

    @property
    def language_threads_while_encoding(self) -> int:
        """As given, else half this host's CPUs where the vision side shares them, else 0."""
        if self.threads_while_encoding is not None:
            return self.threads_while_encoding
        return max(1, len(os.sched_getaffinity(0)) // 2) if self.vision_shares_cores else 0

    @property
    def language_pacing(self) -> list[str]:
        """How a language instance paces its decode steps while the vision side
        encodes: the interval as given; else, where the vision side shares its
        cores, by the TPOT and TTFT targets; else not at all (back to back)."""
        if self.decode_interval_while_encoding_ms is not None:
            return [
                "--decode-interval-while-encoding-ms",
                str(self.decode_interval_while_encoding_ms),
            ]
        if self.vision_shares_cores and self.tpot_slo_ms:
            return ["--tpot-slo-ms", str(self.tpot_slo_ms), "--ttft-slo-ms", str(self.ttft_slo_ms)]
        return []

    def language_cpus_of(self, index: int) -> str:
        sets = self.language_cpus.split("/")
        return sets[index % len(sets)]

    def metrics_port(self, port: int) -> int:
        return port + self.metrics_offset

    def restart_delay(self, recent: int) -> float:
        return float(min(self.restart_backoff_s * 2**recent, 10.0))


def _instance(
    config: StackConfig, command: str, name: str, port: int, cpus: str, extra: list[str]
) -> Component:
    """An encoder or language instance: the same flags but for its own."""
    broker = config.broker_address
    advertise = ("--advertise-host", config.advertise_host) if config.advertise_host else ()
    args = [
        command,
        "--checkpoint", str(config.checkpoint),
        "--model-name", config.model_name,
        "--host", config.listen_host,
        *advertise,
        "--port", str(port),
        "--metrics-port", str(config.metrics_port(port)),
        "--broker", broker,
        "--instance-id", config.instance_id(name),
        "--dtype", config.dtype,
        *extra,
    ]  # fmt: skip
    service = f"epd.v1.{command.capitalize()}"
    nice = 0 if command == "language" else config.encoder_nice
    return Component(
        name,
        args,
        # serving and attached: the broker routes to it
        partial(instance_ready, f"{LOCAL}:{port}", service, broker, config.instance_id(name)),
        config.log_dir / f"{name}.log",
        cpus,
        nice,
    )


def components(config: StackConfig) -> list[Component]:
    """This host's share (all of it by default), in start order; each waits only
    for its own health."""
    gateway_args = [
        *("--host", config.host, "--port", str(config.port)),
        *("--checkpoint", str(config.checkpoint), *config.gateway_args),
    ]
    if config.api_key:
        gateway_args += ["--api-key", config.api_key]
    gateway_url = f"http://{_dial(config.host)}:{config.port}/health"
    if config.monolithic:
        return [
            Component(
                "monolithic",
                [
                    *("monolithic", *gateway_args, "--model-name", config.model_name),
                    *("--dtype", config.dtype, *config.language_args),
                ],
                lambda: http_ok(gateway_url),
                config.log_dir / "monolithic.log",
            )
        ]
    gateway = Component(
        "gateway",
        [
            *("gateway", *gateway_args, "--broker", config.broker_address),
            *("--served-model", config.model_name),
        ],
        lambda: http_ok(gateway_url),
        config.log_dir / "gateway.log",
    )
    parts = [_broker(config), _triton(config), *_languages(config), *_encoders(config), gateway]
    return [part for part in parts if part.name.rsplit("-", 1)[0] in _role_names(config)]


def _broker(config: StackConfig) -> Component:
    return Component(
        "broker",
        [
            *("broker", "--host", config.listen_host, "--port", str(config.broker_port)),
            *("--metrics-port", str(config.metrics_port(config.broker_port))),
            *config.broker_args,
        ],
        lambda: grpc_serving(f"{LOCAL}:{config.broker_port}"),
        config.log_dir / "broker.log",
    )


def _triton(config: StackConfig) -> Component:
    http, grpc_port, metrics = (
        config.triton_http_port,
        config.triton_grpc_port,
        config.triton_metrics_port,
    )
    return Component(
        "triton",
        [
            *("triton", "--checkpoint", str(config.checkpoint), "--http-port", str(http)),
            *("--grpc-port", str(grpc_port), "--metrics-port", str(metrics)),
            *("--dtype", config.dtype),
            # one request a forward, so that each prompt's prefill overlaps the
            # next encode (model_repository/vit/configs/shared-cpu.pbtxt)
            *(["--model-config-name", "shared-cpu"] if config.vision_shares_cores else []),
        ],
        lambda: http_ok(f"http://{LOCAL}:{http}/v2/models/vit/ready"),
        config.log_dir / "triton.log",
        config.encoder_cpus,
        config.encoder_nice,
    )


def _languages(config: StackConfig) -> list[Component]:
    parts = []
    yielding = config.language_threads_while_encoding
    for i, (name, role) in enumerate(config.languages):
        extra = [*config.language_args, "--role", role, *config.language_pacing]
        if yielding:
            extra += ["--threads-while-encoding", str(yielding)]
        cpus = config.language_cpus_of(i)
        language = _instance(config, "language", name, config.language_port + i, cpus, extra)
        # Its engine gives the vision side cores while it computes for it, so between
        # its own operators its threads may spin (decode steps ~25 % faster than
        # when each parallel region wakes them: libgomp's default spin)
        language.spin_count = GOMP_DEFAULT_SPIN_COUNT if yielding else 0
        parts.append(language)
    return parts


def _encoders(config: StackConfig) -> list[Component]:
    """As many as the planner may run; those beyond --encoders parked for it."""
    parts = []
    most = config.planner.max_encoders if config.planner else config.num_encoders
    for i in range(most):
        triton = ("--triton", f"{LOCAL}:{config.triton_grpc_port}")
        triton_http = ("--triton-http", f"{LOCAL}:{config.triton_http_port}")
        extra = [*triton, *triton_http, *config.encoder_args]
        port = config.encoder_port + i
        encoder = _instance(config, "encoder", f"encoder-{i}", port, config.encoder_cpus, extra)
        encoder.parked = i >= config.num_encoders  # the planner's to start
        parts.append(encoder)
    return parts


def _role_names(config: StackConfig) -> set[str]:
    """The component names (less their index) of this host's roles."""
    names = set(config.roles)
    if "language" in names:
        names |= {"prefill", "decode"}
    return names


@dataclass
class Stack:
    config: StackConfig
    say: Callable[[str], None] = print
    parts: list[Component] = field(default_factory=list)
    # Every shared-memory segment the children create carries this prefix, so
    # whatever a crashed child leaves is removed when the stack stops.
    shm_prefix: str = field(
        default_factory=lambda: f"{env.SHM_PREFIX.get()}{secrets.token_hex(3)}_"
    )

    environment: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        self.parts = components(self.config)
        self.environment = {
            **os.environ,
            env.SHUTDOWN_GRACE.name: str(self.config.shutdown_grace_s),
        }
        if not self.config.monolithic:
            # Several torch processes share these cores: idle OpenMP threads must
            # sleep, not spin on a core another process needs (measured: image
            # TTFT halves, text TPOT p99 drops ~20% on 2 cores).
            self.environment.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for part in self.parts:  # all at once: they come up in parallel
            part.shm_prefix = f"{self.shm_prefix}{part.name}_"
            if not part.parked:
                part.start(self.environment)
        started = time.monotonic()
        for part in self.running:
            self.say(f"  {part.name:<12} starting ...")
            while not part.healthy():
                if not part.alive:
                    raise StackError(
                        f"{part.name} exited during start-up: {part.first_error()}\n"
                        f"  its log: {part.log}\n{part.tail()}"
                    )
                if time.monotonic() - started > self.config.startup_timeout_s:
                    limit = self.config.startup_timeout_s
                    raise StackError(
                        f"{part.name} not healthy after {limit:.0f}s; its log:\n{part.tail()}"
                    )
                time.sleep(0.2)
            part.ready = True
            self.say(f"  {part.name:<12} ready ({time.monotonic() - started:.1f}s)")

    def watch(self) -> None:
        """One round of supervision: restarts what died (when its backoff is over)
        and says when it serves again; StackError when one keeps dying."""
        now = time.monotonic()
        config = self.config
        for part in self.running:
            if part.retiring:
                if not part.alive:
                    part.reap(now)
                    remove_segments(part.shm_prefix)
                    part.retiring, part.parked = False, True
                    self.say(f"{part.name} retired ({part.exit_cause})")
                continue
            if part.restart_at is not None:
                if now >= part.restart_at:
                    part.restart_at = None
                    part.stop()  # what is left of its process group
                    remove_segments(part.shm_prefix)  # and of its shared memory
                    part.start(self.environment)
            elif not part.alive:
                recent = [t for t in part.restarts if now - t < config.restart_window_s]
                if len(recent) >= config.max_restarts:
                    raise StackError(
                        f"{part.name} keeps failing: {len(recent)} restarts within "
                        f"{config.restart_window_s:.0f}s, last {part.exit_cause}; "
                        f"its log ({part.log}):\n{part.tail()}"
                    )
                delay = config.restart_delay(len(recent))
                part.restarts = [*recent, now]
                part.restart_at = now + delay
                self.say(
                    f"{part.name} exited ({part.exit_cause}); restarting in {delay:.1f}s "
                    f"(restart {len(recent) + 1} of {config.max_restarts} allowed within "
                    f"{config.restart_window_s:.0f}s). Its log ({part.log}):\n{part.tail()}"
                )
            elif not part.ready and part.healthy():
                part.ready = True
                self.say(f"{part.name} is serving again")

    @property
    def running(self) -> list[Component]:
        return [p for p in self.parts if not p.parked]

    @property
    def encoders(self) -> list[Component]:
        """The encoders serving or starting: not parked, not retiring."""
        return [p for p in self.running if p.name.startswith("encoder-") and not p.retiring]

    def add_encoder(self, why: str) -> None:
        part = next(p for p in self.parts if p.name.startswith("encoder-") and p.parked)
        part.parked = False
        remove_segments(part.shm_prefix)
        part.start(self.environment)
        self.say(f"planner: adding {part.name} ({why})")

    def retire_encoder(self, why: str) -> None:
        """The last encoder drains (the broker routes it nothing new, it finishes
        what it has) and stops; watch() parks it once it is gone."""
        part = self.encoders[-1]
        part.retiring = True
        part.terminate()
        self.say(f"planner: retiring {part.name} ({why})")

    def stop(self) -> None:
        """Stops every component at once: each drains its own requests within
        its grace period, none waits for another's."""
        for part in self.running:
            part.terminate()
        deadline = time.monotonic() + self.config.shutdown_grace_s + STOP_MARGIN_S
        for part in self.running:
            part.reap(deadline)
        leftovers = remove_segments(self.shm_prefix)
        if leftovers:
            self.say(
                f"  removed {len(leftovers)} shared-memory segments left by stopped components"
            )


@dataclass
class EncoderPlanning:
    """`--encoders auto`: once a second, the broker's view as the planner's
    reading, and its decision carried out on the stack (services/launcher/planner.py)."""

    stack: Stack
    planner: Planner
    routed: tuple[int, int] = (0, 0)  # the broker's routes with media, and text only
    imbalance: str = ""
    next_at: float = 0.0

    def step(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + PLAN_EVERY_S
        reply = list_instances(self.stack.config.broker_address)
        if reply is None:
            return
        reading = self.reading(reply)
        decision = self.planner.decide(reading, now)
        if decision.imbalance != self.imbalance and decision.imbalance:
            self.stack.say(f"planner: {decision.imbalance} ({reading.describe()})")
        self.imbalance = decision.imbalance
        why = f"{decision.reason}: {reading.describe()}"
        if decision.change > 0:
            self.stack.add_encoder(why)
        elif decision.change < 0:
            self.stack.retire_encoder(why)

    def reading(self, reply: broker_pb2.ListInstancesReply) -> Reading:
        encoders = [i.load for i in reply.instances if i.registration.role == ENCODER]
        languages = [i.load for i in reply.instances if i.registration.role != ENCODER]
        busy = [e.encode_seconds for e in encoders if e.encode_seconds > 0]
        media, text = reply.routed_with_media, reply.routed_text
        new_media, new_text = media - self.routed[0], text - self.routed[1]
        self.routed = (media, text)
        return Reading(
            encoders=len(self.stack.encoders),
            queue_depth=sum(e.queue_depth for e in encoders),
            encode_seconds=sum(busy) / len(busy) if busy else 0.0,
            image_share=new_media / (new_media + new_text) if new_media + new_text else 0.0,
            language_requests=sum(lang.num_requests for lang in languages),
            language_capacity=sum(lang.max_requests for lang in languages),
        )


def _dial(host: str) -> str:
    """Where this machine reaches a server bound to `host`."""
    return LOCAL if host in ("0.0.0.0", "::", "[::]", "") else host


def banner(config: StackConfig) -> str:
    url = f"http://{_dial(config.host)}:{config.port}"
    auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
    cluster_token = env.CLUSTER_TOKEN.get()
    grpcurl = f" -H 'authorization: Bearer {cluster_token}'" if cluster_token else ""
    if env.TLS_CERT.get():
        ca = f" -cacert {env.TLS_CA.get()}" if env.TLS_CA.get() else " -insecure"
        grpcurl = f"{ca} -cert {env.TLS_CERT.get()} -key {env.TLS_KEY.get()}{grpcurl}"
    else:
        grpcurl = f" -plaintext{grpcurl}"
    body = json.dumps(
        {
            "model": config.model_name,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 32,
        }
    )
    if "gateway" not in config.roles:  # one host's share of a deployment
        return "\n".join(
            [
                "",
                f"EPD on this host ({', '.join(config.roles)}), attached to the broker at "
                f"{config.broker_address}; logs in {config.log_dir}",
                "",
                "Ctrl-C stops everything.",
            ]
        )
    lines = [
        "",
        f"EPD is serving {config.model_name!r}:",
        f"  OpenAI API   {url}/v1   (metrics {url}/metrics, logs in {config.log_dir})",
    ]
    if not config.monolithic:
        lines += [
            f"  broker gRPC  {LOCAL}:{config.broker_port}   (this machine only; grpcurl:",
            f"    grpcurl{grpcurl} {LOCAL}:{config.broker_port} epd.v1.Broker/ListInstances)",
            f"  metrics      each gRPC component on its own port + {config.metrics_offset}",
        ]
    if not config.monolithic and (env.TRACE.get() or tracing.endpoint()):
        token = f" --cluster-token {cluster_token}" if cluster_token else ""
        lines += [
            "  traces       a request's steps: epd trace REQUEST_ID "
            f"--broker {LOCAL}:{config.broker_port} --gateway {url}{token}",
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
    """Runs the stack until SIGINT/SIGTERM, or until a component keeps dying."""
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
    planning = EncoderPlanning(stack, Planner(config.planner)) if config.planner else None
    try:
        while not stop.wait(0.5):
            stack.watch()
            if planning is not None:
                planning.step(time.monotonic())
        print("stopping ...", flush=True)
        return 0
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
        print("stopped.", flush=True)


def launch(
    args: list[str],
    timeout_s: float = 300.0,
    command: Sequence[str] | None = None,
    banner: list[str] | None = None,
    **popen: Any,
) -> subprocess.Popen[str]:
    """`epd serve ARGS` as a child process, returned once it serves; its banner
    has been read (into `banner`, if given). For tests and benchmarks that drive
    the stack as a user does (`command` replaces `python -m services.launcher.cli`, `popen`
    goes to Popen)."""
    process = spawn(args, command, **popen)
    wait_serving(process, timeout_s, banner)
    return process


def spawn(
    args: list[str], command: Sequence[str] | None = None, **popen: Any
) -> subprocess.Popen[str]:
    """`epd serve ARGS` as a child process, started: its stderr goes to its stdout."""
    return subprocess.Popen(
        die_with_parent(
            [*(command or (sys.executable, "-m", "services.launcher.cli")), "serve", *args]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def wait_serving(
    process: subprocess.Popen[str], timeout_s: float = 300.0, banner: list[str] | None = None
) -> None:
    """Returns once a spawned `epd serve` serves, its banner read (into `banner`,
    if given); else kills it and raises StackError with what it printed."""
    assert process.stdout is not None
    output: list[str] = [] if banner is None else banner
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        output.append(line)
        if "Ctrl-C stops everything" in line:
            return
        if time.monotonic() > deadline:
            break
    process.kill()
    process.wait()
    raise StackError("epd serve did not come up:\n" + "".join(output))
