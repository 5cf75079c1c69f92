"""EPD's compiled CPU kernels (csrc/), for what no library here does.

- Decode attention over the paged KV cache (paged_attention.c): torch has no
  paged attention on CPU, and gathering each sequence's pages for SDPA copied
  the whole context every layer of every step (~45% of a decode step on the
  small demo). vLLM's CPU kernel lives in its own build; IPEX's needs its own
  torch and AVX-512. In bfloat16 on AMX, the same source also has a prompt's
  (prefill) attention: torch's SDPA takes its AMX path for long sequences only.
- The model's small operations, fused (fused_ops.c): RMSNorm (with the residual
  add before it), rotary embedding in place, and the MLP's SiLU and product.
- The projections of few rows (linear.c), a decode step's: oneDNN's and MKL's
  GEMMs read the weights at well under the machine's memory bandwidth there;
  in bfloat16 on AMX or AVX512-BF16 (linear_bf16.c), from tiles packed once.
- A decode step's decoder layers in one call of the kernels above (decode.c,
  cpu_decode.py's).

Each C source is compiled on first use with the machine's C compiler (`$CC`,
else `cc`; about a second) for this CPU (`-march=native`; `EPD_KERNEL_MARCH`
names another, e.g. x86-64-v3 to run the AVX2 build on an AVX-512 machine) into
EPD's cache folder, keyed by the source (and csrc/'s headers), the flags and the
CPU, and loaded with ctypes (a call releases the GIL). Which instructions a kernel
uses is decided when it is compiled (the compiler's __AVX512BF16__ and such), so a
library says what its build has (`has_avx512bf16()`, `amx_init()`). Where no
compiler is found, `paged_decode_attention()` and `fused_ops()` are None and
the engine keeps torch's path. Built against torch's own libgomp where torch
ships one, so the kernels' OpenMP threads are torch's.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from services.runtime import env

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_attention.c"
# -fno-trapping-math: no kernel reads the floating-point exception flags, and
# without it GCC keeps a loop that converts floats to integers (the softmax's
# e^x) from being vectorized
FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
]
# products rounded before they are added, as torch's separate operators round them
FUSED_OPS_FLAGS = ("-ffp-contract=off",)

Kernel = Callable[..., int]
_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
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


def command(source: Path, extra_flags: Sequence[str], output: Path) -> list[str]:
    """The compiler's command line that builds `source` into the shared library `output`."""
    march = f"-march={env.KERNEL_MARCH.get()}"
    compiler = os.environ.get("CC") or "cc"
    # csrc/'s headers, for a source anywhere
    flags = [march, *FLAGS, f"-I{CSRC}", *extra_flags]
    return [compiler, *flags, str(source), "-o", str(output), *_link_args()]


