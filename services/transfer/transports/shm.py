"""shm: the encoder maps the language pool's shared-memory segments and copies runs."""

from __future__ import annotations

from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.shared_memory import SharedSegment
from services.transfer.transports.base import (
    MappedWriter,
    Part,
    ThreadCopies,
    WrittenBeforeDone,
    copy_part,
    receiver_layout,
)
from services.wire.messages import Register, ShmPool
from services.wire.transport import Transport


class _MappedPool:
    """A language pool's segments mapped into this process, one per plane."""

    def __init__(self, peer: Register) -> None:
        assert peer.pool is not None and peer.pool.shm is not None
        self.layout = receiver_layout(peer)
        names = peer.pool.shm.segment_names
        if len(names) != len(self.layout.planes):
            raise ValueError(
                f"{peer.instance_id}: {len(names)} segments for {self.layout.describe()}"
            )
        self.segments = [SharedSegment.attach(name) for name in names]
        self.tensors = [
            segment.tensor(self.layout.dtype, (self.layout.num_rows, plane.width))
            for segment, plane in zip(self.segments, self.layout.planes, strict=True)
        ]
        self.copies = ThreadCopies()

    def close(self) -> None:
        self.tensors = []  # views first: a segment cannot close while one exports its buffer
        for segment in self.segments:
            segment.close()


class ShmReceiveEnd(WrittenBeforeDone):
    """The language pool in shared memory, reached by its segments' names."""

    transport = Transport.SHM

    def __init__(self, pool: EmbeddingPool) -> None:
        if not pool.segments:
            raise ValueError("the shm transport needs a pool in shared memory")
        self.pool = pool

    def endpoint(self) -> ShmPool:
        return ShmPool(self.pool.shm_names)


class ShmWriter(MappedWriter[_MappedPool]):
    transport = Transport.SHM

    def _map(self, peer: Register) -> _MappedPool:
        return _MappedPool(peer)

    def _copy(self, source: EmbeddingPool, mapped: _MappedPool, part: Part) -> None:
        copy_part(source, mapped.tensors, mapped.layout.block_size, part)
