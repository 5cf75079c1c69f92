"""Free TCP ports on loopback."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
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
