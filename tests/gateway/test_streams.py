"""The gateway's side of Language.GenerateStream (services/gateway/streams.py)
against a scripted language servicer on a real gRPC server: what one request's
bad response or a broken stream does to the calls on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from services.gateway.streams import GenerateStreams, StreamedCall
from services.proto import language_pb2, language_pb2_grpc
from services.runtime.grpc_server import channel
from services.wire.request import GenerateComplete, GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")


class _Scripted(language_pb2_grpc.LanguageServicer):
    """Answers the first two requests on a stream in one message: the first with
    a completion whose finish reason is no FinishReason, the second with a valid
    one; then breaks the stream with `break_code` if it has one."""

    def __init__(self, break_code: grpc.StatusCode | None) -> None:
        self.break_code = break_code

    async def GenerateStream(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        ids = []
        async for message in requests:
            ids.append(message.start.request.request_id)
            if len(ids) == 2:
                break
        bad, good = ids
        yield language_pb2.GenerateStreamResponse(
            responses=[
                language_pb2.GenerateResponse(
                    request_id=bad, complete=language_pb2.GenerateComplete(finish_reason=99)
                ),
                language_pb2.GenerateResponse(
                    request_id=good,
                    complete=language_pb2.GenerateComplete(
                        finish_reason=language_pb2.FINISH_REASON_STOP, completion_tokens=1
                    ),
                ),
            ],
            ends=[language_pb2.GenerateEnd(request_id=good)],
        )
        if self.break_code is not None:
            await context.abort(self.break_code, "the instance went away")
        await asyncio.Event().wait()


# INTERNAL: what gRPC's client can report for a stream that ended as a write of ours ran
@pytest_asyncio.fixture(
    loop_scope="session",
    params=[None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL],
    ids=["serving", "breaking", "breaking-internal"],
)
async def scripted(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, bool]]:
    server = grpc.aio.server()
    language_pb2_grpc.add_LanguageServicer_to_server(_Scripted(request.param), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    yield address, request.param is not None
    await server.stop(None)


def start(streams: GenerateStreams, address: str, request_id: str) -> StreamedCall:
    request = GenerateRequest(request_id, sampling=SamplingParams(max_tokens=1))
    return streams.call(address, channel(address), request, timeout_s=10)


async def test_a_bad_response_ends_its_request_alone_and_a_broken_stream_ends_all(
    scripted: tuple[str, bool],
) -> None:
    address, breaking = scripted
    streams = GenerateStreams()
    bad, good = start(streams, address, "bad"), start(streams, address, "good")
    waiting = start(streams, address, "waiting")  # never answered
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in bad]
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "not valid" in (info.value.details() or "")
    (response,) = [r async for r in good]
    assert isinstance(response.kind, GenerateComplete)
    if breaking:  # every call still on the stream ends UNAVAILABLE, whatever broke it
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in waiting]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # (gRPC's own "Internal error from Core" may stand for the servicer's details)
        assert "the stream to the language instance broke" in (info.value.details() or "")
    else:
        assert waiting.items.empty() and not waiting.ended
        waiting.cancel()
    await streams.close()


async def test_a_second_call_under_an_id_in_flight_is_refused_and_the_first_goes_on(
    scripted: tuple[str, bool],
) -> None:
    address, _ = scripted
    streams = GenerateStreams()
    first = start(streams, address, "twice")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in start(streams, address, "twice")]
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert streams._streams[address].calls["twice"] is first
    first.cancel()
    await streams.close()
