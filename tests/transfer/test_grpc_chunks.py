"""The gRPC stream's chunks, which it encodes itself (its runs copied once into
the wire bytes): any EmbeddingChunk parser reads them back, every plane's bytes
exactly those of the tokens, whatever the dtype, the blocks and the size."""

from __future__ import annotations

import pytest
import torch

from services.proto import language_pb2
from services.transfer.embedding_pool import read_tokens, tensor_bytes
from services.transfer.transports.grpc_stream import chunk_runs, encoded_chunk


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
