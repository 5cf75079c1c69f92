"""Children started with `die_with_parent`: they end with their parent, and they
start while this process's gRPC threads are busy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.runtime.children import die_with_parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has died too
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_child_dies_with_its_parent_even_when_the_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from services.runtime.children import die_with_parent\n"
            "child = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its SIGKILLed parent"


@pytest.fixture
def busy_grpc() -> Iterator[None]:
    """A gRPC server and a client calling it without pause, on a thread of this process."""
    stop = threading.Event()
    calls = 0

    async def serve_and_call() -> None:
        nonlocal calls
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                await stub.Check(health_pb2.HealthCheckRequest())
                calls += 1
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(serve_and_call(),))
    thread.start()
    while calls < 10:
        time.sleep(0.01)
    yield
    stop.set()
    thread.join(10)


def test_children_start_while_grpc_threads_are_busy(busy_grpc: None) -> None:
    # Forked (preexec_fn), about 1 child in 5 crashed in gRPC's fork handlers here.
    for _ in range(60):
        child = subprocess.run(
            die_with_parent([sys.executable, "-c", "print('started')"]),
            capture_output=True,
            text=True,
            start_new_session=True,
            timeout=30,
        )
        assert child.returncode == 0 and child.stdout == "started\n", child.stderr
