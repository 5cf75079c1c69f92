"""The paged KV cache and its block manager.

Per layer its keys and its values, each [num_pages, page_size, kv_heads,
head_dim] (FlashInfer's NHD layout, as a pair). Token i of a request lives in
page block_table[i // page_size], slot i % page_size; its flat slot is
page * page_size + slot.

The keys and values of every layer are the planes (k0, v0, k1, v1, ...) of a
pool whose blocks are the pages (services/transfer/embedding_pool.py): a
prefill instance hands a request's pages to a decode instance over the same
transports, and the same transfer machines, as an encoder's embeddings; a
decode instance's cache lives where those transports reach it (shared memory,
NIXL-registered, CUDA IPC).

The choices of an n > 1 request share their prompt's pages (reference
counted). A page is copied on write: before a request writes into a page it
shares, the page is copied to a fresh one (in practice the prompt's last,
partly filled page, at each choice's first decode step).

Prefix caching: a full page is known by a SHA-256 digest of its tokens and
of the previous page's digest (so of every token before it), an image's or
video's token by its item's content hash (the gateway's media key) and its
index in the item, so two pictures of one size never share a page and the
same picture does wherever the tokens before it are the same; the M-RoPE
positions and Qwen3-VL's deepstack features follow from those. A hit is
trusted without comparing tokens, so the digest is one no caller can collide
on purpose (token-id prompts set a page's contents exactly). The request's
cache salt enters the first page's digest: requests under other salts share
nothing. Pages of a request's output count too, once full. Once computed a page
is kept, and a request whose tokens begin with the same pages shares them and
starts its prefill after them (a system prompt, the tools a chat template
renders, a conversation's earlier turns, their images and answers included). An
item without a hash ends what a request may share. A cached page no request
holds stays until its memory is wanted: pages are taken from the free list
first, then from the least recently used of those.

Pages move between instances by their digests (services/language/prefix_moves.py):
`export` reads the cached pages a list of digests begins with, `adopt` takes
such pages into this cache as if computed here, idle until a request takes
them. The digests are content addresses, so the pages mean the same here.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.language.engine.request import Request
from services.layers.attention import KVLayer
from services.model.spec import TextSpec
from services.transfer.allocator import BlockAllocator
from services.transfer.embedding_pool import EmbeddingPool
from services.transfer.layout import PoolLayout
from services.wire.messages import Plane


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    num_pages: int
    page_size: int = 16
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_budget(
        cls, spec: TextSpec, budget_bytes: int, page_size: int, dtype: torch.dtype
    ) -> KVCacheConfig:
        page_bytes = kv_page_bytes(spec, page_size, dtype)
        num_pages = budget_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no page of {page_bytes} bytes"
            )
        return cls(num_pages, page_size, dtype)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


def kv_page_bytes(spec: TextSpec, page_size: int, dtype: torch.dtype) -> int:
    """Every layer's keys and values of one page."""
    element = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * page_size * spec.num_kv_heads * spec.head_dim * element


@dataclass(frozen=True, slots=True)
class PrefixPages:
    """Full KV pages of a prompt's prefix, as they move between instances: each
    page's digest, in order, and per plane (k0, v0, k1, ...) their tokens' rows,
    [len(digests) * page_size, width] in the cache's dtype."""

    digests: tuple[bytes, ...]
    page_size: int
    planes: tuple[torch.Tensor, ...] = ()

    @property
    def num_pages(self) -> int:
        return len(self.digests)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)


def kv_planes(spec: TextSpec) -> tuple[Plane, ...]:
    """Each layer's keys and values, one token row [kv_heads * head_dim] each."""
    width = spec.num_kv_heads * spec.head_dim
    return tuple(Plane(f"{half}{i}", width) for i in range(spec.num_layers) for half in "kv")


# Where the cache's pool lives: plain device memory unless the instance says otherwise.
KVMemory = Callable[[PoolLayout, torch.device], EmbeddingPool]


def device_memory(layout: PoolLayout, device: torch.device) -> EmbeddingPool:
    if device.type == "cuda":
        return EmbeddingPool.on_cuda(layout, device)
    return EmbeddingPool.in_host_memory(layout)


class KVCache:
    def __init__(
        self,
        spec: TextSpec,
        config: KVCacheConfig,
        device: torch.device,
        spare_pages: int = 0,
        memory: KVMemory = device_memory,
    ) -> None:
        """`spare_pages` past config.num_pages, which the block manager never hands
        out (the sink page CUDA graphs' padding rows write to)."""
        self.config = config
        pages = config.num_pages + spare_pages
        layout = PoolLayout(pages, config.page_size, kv_planes(spec), config.dtype)
        self.pool = memory(layout, device)
        shape = (pages, config.page_size, spec.num_kv_heads, spec.head_dim)
        planes = [t.view(shape) for t in self.pool.tensors]
        self.layers: list[KVLayer] = list(zip(planes[0::2], planes[1::2], strict=True))

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copies page src to page dst in every layer, for each (src, dst)."""
        if not copies:
            return
        pairs = torch.tensor(copies, device=self.layers[0][0].device)
        src, dst = pairs[:, 0], pairs[:, 1]
        for keys, values in self.layers:
            keys[dst] = keys[src]
            values[dst] = values[src]

    def read_pages(self, pages: list[int]) -> tuple[torch.Tensor, ...]:
        """Copies of the pages' rows, per plane (on the CPU)."""
        return tuple(r.cpu() for r in self.pool.read(pages, 0, len(pages) * self.config.page_size))

    def write_pages(self, pages: list[int], planes: tuple[torch.Tensor, ...]) -> None:
        self.pool.write(pages, 0, planes)

    def close(self) -> None:
        self.layers = []
        self.pool.close()


