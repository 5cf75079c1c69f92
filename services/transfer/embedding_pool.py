"""EmbeddingPool: embedding storage in blocks, in memory a transport can reach.

    embeddings  [num_blocks * block_size, hidden]              (flat rows)
    deepstack   [num_blocks * block_size, levels * hidden]     (only with deepstack)

The language side receives into one (POSIX shared memory on CPU, a CUDA
tensor on GPU; NIXL registers either once at start-up); the encoder's send
buffer is one in its own memory. Block bookkeeping is the BlockAllocator.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from services.transfer.allocator import BlockAllocator
from services.transfer.layout import PoolLayout, token_rows
from services.transfer.shared_memory import SharedSegment


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor (any dtype, bfloat16 included)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A read-only [n, width] view of received bytes, to be copied into a pool."""
    if len(data) % (width * torch.empty((), dtype=dtype).element_size()):
        raise ValueError(f"{len(data)} bytes is not a whole number of {width}-wide {dtype} rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(data, dtype=dtype).view(-1, width)


def write_tokens(
    rows: torch.Tensor, blocks: Sequence[int], block_size: int, start: int, values: torch.Tensor
) -> None:
    """rows[...] for tokens [start, start + len(values)) of the block list <- values."""
    done = 0
    for row, length in token_rows(blocks, block_size, start, values.shape[0]):
        rows[row : row + length].copy_(values[done : done + length])
        done += length


def read_tokens(
    rows: torch.Tensor, blocks: Sequence[int], block_size: int, start: int, count: int
) -> torch.Tensor:
    """A copy of tokens [start, start + count) of the block list."""
    parts = [
        rows[row : row + length] for row, length in token_rows(blocks, block_size, start, count)
    ]
    return torch.cat(parts) if parts else rows[:0].clone()


class EmbeddingPool:
    def __init__(
        self,
        layout: PoolLayout,
        embeddings: torch.Tensor,
        deepstack: torch.Tensor | None,
        segments: Sequence[SharedSegment] = (),
    ) -> None:
        assert embeddings.shape == (layout.num_rows, layout.hidden_size)
        assert (deepstack is None) == (layout.deepstack_levels == 0)
        self.layout = layout
        self.embeddings = embeddings
        self.deepstack = deepstack
        self.segments = list(segments)
        self.allocator = BlockAllocator(layout.num_blocks, layout.block_size)

    @classmethod
    def in_host_memory(cls, layout: PoolLayout, pin: bool = False) -> EmbeddingPool:
        def alloc(width: int) -> torch.Tensor:
            t = torch.zeros(layout.num_rows, width, dtype=layout.dtype)
            return t.pin_memory() if pin else t

        deepstack = alloc(layout.deepstack_width) if layout.deepstack_levels else None
        return cls(layout, alloc(layout.hidden_size), deepstack)

    @classmethod
    def in_shared_memory(cls, layout: PoolLayout) -> EmbeddingPool:
        embeds_segment = SharedSegment.create(layout.embeddings_bytes, "embeddings")
        segments = [embeds_segment]
        deepstack = None
        if layout.deepstack_levels:
            deep_segment = SharedSegment.create(layout.deepstack_bytes, "deepstack")
            segments.append(deep_segment)
            deepstack = deep_segment.tensor(layout.dtype, (layout.num_rows, layout.deepstack_width))
        embeddings = embeds_segment.tensor(layout.dtype, (layout.num_rows, layout.hidden_size))
        return cls(layout, embeddings, deepstack, segments)

    @classmethod
    def on_cuda(cls, layout: PoolLayout, device: torch.device) -> EmbeddingPool:
        embeddings = torch.zeros(
            layout.num_rows, layout.hidden_size, dtype=layout.dtype, device=device
        )
        deepstack = None
        if layout.deepstack_levels:
            deepstack = torch.zeros(
                layout.num_rows, layout.deepstack_width, dtype=layout.dtype, device=device
            )
        return cls(layout, embeddings, deepstack)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The embeddings, then the deepstack features if the pool holds them."""
        return [self.embeddings] + ([self.deepstack] if self.deepstack is not None else [])

    @property
    def shm_names(self) -> tuple[str, str]:
        """(embeddings, deepstack) segment names; deepstack is '' without deepstack."""
        if not self.segments:
            raise ValueError("this pool is not in shared memory")
        return self.segments[0].name, self.segments[1].name if len(self.segments) > 1 else ""

    def write(
        self,
        blocks: Sequence[int],
        start: int,
        embeddings: torch.Tensor,
        deepstack: torch.Tensor | None = None,
    ) -> None:
        bs = self.layout.block_size
        write_tokens(self.embeddings, blocks, bs, start, embeddings.to(self.layout.dtype))
        if self.deepstack is not None:
            if deepstack is None:
                raise ValueError("this pool holds deepstack features; none were given")
            write_tokens(self.deepstack, blocks, bs, start, deepstack.to(self.layout.dtype))

    def read(
        self, blocks: Sequence[int], start: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bs = self.layout.block_size
        embeddings = read_tokens(self.embeddings, blocks, bs, start, count)
        deepstack = (
            read_tokens(self.deepstack, blocks, bs, start, count)
            if self.deepstack is not None
            else None
        )
        return embeddings, deepstack

    def close(self) -> None:
        # Views first: a segment cannot close while a tensor still exports its buffer.
        self.embeddings = torch.empty(0)
        self.deepstack = None
        for segment in self.segments:
            segment.close()
        self.segments = []
