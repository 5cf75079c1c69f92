"""Attention over the paged KV cache, behind one interface.

A step's batch is ordered prefills first (query length > 1), then decodes
(query length 1); `plan()` runs once per step, `forward()` once per layer.

    tokens:  [ p0 p0 p0 | p1 p1 | d2 | d3 ]   query_start_loc = [0, 3, 5, 6, 7]
    seq_lens: KV length of each sequence after this step's tokens are appended
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.layers.cpu_kernels import KERNEL_DTYPES, Kernel

# One layer's cache: its keys and its values, each [pages, page_size, kv_heads, head_dim]
# (FlashInfer's NHD layout as a (keys, values) pair).
KVLayer = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    block_tables: list[list[int]]  # [num_seqs][pages]
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    num_prefills: int  # sequences [0, num_prefills) are prefills
    page_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.query_start_loc[self.num_prefills]


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVLayer
    ) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads, dim]; appends k/v to cache."""
        ...


def write_kv(
    cache: KVLayer,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kernel: Kernel | None = None,
) -> None:
    """Appends k/v [T, kv_heads, dim] at their slots, as rows of the keys and the
    values seen as [pages * page_size, kv_heads * dim]: with `kernel`
    (cpu_kernels.kv_writer) one memcpy a row where each token's heads lie side by
    side (as a split of the fused QKV projection leaves them), else index_copy_ of
    whole rows (several times faster on CPU than assigning through advanced
    indexing)."""
    slots = meta.slot_mapping
    keys, values = cache
    if (
        kernel is not None
        and slots.device.type == "cpu"
        and keys.is_contiguous()
        and values.is_contiguous()
        and slots.dtype == torch.long
        and slots.is_contiguous()
        and k.shape == v.shape
        and k.shape[0] == len(slots)
        and k.dtype == v.dtype == keys.dtype == values.dtype
        and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v))
    ):
        width = k.shape[1] * k.shape[2]
        failed = kernel(
            keys.data_ptr(),
            values.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            slots.data_ptr(),
            len(slots),
            keys.numel() // width,
            width,
            k.stride(0),
            v.stride(0),
            k.element_size(),
        )
        if failed:
            raise IndexError("a KV slot lies outside the cache")
        return
    for half, new in zip(cache, (k, v), strict=True):
        half.view(-1, new.shape[1] * new.shape[2]).index_copy_(
            0, slots, new.reshape(len(slots), -1)
        )


