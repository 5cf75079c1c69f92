"""The compiled paged decode attention (csrc/paged_attention.c) against torch's
path (each sequence's pages gathered, then SDPA): shuffled page tables, lengths
on and off page boundaries and across the kernel's chunks of keys, grouped-query
ratios 1 to 7, head_dim 64 and 128, page sizes 16 and 5, float32 and bfloat16,
on one thread and on two (one sequence alone in parts);
its prefill kernels (bfloat16: AMX, AVX512-BF16) the same way, with and without
a cached prefix. Then how it is built and cached, and when the engine uses it
(and, without a compiler, the fused operations of test_fused_ops.py and the
linear kernel of test_linear.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.layers import backends, cpu_kernels
from services.layers.attention import TorchAttention, write_kv
from services.layers.backends import attention_backend, linear_backend, ops_backend
from tests.layers.paged_cases import NUM_PAGES, STEPS, paged_metadata

CASES = {
    **STEPS,
    # one key; whole pages; a page and a token; long contexts
    "decode-edges": ([1, 1, 1, 1], [1, 32, 17, 300]),
    # past the kernel's chunk of keys: a running maximum and sum across chunks
    "decode-chunks": ([1, 1], [1100, 1024]),
    # one long request alone: with more threads than sequences, its keys in parts
    "decode-alone": ([1], [2900]),
}


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.Kernel:
    built = cpu_kernels.paged_decode_attention()
    assert built is not None, "no C compiler: the CPU default would be torch's path"
    return built


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The kernel's threads: with two, one sequence alone is split in parts."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("step", list(CASES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page", "dtype"),
    [
        (4, 4, 64, 16, torch.float32),
        (8, 4, 64, 16, torch.float32),
        (8, 2, 128, 16, torch.float32),
        (28, 4, 128, 16, torch.float32),
        (6, 2, 64, 5, torch.float32),
        (8, 2, 64, 16, torch.bfloat16),
        (28, 4, 128, 16, torch.bfloat16),
        (6, 2, 64, 5, torch.bfloat16),  # blocks of 16 tokens across pages of 5
        (4, 2, 80, 16, torch.bfloat16),  # not a multiple of 32: the float32 loop, on any CPU
    ],
)
def test_paged_kernel_equals_gathered_sdpa(
    kernel: cpu_kernels.Kernel,
    threads: int,
    step: str,
    heads: int,
    kv_heads: int,
    dim: int,
    page: int,
    dtype: torch.dtype,
) -> None:
    q_lens, seq_lens = CASES[step]
    pages = max(NUM_PAGES, sum(-(-n // page) for n in seq_lens))
    meta = paged_metadata(q_lens, seq_lens, page, torch.device("cpu"), heads + page, pages)
    generator = torch.Generator().manual_seed(heads * dim)
    tokens = sum(q_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = randn(tokens, heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    prefix = randn(2, pages, page, kv_heads, dim)  # keys, values
    outputs, caches = [], []
    for backend in (TorchAttention(dim**-0.5), TorchAttention(dim**-0.5, kernel)):
        cache = prefix.clone()
        backend.plan(meta)
        outputs.append(backend.forward(q, k, v, (cache[0], cache[1])))
        caches.append(cache)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)
    # bfloat16: both compute in float32 and round once; one bfloat16 step apart at most
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module", params=cpu_kernels.BF16_KINDS)
def prefill_kernel(request: pytest.FixtureRequest) -> cpu_kernels.Kernel:
    built = cpu_kernels.prefill_attention(request.param)
    if built is None:
        pytest.skip(f"this CPU has no {request.param} prefill kernel (its instructions)")
    return built


PREFILLS = {
    **STEPS,
    # a prompt after a cached prefix of 16, 100 and 7 tokens; 16-row blocks and a tail
    "after-prefix": ([210, 33, 5], [226, 133, 12]),
    "long": ([300], [300]),
}


@pytest.mark.parametrize("step", list(PREFILLS))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page"),
    [(8, 4, 64, 16), (16, 8, 64, 16), (28, 4, 128, 16), (6, 2, 64, 5), (4, 4, 64, 16)],
)
def test_prefill_kernel_equals_gathered_sdpa(
    kernel: cpu_kernels.Kernel,
    prefill_kernel: cpu_kernels.Kernel,
    step: str,
    heads: int,
    kv_heads: int,
    dim: int,
    page: int,
) -> None:
    q_lens, seq_lens = PREFILLS[step]
    pages = max(NUM_PAGES, sum(-(-n // page) for n in seq_lens))
    meta = paged_metadata(q_lens, seq_lens, page, torch.device("cpu"), heads + page, pages)
    generator = torch.Generator().manual_seed(heads * dim + page)
    tokens = sum(q_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).bfloat16()

    # q as the fused projection's split leaves it: token rows wider than its heads
    q = randn(tokens, heads + 2 * kv_heads, dim)[:, :heads]
    k, v = randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
    prefix = randn(2, pages, page, kv_heads, dim)  # keys, values
    outputs = []
    for backend in (
        TorchAttention(dim**-0.5, kernel),
        TorchAttention(dim**-0.5, kernel, prefill_kernel),
    ):
        cache = prefix.clone()
        backend.plan(meta)
        outputs.append(backend.forward(q, k, v, (cache[0], cache[1])))
    assert TorchAttention(dim**-0.5, kernel, prefill_kernel)._prefills_in_kernel(
        q, (prefix[0], prefix[1])
    )
    # both sum in float32 and round the weights and the output to bfloat16
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-2, rtol=1e-2)


def test_bfloat16_prefills_in_the_first_kernel_this_cpu_has(
    prefill_kernel: cpu_kernels.Kernel,
) -> None:
    """AMX where the CPU has it, else AVX512-BF16 (every AMX CPU has AVX512-BF16 too)."""
    amx = cpu_kernels.prefill_attention("amx")
    chosen = cpu_kernels.bf16_prefill_attention()
    assert chosen is (amx or cpu_kernels.prefill_attention("avx512bf16"))
    assert chosen is not None


def test_the_prefill_kernel_leaves_other_head_sizes_to_sdpa(
    prefill_kernel: cpu_kernels.Kernel,
) -> None:
    attention = TorchAttention(80**-0.5, None, prefill_kernel)
    cache = torch.zeros(2, 4, 16, 2, 80).bfloat16()
    assert not attention._prefills_in_kernel(torch.zeros(3, 4, 80).bfloat16(), (cache[0], cache[1]))
    cache64 = torch.zeros(2, 4, 16, 2, 64)
    assert not attention._prefills_in_kernel(torch.zeros(3, 4, 64), (cache64[0], cache64[1]))


def test_a_kernel_prefill_reads_only_its_own_pages(
    kernel: cpu_kernels.Kernel, prefill_kernel: cpu_kernels.Kernel
) -> None:
    """NaN in every page but the prompt's, and past its last token: none reaches its output."""
    page, kv_heads, dim = 16, 2, 64
    meta = paged_metadata([30], [45], page, torch.device("cpu"), seed=3)
    cache = torch.full((2, NUM_PAGES, page, kv_heads, dim), float("nan")).bfloat16()
    for p in meta.block_tables[0]:
        cache[:, p] = torch.randn(2, page, kv_heads, dim).bfloat16()
    cache[:, meta.block_tables[0][-1], 45 % page :] = float("nan")
    attention = TorchAttention(dim**-0.5, kernel, prefill_kernel)
    attention.plan(meta)
    out = attention.forward(
        torch.randn(30, 4, dim).bfloat16(),
        torch.randn(30, kv_heads, dim).bfloat16(),
        torch.randn(30, kv_heads, dim).bfloat16(),
        (cache[0], cache[1]),
    )
    assert torch.isfinite(out).all()


