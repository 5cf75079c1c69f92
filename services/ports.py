"""Free TCP ports on loopback."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

LOWEST = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free port on loopback, outside the kernel's ephemeral range when it
    can: a port from that range may be taken by any outgoing connection between
    this check and the server's bind (seen: tritonserver failing with 'Address
    already in use' on a port picked a second earlier)."""
    low, high = _ephemeral_range()
    spans = [span for span in (range(LOWEST, low), range(high + 1, 65536)) if len(span) > 100]
    pick = random.SystemRandom()
    for _ in range(200 if spans else 0):
        port = pick.choice(pick.choice(spans))
        if _bindable(port):
            return port
    with socket.socket() as s:  # no room outside the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(offsets: Sequence[int]) -> int:
    """A base port such that base + each offset is free on loopback (for a stack
    whose instances take consecutive ports, and their metrics ports + 100)."""
    for _ in range(200):
        base = free_port()
        if base + max(offsets) >= 65536:
            continue
        sockets: list[socket.socket] = []
        try:
            for offset in offsets:
                probe = socket.socket()
                sockets.append(probe)
                probe.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
    raise OSError("no block of free ports on loopback")
