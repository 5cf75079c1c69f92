"""The paged KV cache and its block manager.

Per layer one tensor [num_pages, 2, page_size, kv_heads, head_dim] (FlashInfer's
NHD layout: index 0 keys, 1 values). Token i of a request lives in page
block_table[i // page_size], slot i % page_size; its flat slot is
page * page_size + slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.language.engine.request import Request
from services.model.spec import TextSpec
from services.transfer.allocator import BlockAllocator


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    num_pages: int
    page_size: int = 16
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_budget(
        cls, spec: TextSpec, budget_bytes: int, page_size: int, dtype: torch.dtype
    ) -> KVCacheConfig:
        element = torch.empty((), dtype=dtype).element_size()
        page_bytes = spec.num_layers * 2 * page_size * spec.num_kv_heads * spec.head_dim * element
        num_pages = budget_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_bytes} bytes"
            )
        return cls(num_pages, page_size, dtype)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class KVCache:
    def __init__(self, spec: TextSpec, config: KVCacheConfig, device: torch.device) -> None:
        self.config = config
        shape = (config.num_pages, 2, config.page_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=config.dtype, device=device) for _ in range(spec.num_layers)
        ]


class KVBlockManager:
    """Grows and frees requests' block tables on the shared allocator."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.page_size = config.page_size
        self.allocator = BlockAllocator(config.num_pages, config.page_size)

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used_blocks

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Extends the block table to hold num_new_tokens more; False if pages ran out."""
        need = self.pages_needed(request, num_new_tokens)
        if need == 0:
            return True
        pages = self.allocator.allocate_blocks(need)
        if pages is None:
            return False
        request.block_table.extend(pages)
        return True

    def free(self, request: Request) -> None:
        self.allocator.free(request.block_table)
        request.block_table = []
