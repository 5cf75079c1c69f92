"""EmbeddingCache: image embeddings by content hash, LRU within a byte budget;
it keeps what entered and left it since the last report, for the broker's
cache-aware routing."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.wire.messages import CacheReport, MediaGrid


@dataclass(frozen=True, slots=True)
class ImageEmbedding:
    planes: tuple[torch.Tensor, ...]  # [tokens, width] per plane: embeddings, then deepstack
    grid: MediaGrid

    @property
    def num_tokens(self) -> int:
        return int(self.planes[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)


class EmbeddingCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self._added: set[str] = set()  # since the last report
        self._evicted: set[str] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> ImageEmbedding | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: ImageEmbedding) -> None:
        if entry.nbytes > self.max_bytes:
            return  # would evict everything and still not fit
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        self._entries[key] = entry
        self.bytes_used += entry.nbytes
        self._added.add(key)
        self._evicted.discard(key)
        while self.bytes_used > self.max_bytes:
            gone, evicted = self._entries.popitem(last=False)
            self.bytes_used -= evicted.nbytes
            self._evicted.add(gone)
            self._added.discard(gone)

    def report(self, full: bool = False) -> CacheReport:
        """What entered and left since the last report (or, full, every key held)."""
        report = (
            CacheReport(added=tuple(self._entries), full=True)
            if full
            else CacheReport(added=tuple(self._added), evicted=tuple(self._evicted))
        )
        self._added.clear()
        self._evicted.clear()
        return report
