"""keep_freed_memory: blocks of megabytes come from the heap and stay there once
freed, for the next step, instead of a mapping each that is faulted in page by
page and unmapped on free (glibc's defaults); threads allocate from that heap.
advise_huge_pages: torch's large blocks are advised into huge pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.runtime.malloc import HUGE_PAGES

# In a fresh process (the settings are the process's): where a 16 MiB block
# comes from (did the count of mapped blocks grow?), and whether the heap keeps
# it free once it is freed.
BLOCK = """
import ctypes, sys, torch
from services.runtime.malloc import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2()
block = torch.ones(16 << 20, dtype=torch.uint8)
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
print(during.hblks - before.hblks, (after.fordblks - before.fordblks) >> 10)
"""


def fresh(script: str, how: str) -> list[int]:
    """The numbers `script` prints, run in a fresh process ("default" or "keep")."""
    out = subprocess.run(
        [sys.executable, "-c", script, how], capture_output=True, text=True, check=True
    )
    return [int(n) for n in out.stdout.split()]


def block(how: str) -> tuple[int, int]:
    mapped, kept_kib = fresh(BLOCK, how)
    return mapped, kept_kib


def test_a_freed_block_of_megabytes_stays_in_the_heap() -> None:
    mapped, kept_kib = block("default")
    assert mapped == 1 and kept_kib < 1024  # a mapping of its own, gone on free
    mapped, kept_kib = block("keep")
    assert mapped == 0 and kept_kib >= 15 << 10  # the 16 MiB (less what was reused), free


# The arenas (glibc's malloc_info lists a <heap> for each) once a thread has
# allocated and holds a tensor.
ARENAS = """
import ctypes, sys, threading, torch
from services.runtime.malloc import keep_freed_memory
libc = ctypes.CDLL(None)
libc.open_memstream.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
held = []
worker = threading.Thread(target=lambda: held.append(torch.ones(1 << 20, dtype=torch.uint8)))
worker.start()
worker.join()
text, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(text), ctypes.byref(size))
libc.malloc_info(0, stream)
libc.fclose(stream)
print(ctypes.string_at(text, size.value).decode().count("<heap nr="))
"""


def test_a_thread_allocates_from_the_same_heap() -> None:
    """An engine on a thread gets its blocks where the thresholds above hold,
    not from an arena of its own."""
    assert fresh(ARENAS, "default")[0] > 1
    assert fresh(ARENAS, "keep")[0] == 1


# Whether a tensor's mapping is advised into huge pages, in a fresh process that
# sets torch's switch first ("huge") or not ("default"): 64 MiB, then 1 MiB.
HUGE = """
import sys
from services.runtime.malloc import advise_huge_pages, huge_pages_advised
if sys.argv[1] == "huge":
    advise_huge_pages()
import torch
for size in (64 << 20, 1 << 20):
    block = torch.ones(size, dtype=torch.uint8)  # held: a freed mapping is gone
    print(int(huge_pages_advised(block.data_ptr())))
"""


def test_tensors_of_megabytes_are_advised_into_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's allocations of 2 MiB and more are, once advise_huge_pages() set its
    switch before the first one; smaller ones never are; without it none is."""
    monkeypatch.delenv(HUGE_PAGES, raising=False)
    assert fresh(HUGE, "default") == [0, 0]
    assert fresh(HUGE, "huge") == [1, 0]
