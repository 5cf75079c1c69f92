"""grpc: the encoder streams a part as EmbeddingChunks to Language.PushEmbeddings,
directly to the language instance (never through the broker)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from services.proto import language_pb2
from services.runtime.grpc_server import channel
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import token_rows
from services.transfer.transports.base import (
    Part,
    WrittenBeforeDone,
    check_compatible,
    receiver_layout,
)
from services.wire.messages import GrpcPool, Register
from services.wire.transport import Transport

# Smaller chunks overlap the receiver's pool writes with the network (measured
# across two namespace hosts: 1 MiB 1.1-1.2 GB/s, 4 MiB 0.75-1.0 GB/s).
CHUNK_BYTES = 1024 * 1024


# Language.PushEmbeddings, called with chunks this module encodes itself (below)
PUSH_EMBEDDINGS = "/epd.v1.Language/PushEmbeddings"
_PLANES = language_pb2.EmbeddingChunk.DESCRIPTOR.fields_by_name["planes"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_runs(
    rows: torch.Tensor, blocks: Sequence[int], block_size: int, start: int, count: int
) -> list[memoryview]:
    """Tokens [start, start + count) of the block list: each contiguous run's bytes,
    in place."""
    runs = token_rows(blocks, block_size, start, count)
    return [rows[row : row + n].view(torch.uint8).numpy().data for row, n in runs]


def encoded_chunk(header: language_pb2.EmbeddingChunk, planes: Sequence[list[memoryview]]) -> bytes:
    """An EmbeddingChunk's wire bytes: the header's fields, then each plane as a
    `planes` field (a message's encoding is the concatenation of its fields'),
    each run's bytes copied once, straight into the result: building the message
    and serialising it would copy every byte twice more. The receiver parses it
    as any EmbeddingChunk."""
    parts = [header.SerializeToString()]
    tag = _varint(_PLANES << 3 | 2)  # length-delimited
    for runs in planes:
        parts += [tag, _varint(sum(run.nbytes for run in runs)), *runs]
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Chunk:
    """An EmbeddingChunk as the receiver takes it: its planes are views of the
    bytes that arrived."""

    request_id: str
    start_token: int
    num_tokens: int
    encoder_instance_id: str
    planes: list[memoryview]


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("EmbeddingChunk: truncated or overlong varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def decoded_chunk(data: bytes) -> Chunk:
    """Any EmbeddingChunk's wire bytes (ours, or grpcurl's): each `planes` field
    is kept as a view of `data`, the other fields, put together, are parsed by
    protobuf. The message's own accessor would copy every plane into a new
    bytes object, on the receiver's busiest path. DecodeError as protobuf's."""
    view, planes, header, pos = memoryview(data), [], [], 0
    while pos < len(view):
        begin = pos
        key, pos = _read_varint(view, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, pos = _read_varint(view, pos)
            if key >> 3 == _PLANES:
                planes.append(view[pos : pos + length])
                pos += length
                continue
            pos += length
        else:
            raise DecodeError(f"EmbeddingChunk: unexpected wire type {wire_type}")
        header.append(view[begin:pos])
    if pos != len(view):  # a field ran past the end
        raise DecodeError("EmbeddingChunk: truncated")
    fields = language_pb2.EmbeddingChunk.FromString(b"".join(header))
    return Chunk(
        fields.request_id,
        fields.start_token,
        fields.num_tokens,
        fields.encoder_instance_id,
        planes,
    )


class GrpcReceiveEnd(WrittenBeforeDone):
    """Chunks arrive at this instance's Language.PushEmbeddings (the servicer
    hands them to the receiver, which counts them)."""

    transport = Transport.GRPC

    def __init__(self, address: Callable[[], str]) -> None:
        self.address = address  # known once the server listens

    def endpoint(self) -> GrpcPool:
        return GrpcPool(self.address())


class GrpcWriter:
    transport = Transport.GRPC

    def __init__(self, instance_id: str, timeout_s: float = 60.0) -> None:
        self.instance_id = instance_id  # named in every chunk: the receiver checks the sender
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _push(self, peer: Register) -> grpc.aio.StreamUnaryMultiCallable:
        """PushEmbeddings on the peer, taking chunks already encoded."""
        assert peer.pool is not None and peer.pool.grpc is not None
        ch = self._channels.get(peer.instance_id)
        if ch is None:
            ch = self._channels[peer.instance_id] = channel(peer.pool.grpc.address)
        return ch.stream_unary(
            PUSH_EMBEDDINGS,
            request_serializer=None,  # bytes as they are
            response_deserializer=language_pb2.PushEmbeddingsReply.FromString,
        )

    async def write(self, peer: Register, source: EmbeddingPool, part: Part) -> None:
        check_compatible(source.layout, receiver_layout(peer), peer.instance_id)
        per_chunk = max(1, CHUNK_BYTES // source.layout.token_bytes)
        bs = source.layout.block_size

        async def chunks() -> AsyncIterator[bytes]:
            for offset in range(0, part.count, per_chunk):
                n = min(per_chunk, part.count - offset)
                start = part.start + offset
                header = language_pb2.EmbeddingChunk(
                    request_id=part.request_id,
                    start_token=start,
                    num_tokens=n,
                    encoder_instance_id=self.instance_id,
                )
                planes = [
                    chunk_runs(rows, part.src_blocks, bs, start, n) for rows in source.tensors
                ]
                yield encoded_chunk(header, planes)

        reply = await self._push(peer)(chunks(), timeout=self.timeout_s)
        if reply.received_tokens != part.count:
            raise RuntimeError(
                f"{peer.instance_id} took {reply.received_tokens} of {part.count} tokens"
            )

    async def forget(self, instance_id: str) -> None:
        ch = self._channels.pop(instance_id, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