def gather_pages(half: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The keys or the values (`half`) of these pages, in order: [pages * page_size,
    kv_heads, dim]. One index_select of whole pages, several times faster on CPU
    than advanced indexing."""
    return half.index_select(0, pages).view(-1, *half.shape[2:])


class TorchAttention:
    """CPU backend: each prefill in the compiled bfloat16 kernel (AMX or
    AVX512-BF16) where given one (head_dim a multiple of 64; it reads the
    prompt's pages in place), else in SDPA over its gathered pages; all decodes
    at once, either in the compiled paged kernel (cpu_kernels.py: reads each
    sequence's pages in place; float32 and bfloat16) or, without it, in one
    padded SDPA over their gathered pages."""

    def __init__(
        self,
        scale: float,
        decode_kernel: Kernel | None = None,
        prefill_kernel: Kernel | None = None,
        kv_writer: Kernel | None = None,
    ) -> None:
        self.scale = scale
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.kv_writer = kv_writer
        self.meta: AttentionMetadata | None = None
        self._prefill_pages: list[torch.Tensor] = []
        self._decode_pages: torch.Tensor | None = None
        self._decode_lens: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        device = meta.slot_mapping.device
        self._prefill_pages = [
            torch.tensor(meta.block_tables[i], device=device) for i in range(meta.num_prefills)
        ]
        decodes = range(meta.num_prefills, meta.num_seqs)
        if not decodes:
            self._decode_pages = self._decode_lens = self._decode_mask = None
            return
        max_pages = max(len(meta.block_tables[i]) for i in decodes)
        tables = (meta.block_tables[i] for i in decodes)
        pages = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables], dtype=torch.long)
        lens = torch.tensor([meta.seq_lens[i] for i in decodes])
        self._decode_pages = pages.to(device)  # [decodes, max_pages], padded with page 0
        self._decode_lens = lens  # the kernel's, on the host
        if self.decode_kernel is None:
            # [decodes, 1, 1, max_pages * page_size]: True where a key exists
            self._decode_mask = (torch.arange(max_pages * meta.page_size) < lens[:, None]).to(
                device
            )[:, None, None, :]

    @staticmethod
    def _gather(half: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
        """[1, kv_heads, length, dim] of one sequence."""
        return gather_pages(half, pages)[:length].transpose(0, 1)[None]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVLayer
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "plan() first"
        write_kv(cache, k, v, meta, self.kv_writer)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        starts = meta.query_start_loc
        in_kernel = meta.num_prefills > 0 and self._prefills_in_kernel(q, cache)
        for i in range(meta.num_prefills):
            s, e, length = starts[i], starts[i + 1], meta.seq_lens[i]
            n = e - s
            if in_kernel:
                self._prefill_paged(out[s:e], q[s:e], cache, self._prefill_pages[i], length)
                continue
            keys = self._gather(cache[0], self._prefill_pages[i], length)
            values = self._gather(cache[1], self._prefill_pages[i], length)
            # [1, heads, n, dim]: SDPA's fused CPU kernel takes 4-D inputs only (3-D ones
            # fall back to the unfused math path, ~2.5x slower)
            query = q[s:e].transpose(0, 1)[None]
            if n == length:
                o = F.scaled_dot_product_attention(
                    query, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                # query j sits at position length - n + j and sees keys [0, that position]
                mask = torch.arange(length, device=q.device)[None, :] <= (
                    torch.arange(n, device=q.device)[:, None] + (length - n)
                )
                o = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            out[s:e] = o[0].transpose(0, 1)
        if self._decode_pages is not None:
            d0 = meta.num_prefill_tokens
            if self.decode_kernel is not None:
                self._decode_paged(out[d0:], q[d0:].contiguous(), cache)
            else:
                out[d0:] = self._decode_gathered(q[d0:], cache)
        return out

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The planned step's decodes: their pages [decodes, max_pages] (padded with
        page 0) and KV lengths [decodes], as the compiled kernel reads them."""
        assert self._decode_pages is not None and self._decode_lens is not None
        return self._decode_pages, self._decode_lens

    def _prefills_in_kernel(self, q: torch.Tensor, cache: KVLayer) -> bool:
        """Whether this step's prefills go to the prefill kernel: bfloat16, whole 64-wide
        blocks of each head, a token's heads side by side."""
        dim = q.shape[2]
        return (
            self.prefill_kernel is not None
            and q.dtype == cache[0].dtype == torch.bfloat16
            and dim % 64 == 0
            and q.stride(2) == 1
            and q.stride(1) == dim
            and cache[0].is_contiguous()
            and cache[1].is_contiguous()
        )

    def _prefill_paged(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        cache: KVLayer,
        pages: torch.Tensor,
        length: int,
    ) -> None:
        """One prompt's new tokens q [n, heads, dim] against its keys where they lie
        (the last n of `length`, causally): out [n, heads, dim], contiguous."""
        assert self.prefill_kernel is not None and self.meta is not None
        keys, values = cache
        failed = self.prefill_kernel(
            out.data_ptr(),
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            pages.data_ptr(),
            q.shape[0],
            length,
            q.shape[1],
            keys.shape[2],
            q.shape[2],
            self.meta.page_size,
            q.stride(0),
            self.scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("prefill attention: no memory for its tiles")

    def _decode_paged(self, out: torch.Tensor, q: torch.Tensor, cache: KVLayer) -> None:
        """The compiled kernel, reading the pages where they lie: out [decodes, heads, dim]."""
        assert self.decode_kernel is not None and self._decode_pages is not None
        assert self._decode_lens is not None and self.meta is not None
        keys, values = cache
        assert q.dtype == keys.dtype in KERNEL_DTYPES
        assert keys.is_contiguous() and values.is_contiguous()
        num, max_pages = self._decode_pages.shape
        failed = self.decode_kernel(
            out.data_ptr(),
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            self._decode_pages.data_ptr(),
            self._decode_lens.data_ptr(),
            num,
            q.shape[1],
            keys.shape[2],
            q.shape[2],
            self.meta.page_size,
            max_pages,
            self.scale,
            int(q.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode attention: no memory for its scores")

    def _decode_gathered(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        """Each sequence's pages copied out, then one padded SDPA: [decodes, heads, dim]."""
        assert self._decode_pages is not None and self.meta is not None
        num, max_pages = self._decode_pages.shape
        pages = self._decode_pages.flatten()
        shape = (num, max_pages * self.meta.page_size, *cache[0].shape[2:])
        keys = gather_pages(cache[0], pages).view(shape)
        values = gather_pages(cache[1], pages).view(shape)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [decodes, heads, 1, dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self._decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[:, :, 0, :]


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """FlashInfer's decode on tensor cores: for query-per-KV-head ratios above 4."""
    return num_heads // num_kv_heads > 4


class FlashInferAttention:
    """GPU backend: FlashInfer's paged prefill and decode wrappers, planned once per step.

    Decode uses the tensor-core kernels where a KV head serves more than 4 query
    heads: FlashInfer's CUDA-core decode kernels exist only for group sizes 1, 2,
    3, 4, 6 and 8 (SGLang's `should_use_tensor_core` draws the same line). The
    page tables are built on the host: `plan()` needs indptr and last-page
    lengths there, and copies what the kernels read to the device itself.

    Written against FlashInfer's documented API; needs CUDA (see the gpu-marked tests).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
        workspace_bytes: int = 128 * 1024 * 1024,
    ) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.dtype, self.device = scale, dtype, device
        # zeroed, as the wrappers' docstrings ask of the float workspace
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD"
        )
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            kv_layout="NHD",
            use_tensor_cores=decode_uses_tensor_cores(num_heads, num_kv_heads),
        )
        self.meta: AttentionMetadata | None = None

    def for_graph(self, batch_size: int, max_pages: int) -> FlashInferAttention:
        """A twin for decode steps of exactly `batch_size` sequences captured in a
        CUDA graph: its decode wrapper keeps the page tables in fixed buffers
        (FlashInfer's `use_cuda_graph`), which `plan()`, run outside the graph,
        refills before each replay. Shares this one's workspace: one step runs
        at a time."""
        import flashinfer

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=self.device)

        twin = copy.copy(self)
        twin.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            kv_layout="NHD",
            use_cuda_graph=True,
            use_tensor_cores=decode_uses_tensor_cores(self.num_heads, self.num_kv_heads),
            paged_kv_indptr_buffer=buffer(batch_size + 1),
            paged_kv_indices_buffer=buffer(max_pages),
            paged_kv_last_page_len_buffer=buffer(batch_size),
        )
        return twin

    def _paging(self, meta: AttentionMetadata, seqs: range) -> tuple[torch.Tensor, ...]:
        indptr, indices, last = [0], [], []
        for i in seqs:
            pages = -(-meta.seq_lens[i] // meta.page_size)
            indices += meta.block_tables[i][:pages]
            indptr.append(len(indices))
            last.append(meta.seq_lens[i] - (pages - 1) * meta.page_size)

        def as_int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)  # host: plan() reads it there

        return as_int32(indptr), as_int32(indices), as_int32(last)

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        if meta.num_prefills:
            indptr, indices, last = self._paging(meta, range(meta.num_prefills))
            qo_indptr = torch.tensor(
                meta.query_start_loc[: meta.num_prefills + 1], dtype=torch.int32
            )
            self.prefill.plan(
                qo_indptr,
                indptr,
                indices,
                last,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.page_size,
                causal=True,
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
        if meta.num_prefills < meta.num_seqs:
            indptr, indices, last = self._paging(meta, range(meta.num_prefills, meta.num_seqs))
            self.decode.plan(
                indptr,
                indices,
                last,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                meta.page_size,
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVLayer
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "plan() first"
        write_kv(cache, k, v, meta)
        split = meta.num_prefill_tokens
        parts = []
        if meta.num_prefills:
            parts.append(self.prefill.run(q[:split], cache))
        if meta.num_prefills < meta.num_seqs:
            parts.append(self.decode.run(q[split:], cache))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