def build(source: Path = SOURCE, extra_flags: Sequence[str] = ()) -> Path:
    """The shared library of `source`, compiled now unless the cache has it.
    CalledProcessError or FileNotFoundError when it cannot be built."""
    line = command(source, extra_flags, Path("out.so"))
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, " ".join(line).encode(), _cpu_identity()])
    ).hexdigest()[:16]
    folder = Path(env.CACHE_DIR.get()) / "kernels"
    library = folder / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    if shutil.which(line[0]) is None:
        raise FileNotFoundError(f"no C compiler {line[0]!r} on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    # built beside its final name, then renamed: processes building at once
    # each load a whole library
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / library.name
        subprocess.run(
            command(source, extra_flags, built), check=True, capture_output=True, text=True
        )
        os.replace(built, library)
    logger.info("built %s", library)
    return library


def _load(source: Path, extra_flags: Sequence[str], what: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(build(source, extra_flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("no compiled CPU %s (%s): torch's path instead", what, detail)
        return None


@functools.cache
def _attention_library() -> ctypes.CDLL | None:
    return _load(SOURCE, (), "attention kernel")


@functools.cache
def paged_decode_attention() -> Kernel | None:
    """csrc/paged_attention.c's decode kernel, or None (with a log line) where it
    cannot be built."""
    library = _attention_library()
    if library is None:
        return None
    kernel = library.paged_decode_attention
    kernel.restype = _int
    kernel.argtypes = [_ptr] * 6 + [_i64] * 6 + [_f32] + [_int] * 2
    return kernel


@functools.cache
def kv_writer() -> Kernel | None:
    """csrc/paged_attention.c's write_kv (a step's keys and values into the cache's
    rows, any dtype), or None where the library cannot be built."""
    library = _attention_library()
    if library is None:
        return None
    kernel = library.write_kv
    kernel.restype = _int
    kernel.argtypes = [_ptr] * 5 + [_i64] * 6
    return kernel


# EPD's bfloat16 kernels (projections, attention), fastest first: "auto" takes the
# first this CPU has
BF16_KINDS = ("amx", "avx512bf16")


def _has(library: ctypes.CDLL, kind: str) -> bool:
    """Whether `library`'s build has the instructions of `kind` (BF16_KINDS) and,
    for AMX, the kernel gives this process AMX state."""
    return bool(library.amx_init() if kind == "amx" else library.has_avx512bf16())


def _bf16_attention(name: str, kind: str, argtypes: list[Any]) -> Kernel | None:
    """csrc/paged_attention.c's `name`_`kind` (a bfloat16 kernel of BF16_KINDS), or
    None where it cannot be built or this CPU lacks `kind` (`_has`)."""
    library = _attention_library()
    if library is None or not _has(library, kind):
        return None
    kernel = getattr(library, f"{name}_{kind}")
    kernel.restype = _int
    kernel.argtypes = argtypes
    return kernel


@functools.cache
def prefill_attention(kind: str) -> Kernel | None:
    """A prompt's attention over the paged KV cache, causal (head_dim a multiple of 64)."""
    return _bf16_attention("prefill_attention", kind, [_ptr] * 5 + [_i64] * 7 + [_f32, _int])


def bf16_prefill_attention() -> Kernel | None:
    """The prefill kernel a bfloat16 engine uses: the first of BF16_KINDS this
    CPU has (measured against gather + SDPA on AVX512-BF16 without AMX: 5x a call
    for the demos' heads, a text prefill step 18-30 % shorter), else None (SDPA)."""
    return next(filter(None, map(prefill_attention, BF16_KINDS)), None)


@functools.cache
def window_attention(kind: str) -> Kernel | None:
    """A vision tower's attention, each window's tokens attending to one another
    (head_dim a multiple of 64 on AMX, of 16 otherwise)."""
    return _bf16_attention("window_attention", kind, [_ptr] * 5 + [_i64] * 4 + [_f32, _int])


def bf16_window_attention(head_dim: int) -> Kernel | None:
    """The window kernel a bfloat16 vision tower of head_dim uses: the first of
    BF16_KINDS this CPU has that takes it, else None (SDPA)."""
    for kind in BF16_KINDS:
        if head_dim % (64 if kind == "amx" else 16) == 0 and (kernel := window_attention(kind)):
            return kernel
    return None


class FusedOps:
    """csrc/fused_ops.c's operations on float32 or bfloat16 tensors, each one call. They
    take rows whose elements are contiguous; `rms_norm` and `rotary` also take
    rows (tokens) strided apart, as a split of the fused QKV projection leaves
    them."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.rms_norm
        self._rms_norm.argtypes = [_ptr] * 3 + [_i64] * 3 + [_f32, _int, _int]
        self._add_rms_norm = library.add_rms_norm
        self._add_rms_norm.argtypes = [_ptr] * 5 + [_i64] * 2 + [_f32, _int, _int]
        self._rotary = library.rotary
        self._rotary.argtypes = [_ptr] * 3 + [_i64] * 4 + [_int, _int, _int]
        self._silu_mul = library.silu_mul
        self._silu_mul.argtypes = [_ptr] * 3 + [_i64] * 3 + [_int]
        self._silu_mul_f32 = library.silu_mul_f32
        self._silu_mul_f32.argtypes = [_ptr] * 2 + [_i64] * 3 + [_int]
        functions = (self._rms_norm, self._add_rms_norm, self._rotary, self._silu_mul)
        for function in (*functions, self._silu_mul_f32):
            function.restype = None
        self.silu = silu_table()

    def addresses(self) -> tuple[int, int, int, int, int]:
        """Where rms_norm, add_rms_norm, rotary, silu_mul and silu_mul_f32 lie, for C
        that calls them."""
        return (
            address(self._rms_norm),
            address(self._add_rms_norm),
            address(self._rotary),
            address(self._silu_mul),
            address(self._silu_mul_f32),
        )

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether these kernels take x: float32 or bfloat16 on the CPU, its last
        dimension contiguous."""
        return x.dtype in KERNEL_DTYPES and x.device.type == "cpu" and x.stride(-1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [rows, n] (rows may be strided apart) -> a new [rows, n]."""
        assert x.dim() == 2 and self.supports(x) and weight.dtype == x.dtype
        assert weight.is_contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        rows, n = x.shape
        self._rms_norm(
            out.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            rows,
            n,
            x.stride(0),
            eps,
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta)) for contiguous x, delta [rows, n]."""
        assert self.supports(x) and x.is_contiguous() and delta.is_contiguous()
        assert x.dtype == delta.dtype == weight.dtype and x.shape == delta.shape
        total, out = torch.empty_like(x), torch.empty_like(x)
        rows, n = x.shape
        self._add_rms_norm(
            total.data_ptr(),
            out.data_ptr(),
            x.data_ptr(),
            delta.data_ptr(),
            weight.data_ptr(),
            rows,
            n,
            eps,
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return total, out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [tokens, heads, dim] in place (a token's heads contiguous) by
        cos/sin [tokens, dim], in their precision: x's dtype (the language model's
        rotary embedding) or float32 (the vision towers', which HF computes in
        float32 and rounds once to x's dtype); returns x."""
        tokens, heads, dim = x.shape
        assert self.supports(x) and x.stride(1) == dim and cos.dtype == sin.dtype
        assert cos.dtype in (x.dtype, torch.float32)
        assert (
            cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (tokens, dim)
        )
        self._rotary(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            dim,
            x.stride(0),
            int(x.dtype == torch.bfloat16),
            int(cos.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return x

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """F.silu(gate) * up for x [rows, 2n] = [gate | up] (rows may be strided
        apart) -> a new [rows, n]: in bfloat16 bit-equal to torch's two operators
        (the SiLU looked up), in float32 within a few ulp of them (its own e^x)."""
        rows, width = x.shape
        assert self.supports(x) and width % 2 == 0
        out = torch.empty(rows, width // 2, dtype=x.dtype)
        if x.dtype == torch.bfloat16:
            self._silu_mul(
                out.data_ptr(),
                x.data_ptr(),
                self.silu.data_ptr(),
                rows,
                width // 2,
                x.stride(0),
                torch.get_num_threads(),
            )
        else:
            self._silu_mul_f32(
                out.data_ptr(), x.data_ptr(), rows, width // 2, x.stride(0), torch.get_num_threads()
            )
        return out


def address(function: Kernel) -> int:
    """Where a loaded C function (a ctypes function) lies, for C that calls it."""
    where = ctypes.cast(cast(Any, function), ctypes.c_void_p).value
    assert where is not None
    return where


def silu_table() -> torch.Tensor:
    """float32 [65536]: torch's SiLU of each bfloat16 value, indexed by its bits."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    values = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return torch.nn.functional.silu(values.view(torch.bfloat16)).float()


@functools.cache
def fused_ops() -> FusedOps | None:
    """csrc/fused_ops.c's operations, or None (with a log line) where they
    cannot be built."""
    library = _load(CSRC / "fused_ops.c", FUSED_OPS_FLAGS, "fused operations")
    return None if library is None else FusedOps(library)


class _Projection:
    """A projection kernel of csrc/ (linear.c's, linear_bf16.c's): y = x w^T (+ bias)
    for x [rows, K] whose rows are contiguous (and may be strided apart), on the
    weight as the kernel reads it; all take the same arguments, so decode.c calls
    any of them."""

    def __init__(self, function: Any) -> None:  # a ctypes function of the library
        self._linear = function
        self._linear.argtypes = [_ptr] * 4 + [_i64] * 4 + [_int]
        self._linear.restype = None

    def address(self) -> int:
        """Where the kernel lies, for C that calls it."""
        return address(self._linear)

    def _run(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        depth: int,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """y [rows, out_features] of x's first `depth` columns (its row stride kept)."""
        assert x.stride(1) == 1 and weight.dtype == x.dtype
        assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype)
        y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        self._linear(
            y.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            x.shape[0],
            depth,
            out_features,
            x.stride(0),
            torch.get_num_threads(),
        )
        return y


class LinearKernel(_Projection):
    """csrc/linear.c's linear_rows (AVX2): float32, on w [N, K] as loaded."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library.linear_rows)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert x.dtype == torch.float32 and weight.is_contiguous()
        assert weight.shape[1] == x.shape[1]
        return self._run(x, weight, x.shape[1], weight.shape[0], bias)


@functools.cache
def _linear_library() -> ctypes.CDLL | None:
    return _load(CSRC / "linear.c", (), "linear kernel")


@functools.cache
def linear_kernel() -> LinearKernel | None:
    """csrc/linear.c's kernel, or None (with a log line) where it cannot be built
    or this CPU lacks AVX2 and FMA (its plain loop is only there to link)."""
    library = _linear_library()
    if library is None:
        return None
    if not library.linear_vectorized():
        logger.warning("no AVX2/FMA for the compiled CPU linear kernel: torch's path instead")
        return None
    return LinearKernel(library)


class F32Linear(_Projection):
    """csrc/linear.c's linear_avx512: float32, any number of rows, on a weight packed
    by `pack`."""

    GROUP_N = 64  # the outputs a task sums

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library.linear_avx512)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """w [N, K] as groups of 64 outputs, each [K, 64] (zeros past N)."""
        n, k = weight.shape
        groups = -(-n // cls.GROUP_N)
        padded = torch.zeros(groups * cls.GROUP_N, k, dtype=weight.dtype)
        padded[:n] = weight
        return padded.view(groups, cls.GROUP_N, k).transpose(1, 2).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert x.dtype == torch.float32 and packed.shape[1] == x.shape[1]
        return self._run(x, packed, x.shape[1], out_features, bias)


@functools.cache
def f32_linear() -> F32Linear | None:
    """csrc/linear.c's AVX-512 kernel, or None where it cannot be built or this CPU
    (or its build) lacks AVX-512."""
    library = _linear_library()
    if library is None or not library.has_avx512():
        return None
    return F32Linear(library)


class Bf16Linear(_Projection):
    """csrc/linear_bf16.c: y = x w^T (+ bias) in bfloat16 for x [rows, K] whose
    rows are contiguous (and may be strided apart), on a weight packed by `pack`;
    `kind` "amx" (AMX tiles) or "avx512bf16" (AVX512-BF16 dot products), and the
    most rows a call should take there (`max_rows`; None: any)."""

    TILE_K, GROUP_N = 32, 64  # the kernel's tile depth and output group

    # The most rows a call should run here, oneDNN's packed GEMM above, by kind.
    # Measured on 2 cores: AMX 0.8x oneDNN's time at 64 and 128 rows of the small
    # demo's projections, 1.1x at 256; AVX512-BF16 (Zen 5) 0.94-0.97x from 128 to
    # 2048 rows (the medium demo's at 2048: 1057 against 1085 ms), so it takes all
    # and a weight is held once, not also in oneDNN's layout.
    MAX_ROWS: ClassVar[dict[str, int | None]] = {"amx": 128, "avx512bf16": None}

    def __init__(self, library: ctypes.CDLL, kind: str) -> None:
        super().__init__(getattr(library, f"linear_{kind}"))
        self.kind = kind
        self.max_rows = self.MAX_ROWS[kind]

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """w [N, K] (bfloat16) as the kernel's tiles, zero-padded to whole 64-output
        groups and 32-input tiles: [groups, 4, K / 32, 16 input pairs, 16 outputs, 2]."""
        n, k = weight.shape
        padded = torch.zeros(
            -(-n // cls.GROUP_N) * cls.GROUP_N, -(-k // cls.TILE_K) * cls.TILE_K, dtype=weight.dtype
        )
        padded[:n, :k] = weight
        groups, depth = padded.shape[0] // cls.GROUP_N, padded.shape[1] // cls.TILE_K
        tiles = padded.view(groups, 4, 16, depth, 16, 2)  # [.., output, k block, pair, 2]
        return tiles.permute(0, 1, 3, 4, 2, 5).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert x.dtype == torch.bfloat16
        depth = packed.shape[2] * self.TILE_K
        if x.shape[1] != depth:  # the tiles are zero past k: so must x be
            x = torch.nn.functional.pad(x, (0, depth - x.shape[1]))
        return self._run(x, packed, depth, out_features, bias)


@functools.cache
def _bf16_linear_library() -> ctypes.CDLL | None:
    return _load(CSRC / "linear_bf16.c", (), "bfloat16 linear kernel")


@functools.cache
def bf16_linear(kind: str) -> Bf16Linear | None:
    """csrc/linear_bf16.c's kernel of `kind` (BF16_KINDS), or None where
    this CPU (or its build) lacks it, or the kernel denies the process AMX state
    (a log line says which)."""
    library = _bf16_linear_library()
    if library is None:
        return None
    if not _has(library, kind):
        logger.info("no %s kernel here (its instructions, or leave to use AMX)", kind)
        return None
    return Bf16Linear(library, kind)


@functools.cache
def decode_step() -> ctypes.CDLL | None:
    """csrc/decode.c (cpu_decode.py's), or None (with a log line) where it cannot be
    built."""
    library = _load(CSRC / "decode.c", (), "decode step")
    if library is not None:
        library.decode_layers.argtypes = [_ptr] * 5 + [_int]
        library.decode_layers.restype = _int
    return library
