"""The gRPC stream's chunks, which it encodes itself (its runs copied once into
the wire bytes): any EmbeddingChunk parser reads them back, every plane's bytes
exactly those of the tokens, whatever the dtype, the blocks and the size; and
the receiver's own parser (planes as views of what arrived) reads any
EmbeddingChunk as protobuf does, and refuses what protobuf refuses."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError

from services.proto import language_pb2
from services.transfer.embedding_pool import read_tokens, tensor_bytes, tensor_from_bytes
from services.transfer.transports.grpc_stream import chunk_runs, decoded_chunk, encoded_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("blocks", "start", "count"), [([5, 2, 7, 9], 3, 10), ([0, 1], 0, 8)])
def test_an_encoded_chunk_parses_to_its_tokens(
    dtype: torch.dtype, blocks: list[int], start: int, count: int
) -> None:
    planes = [torch.randn(64, 8).to(dtype), torch.randn(64, 24).to(dtype)]
    header = language_pb2.EmbeddingChunk(
        request_id="r", start_token=start, num_tokens=count, encoder_instance_id="e"
    )
    wire = encoded_chunk(header, [chunk_runs(rows, blocks, 4, start, count) for rows in planes])
    chunk = language_pb2.EmbeddingChunk.FromString(wire)
    assert (chunk.request_id, chunk.start_token, chunk.num_tokens) == ("r", start, count)
    assert chunk.encoder_instance_id == "e"
    assert list(chunk.planes) == [
        tensor_bytes(read_tokens(rows, blocks, 4, start, count)) for rows in planes
    ]


def test_a_plane_of_megabytes_keeps_its_length() -> None:
    """Lengths past one varint byte (and past 2**21) encode as the parser expects."""
    rows = torch.randn(300_000, 8)
    header = language_pb2.EmbeddingChunk(request_id="big", num_tokens=300_000)
    wire = encoded_chunk(header, [chunk_runs(rows, [0], 300_000, 0, 300_000)])
    (plane,) = language_pb2.EmbeddingChunk.FromString(wire).planes
    assert plane == tensor_bytes(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoded_chunk_views_the_planes_it_was_sent(dtype: torch.dtype) -> None:
    """Our parser on our encoding: the fields, and each plane's tokens exact, read
    in place (the header's odd length leaves the planes unaligned)."""
    planes = [torch.randn(64, 8).to(dtype), torch.randn(64, 24).to(dtype)]
    header = language_pb2.EmbeddingChunk(
        request_id="odd", start_token=3, num_tokens=10, encoder_instance_id="enc"
    )
    blocks = [5, 2, 7, 9]
    wire = encoded_chunk(header, [chunk_runs(rows, blocks, 4, 3, 10) for rows in planes])
    chunk = decoded_chunk(wire)
    assert (chunk.request_id, chunk.start_token, chunk.num_tokens) == ("odd", 3, 10)
    assert chunk.encoder_instance_id == "enc"
    for view, rows in zip(chunk.planes, planes, strict=True):
        assert view.obj is wire  # no copy
        got = tensor_from_bytes(view, dtype, rows.shape[1])
        assert torch.equal(got, read_tokens(rows, blocks, 4, 3, 10))


@pytest.mark.parametrize(
    "message",
    [
        language_pb2.EmbeddingChunk(),
        language_pb2.EmbeddingChunk(request_id="r", num_tokens=2**32 - 1, planes=[b""]),
        language_pb2.EmbeddingChunk(
            request_id="r" * 200, start_token=300, planes=[b"\1" * 200, b"", b"\2" * 3]
        ),
    ],
)
def test_any_embedding_chunk_decodes_as_protobuf_reads_it(
    message: language_pb2.EmbeddingChunk,
) -> None:
    """Protobuf's own encoding (grpcurl's), fields in any order and lengths of
    several varint bytes, decodes to the same fields and planes."""
    chunk = decoded_chunk(message.SerializeToString())
    assert (chunk.request_id, chunk.start_token, chunk.num_tokens) == (
        message.request_id,
        message.start_token,
        message.num_tokens,
    )
    assert [bytes(p) for p in chunk.planes] == list(message.planes)
    reordered = language_pb2.EmbeddingChunk(planes=message.planes).SerializeToString()
    reordered += language_pb2.EmbeddingChunk(request_id=message.request_id).SerializeToString()
    assert decoded_chunk(reordered).request_id == message.request_id


@pytest.mark.parametrize(
    "wire",
    [
        language_pb2.EmbeddingChunk(request_id="r", planes=[b"abcd"]).SerializeToString()[:-1],
        b"\x18",  # num_tokens without its value
        b"\x18\xff\xff",  # a varint that never ends
        b"\x3b",  # a group (wire type 3)
        b"\x0a\x02\xff\xfe",  # request_id that is not UTF-8
    ],
)
def test_a_malformed_chunk_is_refused(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        language_pb2.EmbeddingChunk.FromString(wire)
    with pytest.raises(DecodeError):
        decoded_chunk(wire)