def test_a_decode_reads_only_its_own_pages(kernel: cpu_kernels.Kernel) -> None:
    """NaN in every page but the sequence's: none reaches its output."""
    page, kv_heads, dim = 16, 2, 64
    meta = paged_metadata([1], [40], page, torch.device("cpu"), seed=3)
    cache = torch.full((2, NUM_PAGES, page, kv_heads, dim), float("nan"))  # keys, values
    for p in meta.block_tables[0]:
        cache[:, p] = torch.randn(2, page, kv_heads, dim)
    attention = TorchAttention(dim**-0.5, kernel)
    attention.plan(meta)
    out = attention.forward(
        torch.randn(1, 4, dim),
        torch.randn(1, kv_heads, dim),
        torch.randn(1, kv_heads, dim),
        (cache[0], cache[1]),
    )
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", ["mixed", "decode-edges"])
def test_the_kv_writer_writes_what_index_copy_writes(step: str, dtype: torch.dtype) -> None:
    """k and v as a split of a fused QKV projection leaves them (each token's heads
    side by side, tokens a whole QKV row apart): the compiled writer fills the
    same cache rows with the same bits as the index_copy_ path; a k whose heads
    are not side by side (a transposed view) takes that path."""
    writer = cpu_kernels.kv_writer()
    assert writer is not None, "no C compiler"
    kv_heads, dim, page = 2, 64, 16
    q_lens, seq_lens = CASES[step]
    meta = paged_metadata(q_lens, seq_lens, page, torch.device("cpu"), seed=5)
    tokens = len(meta.slot_mapping)
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim).to(dtype)
    _, k, v = qkv.split([4 * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    want = torch.zeros(2, NUM_PAGES, page, kv_heads, dim, dtype=dtype)
    got = torch.zeros_like(want)
    write_kv((want[0], want[1]), k, v, meta)
    write_kv((got[0], got[1]), k, v, meta, writer)
    assert torch.equal(
        got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
    assert int((got != 0).any(dim=(-1, -2)).sum()) == tokens * 2  # those rows, no others
    heads_apart = torch.randn(kv_heads, tokens, dim).to(dtype).transpose(0, 1)
    again = torch.zeros_like(want)
    write_kv((again[0], again[1]), heads_apart, v, meta, writer)
    write_kv((want[0], want[1]), heads_apart, v, meta)
    assert torch.equal(again, want)


def test_the_kv_writer_refuses_a_slot_outside_the_cache() -> None:
    writer = cpu_kernels.kv_writer()
    assert writer is not None, "no C compiler"
    meta = paged_metadata([1, 1], [3, 20], 16, torch.device("cpu"), seed=1)
    meta.slot_mapping[1] = NUM_PAGES * 16  # one past the last row
    cache = torch.zeros(2, NUM_PAGES, 16, 2, 64)
    with pytest.raises(IndexError, match="outside the cache"):
        write_kv((cache[0], cache[1]), torch.ones(2, 2, 64), torch.ones(2, 2, 64), meta, writer)
    assert not cache.any()  # nothing written, not even the first row


def test_built_once_then_loaded_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    library = cpu_kernels.build()
    assert library.parent == tmp_path / "kernels" and library.exists()
    built_at = library.stat().st_mtime_ns
    monkeypatch.setenv("CC", "no-such-compiler")  # another compiler: another library
    with pytest.raises(FileNotFoundError, match="no-such-compiler"):
        cpu_kernels.build()
    monkeypatch.delenv("CC")
    assert cpu_kernels.build() == library
    assert library.stat().st_mtime_ns == built_at
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [library.name]


def test_a_changed_source_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "paged_attention.c"
    source.write_text(cpu_kernels.SOURCE.read_text())
    first = cpu_kernels.build(source)
    source.write_text(cpu_kernels.SOURCE.read_text() + "\n/* changed */\n")
    assert cpu_kernels.build(source) != first


@pytest.mark.parametrize(
    ("kernels", "backend", "fallback"),
    [
        (("paged_decode_attention",), attention_backend, "torch"),
        (("fused_ops",), ops_backend, "torch"),
        (("linear_kernel", "f32_linear"), linear_backend, "onednn"),  # oneDNN's packed GEMM
    ],
    ids=["attention", "fused-ops", "linear"],
)
def test_without_a_compiler_the_engine_keeps_torch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kernels: tuple[str, ...],
    backend: Callable[[str, torch.dtype, torch.device], str],
    fallback: str,
) -> None:
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    # kernels that share one loaded library: load it anew too (and cache nothing)
    for library in ("_attention_library", "_linear_library"):
        monkeypatch.setattr(cpu_kernels, library, getattr(cpu_kernels, library).__wrapped__)
    for name in kernels:
        uncached = getattr(cpu_kernels, name).__wrapped__
        assert uncached() is None
        monkeypatch.setattr(backends, name, uncached)
    cpu = torch.device("cpu")
    assert backend("auto", torch.float32, cpu) == fallback
    with pytest.raises(ValueError, match="C compiler"):
        backend("cpu", torch.float32, cpu)


def test_the_cpu_default_is_the_kernel(kernel: cpu_kernels.Kernel) -> None:
    """In both dtypes it has (test_bfloat16 holds it to HF's bfloat16 generate())."""
    cpu = torch.device("cpu")
    assert attention_backend("auto", torch.float32, cpu) == "cpu"
    assert attention_backend("auto", torch.bfloat16, cpu) == "cpu"
    assert attention_backend("cpu", torch.bfloat16, cpu) == "cpu"
    assert attention_backend("torch", torch.float32, cpu) == "torch"
    assert attention_backend("auto", torch.float16, cpu) == "torch"
    with pytest.raises(ValueError, match="bfloat16"):
        attention_backend("cpu", torch.float16, cpu)
