"""A peer that freezes (SIGSTOP: its TCP connection stays up, nothing answers)
fails the calls to it within keepalive time + timeout, not at their deadline:
the channels every EPD client uses (services/runtime/grpc_server.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.grpc_server import channel
from services.runtime.ports import free_port

# a server whose health check takes a minute: the call is in flight when it freezes
SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services.runtime.grpc_server import SERVER_OPTIONS

class Slow(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        await asyncio.sleep(60)
        return health_pb2.HealthCheckResponse()

async def main():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
    server.add_insecure_port(sys.argv[1])
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def test_a_frozen_server_fails_a_call_in_flight_within_keepalive() -> None:
    address = f"127.0.0.1:{free_port()}"
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, address, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        assert (await server.stdout.readline()).strip() == b"serving"
        async with channel(address) as ch:
            call = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=40)
            await asyncio.sleep(1)  # the call is in flight, the server sleeping in it
            assert not call.done()
            os.kill(server.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                await call
                raise AssertionError("the call to a frozen server succeeded")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert time.monotonic() - frozen < 12  # a ping every 5 s, 3 s to answer
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        await server.wait()
