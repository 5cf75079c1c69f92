"""SendBuffer: encoded embeddings waiting for their transfer, in a fixed pool.

The pool is allocated (and registered with NIXL) once; when it is full a new
encode waits for space instead of growing memory (backpressure), up to a
deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.encoder.cache import ImageEmbedding
from services.transfer.block_pool import BlockPool
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.sender_driver import Held
from services.transfer.state import PoolExhaustedError
from services.wire.messages import EmbeddingMeta, MediaGrid


class SendBufferFullError(RuntimeError):
    """No room for the embeddings within the wait allowed."""


class SendBuffer:
    def __init__(self, pool: EmbeddingPool) -> None:
        self.pool = pool
        self.blocks = BlockPool(pool.allocator)
        self._held: dict[str, Held] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.layout.num_rows

    @property
    def bytes_used(self) -> int:
        return (
            self.pool.allocator.num_used_blocks
            * self.pool.layout.block_size
            * self.pool.layout.token_bytes
        )

    def __len__(self) -> int:
        return len(self._held)

    async def hold(self, request_id: str, num_tokens: int, wait_s: float) -> Held:
        """Blocks of the buffer for a request's num_tokens embeddings (`write` fills them)."""
        if num_tokens > self.capacity_tokens:
            raise SendBufferFullError(
                f"{num_tokens} embedding tokens exceed the whole send buffer "
                f"({self.capacity_tokens} tokens)"
            )
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds embeddings")
        try:
            blocks = await self.blocks.allocate(num_tokens, wait_s)
        except PoolExhaustedError:
            raise SendBufferFullError(
                f"send buffer full: no room for {num_tokens} tokens within {wait_s:.0f}s"
            ) from None
        held = self._held[request_id] = Held(request_id, blocks, num_tokens)
        return held

    def write(self, request_id: str, start: int, image: ImageEmbedding) -> None:
        """An image's embeddings into the request's blocks, from token `start`
        (straight from its tensors: no concatenated copy)."""
        self.pool.write(self._held[request_id].blocks, start, image.planes)

    def meta(self, held: Held, language_id: str, grids: Sequence[MediaGrid]) -> EmbeddingMeta:
        """What the transfer of the held embeddings announces (its transport is the
        sender driver's to fill in)."""
        layout = self.pool.layout
        return EmbeddingMeta(
            request_id=held.request_id,
            language_instance_id=language_id,
            total_tokens=held.num_tokens,
            grids=tuple(grids),
            planes=layout.planes,
            dtype=layout.dtype,
        )

    def held(self, request_id: str) -> Held:
        return self._held[request_id]

    def release(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.blocks.free(held.blocks)