class KVBlockManager:
    """Grows and frees requests' block tables on the shared allocator."""

    def __init__(self, config: KVCacheConfig, prefix_caching: bool = True) -> None:
        self.page_size = config.page_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(config.num_pages, config.page_size)
        self.refs: dict[int, int] = {}  # holders of each shared page (absent: one)
        self.copies: list[tuple[int, int]] = []  # (src, dst) to copy before the next forward
        # The prefix cache: page of each prefix digest, and back; cached pages no
        # request holds, least recently used first (allocated, not free).
        self.cached: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.num_hit_tokens = 0  # tokens served from the cache, ever
        self.num_hit_media_tokens = 0  # of those, images' and videos'

    @property
    def num_pages(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_used_pages(self) -> int:
        """Pages requests hold (cached pages no one holds are as good as free)."""
        return self.allocator.num_used_blocks - len(self.idle)

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached)

    def allocate_pages(self, num_pages: int) -> list[int] | None:
        """Pages from the free list, then from the idle cached ones (least
        recently used first, forgotten by the cache); None if too few."""
        short = num_pages - self.allocator.num_free_blocks
        if short > len(self.idle):
            return None
        for _ in range(max(0, short)):
            page, _ = self.idle.popitem(last=False)
            del self.cached[self.hash_of.pop(page)]
            self.allocator.free([page])
        return self.allocator.allocate_blocks(num_pages)

    def reuse_prefix(self, request: Request) -> None:
        """A request about to start its prefill takes the cached pages its prompt
        begins with, and starts after them (at least its last prompt token is
        computed: its logits give the first output token)."""
        if request.block_table or request.num_computed_tokens or not self.prefix_caching:
            return
        for prefix in _prefix_hashes(request, self.page_size):
            page = self.cached.get(prefix)
            if page is None:
                break
            if page in self.idle:
                del self.idle[page]
            else:
                self.refs[page] = self.refs.get(page, 1) + 1
            request.block_table.append(page)
        request.num_cached_pages = len(request.block_table)
        request.num_computed_tokens = len(request.block_table) * self.page_size

    def pin_prefix(self, request: Request) -> int:
        """A request takes its cached pages as it comes (reuse_prefix), not when it
        is admitted, and keeps them while it waits; the media tokens they cover."""
        self.reuse_prefix(request)
        if request.media_positions is None:
            return 0
        return int((request.media_positions < request.num_computed_tokens).sum())

    def count_hit(self, request: Request) -> None:
        """Counts the tokens an admitted request took from the cache."""
        hit = request.num_computed_tokens
        request.num_cached_tokens = hit
        self.num_hit_tokens += hit
        if hit and request.media_positions is not None:
            self.num_hit_media_tokens += int((request.media_positions < hit).sum())

    def cache_computed(self, request: Request) -> None:
        """Caches the request's full pages computed since the last call."""
        if not self.prefix_caching:
            return
        hashes = _prefix_hashes(request, self.page_size, request.num_computed_tokens)
        done = len(hashes)
        for index in range(request.num_cached_pages, done):
            page = request.block_table[index]
            if hashes[index] not in self.cached and page not in self.hash_of:
                self.cached[hashes[index]] = page
                self.hash_of[page] = hashes[index]
        request.num_cached_pages = max(request.num_cached_pages, done)

    def leading_cached(self, digests: Sequence[bytes]) -> list[int]:
        """The cached pages of the digests' leading run."""
        pages = []
        for digest in digests:
            page = self.cached.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def adopt(self, digests: Sequence[bytes], keep: Sequence[bytes] = ()) -> list[tuple[int, int]]:
        """Pages for the digests this cache lacks: each (index in `digests`,
        page) to write, then to cache (`cache_adopted`). Nothing if pages are
        short: the request then computes them. The cached pages of `keep` (the
        request's, before those) are not among the pages taken for them."""
        if not self.prefix_caching:
            return []
        for digest in (*keep, *digests):  # those it has stay: the request needs them first
            if (page := self.cached.get(digest)) is not None and page in self.idle:
                self.idle.move_to_end(page)
        missing = [i for i, d in enumerate(digests) if d not in self.cached]
        pages = self.allocate_pages(len(missing)) if missing else []
        if pages is None:
            return []
        return list(zip(missing, pages, strict=True))

    def cache_adopted(self, digests: Sequence[bytes], adopted: list[tuple[int, int]]) -> None:
        """The adopted pages, written, into the cache as if computed here: idle (the
        most recently used) until a request takes them. Only once written: an
        export beside a step may read a page as soon as it has its digest."""
        for i, page in adopted:
            self.cached[digests[i]] = page
            self.hash_of[page] = digests[i]
            self.idle[page] = None

    @property
    def num_shared_pages(self) -> int:
        return len(self.refs)

    def _shared(self, request: Request) -> list[int]:
        """Indices in the block table of shared pages the request writes next."""
        if not self.refs:  # no n > 1 request holds shared pages: the common case
            return []
        first = request.num_computed_tokens // self.page_size
        table = request.block_table
        return [i for i in range(first, len(table)) if table[i] in self.refs]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Extends the block table to hold num_new_tokens more, copying the shared
        pages they land in; False if pages ran out."""
        total = request.num_computed_tokens + num_new_tokens
        grow = max(0, -(-total // self.page_size) - len(request.block_table))
        shared = self._shared(request)
        if grow + len(shared) == 0:
            return True
        pages = self.allocate_pages(grow + len(shared))
        if pages is None:
            return False
        for i in shared:
            page = pages.pop()
            self.copies.append((request.block_table[i], page))
            self._release([request.block_table[i]])
            request.block_table[i] = page
        request.block_table.extend(pages)
        return True

    def share(self, source: Request, request: Request) -> None:
        """Gives request the source's pages (its prompt, for a choice of the same request)."""
        assert not request.block_table
        for page in source.block_table:
            self.refs[page] = self.refs.get(page, 1) + 1
        request.block_table = list(source.block_table)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def _release(self, pages: list[int]) -> None:
        """Drops one holder of each page; frees those no one holds any more
        (a cached one goes idle, most recently used)."""
        free = []
        for page in pages:
            holders = self.refs.pop(page, 1) - 1
            if holders > 1:
                self.refs[page] = holders
            elif holders == 0 and page in self.hash_of:
                self.idle[page] = None
            elif holders == 0:
                free.append(page)
        self.allocator.free(free)

    def free(self, request: Request) -> None:
        self.truncate(request, 0)

    def truncate(self, request: Request, num_pages: int) -> None:
        """Keeps the request's first `num_pages` pages; the rest go back."""
        self._release(request.block_table[num_pages:])
        request.block_table = request.block_table[:num_pages]  # a step's metadata may hold the old
        request.num_cached_pages = min(request.num_cached_pages, num_pages)


