"""The C allocator's settings for a process that runs torch on the CPU."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# glibc's mallopt parameters, and the largest mmap threshold it takes on 64-bit
# (HEAP_MAX_SIZE / 2)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD_MAX = 32 << 20
TRIM_THRESHOLD = 1 << 30
# torch's switch (c10's alloc_cpu): every allocation of 2 MiB or more is
# advised into transparent huge pages (madvise MADV_HUGEPAGE) before it is touched
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def keep_freed_memory() -> bool:
    """Lets this process's freed memory stay for its next allocation: glibc
    gives every block above its mmap threshold (128 KiB at first) a mapping of
    its own, unmapped on free, and trims the heap's top past its trim threshold,
    so a prefill step's activations (megabytes each) were mapped, faulted in
    page by page and given back by every operator: 240k page faults in a burst
    of 16 medium-demo prompts, a 2048-token step 1.9 s against 0.9 s
    (git history of docs/performance.md). Blocks up to 32 MiB now come from the heap, which
    keeps up to 1 GiB free, as a caching allocator (or the tcmalloc vLLM's CPU
    backend preloads) keeps it; larger blocks are still mapped each time. Every
    thread allocates from that one heap (one arena): a thread's own arena lives
    in heaps of 64 MiB that are unmapped once free whatever the thresholds (an
    engine on a thread of the language process: 70-99k faults in that burst,
    16k with one arena). The language engine's process calls it first; so do a
    language process that runs a CPU engine on a thread, bench's engine alone and
    the vision tower's Triton model (on F.linear's GEMM, ~5.6k faults a 448x448
    image on the small demo's tower, 338 -> 329 ms; on oneDNN's, no change).
    False where the C library is not glibc."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        return False
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        and libc.mallopt(M_ARENA_MAX, 1)
    )


def advise_huge_pages() -> None:
    """torch's allocations of 2 MiB and more in transparent huge pages (2 MiB
    pages where the kernel has them; its setting is `madvise` here, as on many
    distributions, so none is unless asked): a decode step reads every weight
    and each sequence's KV once, hundreds of megabytes, and with 4 KiB pages the
    TLB misses once a page. On the AVX2 class, the medium demo in float32, a
    decode step of 8 sequences at 1024 tokens took 90 ms against 104-111, of one
    at 16 tokens 37-40 against 40-48 (docs/performance.md, "Decode against the
    memory limit"); a 300-token prefill of the small demo was no slower. A
    language instance's processes only (`epd language` sets it, its engine
    process inherits it): the vision tower gained nothing, and with it in every
    process of `epd serve` one image's TTFT alone was 644-710 ms against 577-582.
    torch reads the switch once, at its first allocation, so it is set before
    any; an operator's own value (0: off) stands."""
    os.environ.setdefault(HUGE_PAGES, "1")


def huge_pages_advised(address: int) -> bool:
    """Whether the mapping holding `address` is advised into huge pages (its
    VmFlags in /proc/self/smaps hold `hg`)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False
