"""EPD's compiled CPU kernels (csrc/), for what no library here does.

Decode attention over the paged KV cache: torch has no paged attention on CPU,
and gathering each sequence's pages for SDPA copied the whole context every
layer of every step (~45% of a decode step on the small demo). vLLM's CPU
kernel lives in its own build; IPEX's needs its own torch and AVX-512.

The C source is compiled on first use with the machine's C compiler (`$CC`,
else `cc`; about a second) into EPD's cache folder, keyed by the source, the
flags and the CPU, and loaded with ctypes (a call releases the GIL). Where no
compiler is found, `paged_decode_attention()` is None and the engine keeps
torch's path. Built against torch's own libgomp where torch ships one, so the
kernel's OpenMP threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from services import env

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]

Kernel = Callable[..., int]
# what the paged attention kernel reads and writes (float16: torch's path)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_identity() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in lines if ln.startswith(wanted)})).encode()


def _link_args() -> list[str]:
    """torch's libgomp, when it ships one: one OpenMP runtime, one thread pool."""
    libgomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if libgomp.exists():
        return [str(libgomp), f"-Wl,-rpath,{libgomp.parent}", "-lm"]
    return ["-lm"]


def build(source: Path = SOURCE) -> Path:
    """The shared library of `source`, compiled now unless the cache has it.
    CalledProcessError or FileNotFoundError when it cannot be built."""
    compiler = os.environ.get("CC") or "cc"
    link = _link_args()
    key = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), " ".join([compiler, *FLAGS, *link]).encode(), _cpu_identity()]
        )
    ).hexdigest()[:16]
    folder = Path(env.CACHE_DIR.get()) / "kernels"
    library = folder / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    # built beside its final name, then renamed: processes building at once
    # each load a whole library
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / library.name
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built), *link],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, library)
    logger.info("built %s", library)
    return library


@functools.cache
def paged_decode_attention() -> Kernel | None:
    """csrc/paged_attention.c's kernel, or None (with a log line) where it
    cannot be built."""
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("no compiled CPU attention kernel (%s): torch's path instead", detail)
        return None
    kernel = library.paged_decode_attention
    kernel.restype = ctypes.c_int
    kernel.argtypes = (
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    )
    return kernel
