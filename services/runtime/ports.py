"""Each service's default port, free TCP ports on loopback, and claims on ports
that `epd serve` holds from its checks until its children have bound them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import tempfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

LOWEST = 20000

# the ports free_port() and free_port_block() handed out last in this process:
# a pick is not bound until its server starts, so a pick right after it would
# find it free too (seen: Triton given one port for HTTP and gRPC)
_handed_out: deque[int] = deque(maxlen=1024)

# each service's port when none is given (kept here, not in the servers, so that
# `epd`'s argument parser imports no server: each process imports only its own)
GATEWAY_PORT = 8000
BROKER_PORT = 50051
ENCODER_PORT = 50061
LANGUAGE_PORT = 50071
TRITON_HTTP_PORT = 8010
TRITON_GRPC_PORT = 8011
TRITON_METRICS_PORT = 8012
TRITON_URL = f"127.0.0.1:{TRITON_GRPC_PORT}"  # an encoder's own Triton


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    """Whether a socket binds to the port now (`reuse`: with SO_REUSEADDR, which
    a stopped server's connections in TIME_WAIT do not refuse; a listener does)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def listened_on(host: str, ports: Sequence[int]) -> list[int]:
    """The ports of `ports` that a server already listens on at `host`: a server
    about to bind there would fail, and a readiness check on them would ask that
    other server."""
    return [port for port in ports if not _bindable(port, host, reuse=True)]


def _spans() -> list[range]:
    """Where free ports are picked: EPD_FREE_PORTS, else outside the kernel's
    ephemeral range."""
    from services.runtime import env  # env's defaults name this module's ports

    chosen = env.FREE_PORTS.get()
    if chosen is not None:
        return [chosen]
    low, high = ephemeral_range()
    return [span for span in (range(LOWEST, low), range(high + 1, 65536)) if len(span) > 100]


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    return inodes


def holder(port: int) -> str | None:
    """What listens on `port`, as 'pid N (its command line)', where this user may
    see it; None otherwise."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for proc in Path("/proc").iterdir() if wanted else ():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone, or not this user's to read
            if _links(proc / "fd") & wanted:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                return f"pid {proc.name} ({' '.join(command.split())[:80]})"
    return None


def port_taken(what: str, host: str, port: int) -> OSError:
    """The error of a listener that could not bind `port`: which one, and what
    holds it (`epd serve` checks its ports, but another process may take one
    before its child binds it)."""
    who = holder(port)
    why = f"in use by {who}" if who else "in use, or not an address of this machine"
    return OSError(errno.EADDRINUSE, f"{what} cannot listen on {host}:{port}: {why}")


def _links(fds: Path) -> set[str]:
    links = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # closed since the listing
            links.add(os.readlink(fd))
    return links


def free_port() -> int:
    """A free port on loopback, outside the kernel's ephemeral range when it
    can: a port from that range may be taken by any outgoing connection between
    this check and the server's bind (seen: tritonserver failing with 'Address
    already in use' on a port picked a second earlier). Never one of the last
    ports this process handed out."""
    spans = _spans()
    pick = random.SystemRandom()
    for _ in range(200 if spans else 0):
        port = pick.choice(pick.choice(spans))
        if port not in _handed_out and _bindable(port):
            _handed_out.append(port)
            return port
    with socket.socket() as s:  # no room outside the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.append(port)
    return port


def free_port_block(offsets: Sequence[int]) -> int:
    """A base port such that base + each offset is free on loopback (for a stack
    whose instances take consecutive ports, and their metrics ports + 100)."""
    for _ in range(200):
        base = free_port()
        ports = [base + offset for offset in offsets]
        if max(ports) >= 65536 or any(port in _handed_out for port in ports if port != base):
            continue
        sockets: list[socket.socket] = []
        try:
            for port in ports:
                probe = socket.socket()
                sockets.append(probe)
                probe.bind(("127.0.0.1", port))
            _handed_out.extend(port for port in ports if port != base)
            return base
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
    raise OSError("no block of free ports on loopback")


# `epd serve`'s port flags and their offsets in one block; the encoders and the
# language instances count up from theirs (up to MAX_INSTANCES of each)
SERVE_PORTS = {
    "port": 0,
    "broker-port": 1,
    "triton-http-port": 2,
    "triton-grpc-port": 3,
    "triton-metrics-port": 4,
    "encoder-port": 10,
    "language-port": 20,
}
MAX_INSTANCES = 10
# a gRPC component's Prometheus port is its own + this (StackConfig.metrics_offset)
METRICS_OFFSET = 100


def free_serve_ports(encoders: int = 1, languages: int = 1) -> dict[str, int]:
    """Free ports for one `epd serve` (this many encoders and language instances)
    by its flags' names, metrics ports included: ports picked one by one could put
    a component near 65535, where its metrics port (+100) does not exist."""
    if max(encoders, languages) > MAX_INSTANCES:
        raise ValueError(f"at most {MAX_INSTANCES} encoders and language instances")
    grpc = [SERVE_PORTS["broker-port"]]
    grpc += [SERVE_PORTS["encoder-port"] + i for i in range(encoders)]
    grpc += [SERVE_PORTS["language-port"] + i for i in range(languages)]
    base = free_port_block(
        sorted({*SERVE_PORTS.values(), *grpc, *(p + METRICS_OFFSET for p in grpc)})
    )
    return {flag: base + offset for flag, offset in SERVE_PORTS.items()}


def serve_port_args(ports: dict[str, int]) -> list[str]:
    """`free_serve_ports()` as `epd serve` flags."""
    return [arg for flag, port in ports.items() for arg in (f"--{flag}", str(port))]


class PortClaims:
    """Ports this process claims on this host, against every other process that
    claims ports here (each `epd serve`): a file a port, locked with flock(2),
    so the kernel lets the claims go when the process ends, however it ends.

    A port is checked free, then bound by a child seconds later: two `epd serve`
    started together both found their ports free, and both died when their
    children bound them. A claim closes that window. Claims are kept per user
    and per network namespace (hosts in network namespaces share /tmp)."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        try:
            namespace = os.readlink("/proc/self/ns/net").removeprefix("net:[").rstrip("]")
        except OSError:
            namespace = "host"
        self._folder = Path(tempfile.gettempdir()) / f"epd-{os.getuid()}" / "ports" / namespace
        self._folder.mkdir(parents=True, exist_ok=True)

    def take(self, port: int) -> str | None:
        """Claims `port`: None once claimed, else who holds it ('pid N')."""
        fd = os.open(self._folder / str(port), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 16, 0).decode(errors="replace").strip()
            os.close(fd)
            return f"pid {pid}" if pid else "another process"
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fds.append(fd)
        return None

    def close(self) -> None:
        """Lets every claim go (the process's end does it too)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> PortClaims:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
