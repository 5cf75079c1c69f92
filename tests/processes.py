"""Services as real child processes (`epd ...`), for tests that kill them."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from services.runtime import env
from services.runtime.children import die_with_parent
from services.transfer.shared_memory import remove_segments


@contextlib.contextmanager
def epd_process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Runs `epd ARGS`, output to `log`; killed on exit if still alive, and the
    shared memory it may leave when killed is removed."""
    prefix = f"epd_test_{secrets.token_hex(3)}_"
    with log.open("wb") as out:
        process = subprocess.Popen(
            die_with_parent([sys.executable, "-m", "services.launcher.cli", *args]),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, env.SHM_PREFIX.name: prefix},
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            remove_segments(prefix)


def family(root: int) -> dict[int, str]:
    """Every live descendant of `root`: its command line (arguments joined by
    spaces), by pid."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    family, frontier = {}, [root]
    while frontier:
        for pid in children.get(frontier.pop(), ()):
            with contextlib.suppress(OSError):
                family[pid] = (
                    Path(f"/proc/{pid}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
                frontier.append(pid)
    return family


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def served(
    checkpoint: Path,
    model_name: str,
    logs: Path,
    *flags: str,
    ports: dict[str, int] | None = None,
) -> Iterator[str]:
    """`epd serve` on a checkpoint (context 512 tokens, a 64 MB KV cache, `flags`
    added: `--monolithic`, ...) until the block ends, then stopped cleanly; its URL.
    Every component on a port of `ports` (`free_serve_ports()`; a free block for
    two encoders and two language instances when not given): a default port may
    be held by a stack that is still stopping, or by anything else on the machine."""
    from services.launcher.serve import launch
    from services.runtime.ports import free_serve_ports, serve_port_args

    ports = ports or free_serve_ports(encoders=2, languages=2)
    port = ports["port"]
    process = launch(
        [
            *serve_port_args(ports),
            *flags,
            "--model",
            str(checkpoint),
            "--model-name",
            model_name,
            "--max-model-len",
            "512",
            "--kv-cache-mb",
            "64",
            "--log-dir",
            str(logs),
        ]
    )
    yield f"http://127.0.0.1:{port}"
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0