def prefix_digests(request: Request, page_size: int) -> list[bytes]:
    """The digests of the full pages of the request's prompt the cache may share
    (all but its last token: its logits give the first output)."""
    return _prefix_hashes(request, page_size, request.num_prompt_tokens - 1)


def _cache_tokens(request: Request) -> list[object]:
    """The prompt's tokens as the cache knows them: a text token by its id, an
    image's or video's by (its item's content hash, its index in the item). The
    list stops before the first item without a hash; a decode instance's request
    with images (their tokens unknown here) shares nothing."""
    if request.cache_tokens is not None:
        return request.cache_tokens
    tokens: list[object] = list(request.prompt_token_ids)
    if not request.recomputable:
        tokens = []
    elif request.media_positions is not None and request.media_positions.numel():
        positions = request.media_positions.tolist()
        first = 0  # the first token of the next item
        for key, size in zip(request.media_keys, request.media_sizes, strict=False):
            if not key:
                break
            for offset in range(size):
                tokens[positions[first + offset]] = (key, offset)
            first += size
        if first < len(positions):
            del tokens[positions[first] :]
    request.cache_tokens = tokens
    return tokens


def _prefix_hashes(request: Request, page_size: int, num_tokens: int | None = None) -> list[bytes]:
    """The digest of each full page among the request's first `num_tokens` tokens
    (prompt, then output; by default all but the last: its logits give the next
    token) that the cache may share; each covers its page's tokens and, through
    the previous digest, all before them (the first, the request's cache salt).
    Kept on the request, extended as it grows."""
    tokens = _cache_tokens(request)
    end = request.num_tokens - 1 if num_tokens is None else num_tokens
    if len(tokens) < request.num_prompt_tokens:  # it stops inside the prompt
        end = min(end, len(tokens))
    hashes = request.prefix_hashes
    previous = hashes[-1] if hashes else _salt_digest(request.cache_salt)
    prompt = request.num_prompt_tokens
    for start in range(len(hashes) * page_size, end - page_size + 1, page_size):
        page = (
            tokens[start : start + page_size]
            if start + page_size <= prompt
            else [*tokens[start:prompt], *request.token_ids(max(start, prompt), start + page_size)]
        )
        previous = hashlib.sha256(previous + repr(page).encode()).digest()
        hashes.append(previous)
    return hashes[: end // page_size]


def _salt_digest(salt: str) -> bytes:
    """What the first page's digest chains from: nothing, or the salt's digest."""
    return hashlib.sha256(b"cache_salt:" + salt.encode()).digest() if salt else b""
