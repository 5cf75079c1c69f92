"""EPD_* environment variables: declared once, typed, read through here only.

Command-line options take their defaults from these, so a container or a
test can configure a service without flags.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.runtime import ports

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: Callable[[], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r}: {exc}") from None


BROKER = EnvVar("EPD_BROKER", str, lambda: f"127.0.0.1:{ports.BROKER_PORT}", "broker gRPC address")
TRITON_URL = EnvVar("EPD_TRITON_URL", str, lambda: ports.TRITON_URL, "Triton gRPC address")
TRITON_HTTP_URL = EnvVar(
    "EPD_TRITON_HTTP_URL",
    str,
    lambda: "",
    "Triton HTTP address for traced infers (Triton's gRPC server misreads their traceparent)",
)
CHECKPOINT = EnvVar("EPD_CHECKPOINT", str, lambda: "", "checkpoint folder")
HOST_ID = EnvVar(
    "EPD_HOST_ID", str, socket.gethostname, "instances with the same host id share memory"
)
LOG_FORMAT = EnvVar(
    "EPD_LOG_FORMAT",
    str,
    lambda: "text",
    "text or json (JSON lines); epd serve's children inherit it",
)
SHUTDOWN_GRACE = EnvVar(
    "EPD_SHUTDOWN_GRACE",
    float,
    lambda: 5.0,
    "seconds a stopping component gives its requests in flight to finish",
)
API_KEY = EnvVar("EPD_API_KEY", str, lambda: "", "gateway API key (empty: none)")
CACHE_DIR = EnvVar(
    "EPD_CACHE_DIR",
    str,
    lambda: os.path.join(os.path.expanduser("~"), ".cache", "epd"),
    "where `epd serve` keeps the demo checkpoint",
)
KERNEL_MARCH = EnvVar(
    "EPD_KERNEL_MARCH",
    str,
    lambda: "native",
    "the CPU EPD's C kernels are compiled for (gcc's -march): native, this machine's; "
    "x86-64-v3, any AVX2 machine; sapphirerapids, AMX",
)

DTYPE = EnvVar(
    "EPD_DTYPE",
    str,
    lambda: "auto",
    "model and embedding dtype: auto (bfloat16 where the hardware has it), float32, "
    "bfloat16 or float16",
)

SHM_PREFIX = EnvVar(
    "EPD_SHM_PREFIX",
    str,
    lambda: "epd_",
    "names of the POSIX shared-memory segments this process creates start with it",
)
SHM_RECLAIM = EnvVar(
    "EPD_SHM_RECLAIM",
    lambda value: value.lower() in ("1", "true", "yes"),
    lambda: False,
    "EPD_SHM_PREFIX is this service's alone: at start, remove the segments a killed "
    "predecessor left under it (a container that restarts; `epd serve` sets it for "
    "each part), and an encoder unregisters the regions it left at Triton",
)


def parse_cpus(value: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6)."""
    cpus: list[int] = []
    for part in value.split(","):
        low, _, high = part.strip().partition("-")
        cpus += range(int(low), int(high or low) + 1)
    if not cpus:
        raise ValueError("no CPUs")
    return tuple(sorted(set(cpus)))


CPUS: EnvVar[tuple[int, ...]] = EnvVar(
    "EPD_CPUS",
    parse_cpus,
    lambda: (),
    "run this process (and torch's threads) on these CPUs only, e.g. 0-3",
)

NICE = EnvVar(
    "EPD_NICE",
    int,
    lambda: 0,
    "raise this process's niceness (lower its CPU priority) at start-up, threads included",
)

CLUSTER_TOKEN = EnvVar(
    "EPD_CLUSTER_TOKEN",
    str,
    lambda: "",
    "the secret every internal gRPC call carries (empty: the servers take any caller)",
)
TLS_CERT = EnvVar("EPD_TLS_CERT", str, lambda: "", "PEM certificate chain: gRPC over TLS")
TLS_KEY = EnvVar("EPD_TLS_KEY", str, lambda: "", "PEM private key of EPD_TLS_CERT")
TLS_CA = EnvVar(
    "EPD_TLS_CA",
    str,
    lambda: "",
    "PEM roots to verify peers with; servers then require client certs",
)

TRACE = EnvVar(
    "EPD_TRACE",
    lambda raw: raw.lower() in ("1", "true", "yes", "on"),
    lambda: False,
    "trace every request (OpenTelemetry), kept in each process for `epd trace`; "
    "OTEL_EXPORTER_OTLP_ENDPOINT also exports them",
)


def parse_port_range(value: str) -> range:
    """'20000-26000' -> range(20000, 26001)."""
    low, _, high = value.partition("-")
    span = range(int(low), int(high) + 1)
    if not 1024 <= span.start < span.stop <= 65536 or len(span) < 200:
        raise ValueError("want LOW-HIGH, at least 200 ports between 1024 and 65535")
    return span


FREE_PORTS: EnvVar[range | None] = EnvVar(
    "EPD_FREE_PORTS",
    parse_port_range,
    lambda: None,
    "where free_port() and free_serve_ports() pick free ports from, e.g. 20000-26000 "
    "(default: outside the kernel's ephemeral range); processes that pick side by side "
    "take disjoint ranges and never race for one port",
)

TRITON_OTLP_ENDPOINT = EnvVar(
    "EPD_TRITON_OTLP_ENDPOINT",
    str,
    lambda: "",
    "OTLP/HTTP URL Triton exports its own spans to (http://collector:4318/v1/traces): "
    "its requests join the encoders' traces, queue and compute times included",
)

ALL = (
    BROKER,
    TRITON_URL,
    TRITON_HTTP_URL,
    CHECKPOINT,
    HOST_ID,
    API_KEY,
    CACHE_DIR,
    KERNEL_MARCH,
    DTYPE,
    SHM_PREFIX,
    SHM_RECLAIM,
    CPUS,
    NICE,
    CLUSTER_TOKEN,
    TLS_CERT,
    TLS_KEY,
    TLS_CA,
    TRACE,
    FREE_PORTS,
    TRITON_OTLP_ENDPOINT,
)
