"""keep_freed_memory: blocks of megabytes come from the heap and stay there once
freed, for the next step, instead of a mapping each that is faulted in page by
page and unmapped on free (glibc's defaults)."""

from __future__ import annotations

import subprocess
import sys

# In a fresh process (the settings are the process's): where a 16 MiB block
# comes from (did the count of mapped blocks grow?), and whether the heap keeps
# it free once it is freed.
BLOCK = """
import ctypes, sys, torch
from services.allocator import keep_freed_memory
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
print(during.hblks - before.hblks, (after.fordblks - before.fordblks) >> 20)
"""


def block(how: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK, how], capture_output=True, text=True, check=True
    )
    mapped, kept_mib = map(int, out.stdout.split())
    return mapped, kept_mib


def test_a_freed_block_of_megabytes_stays_in_the_heap() -> None:
    assert block("default") == (1, 0)  # a mapping of its own, gone on free
    mapped, kept_mib = block("keep")
    assert mapped == 0 and kept_mib >= 16
