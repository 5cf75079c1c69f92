"""EPD's C kernels for every CPU class it chooses paths for, whatever CPU runs the
tests. A session's machine is one class; without these, a change made on one
could break another's build unseen (the engine there falls back to torch's
path with a log line). Each source compiles without a warning for each class
(gcc's -march of it: EPD_KERNEL_MARCH), and the AVX2 build, which an AVX-512
machine runs too (torch's and its libraries' dispatch held to AVX2 as well),
passes the kernel tests and the engine's token-exact ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.layers import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(path.name for path in cpu_kernels.CSRC.glob("*.c"))
TARGETS = {
    "x86-64": "no AVX2: the plain loops",
    "x86-64-v3": "AVX2 and FMA",
    "x86-64-v4": "AVX-512",
    "cooperlake": "AVX512-BF16",
    "sapphirerapids": "AMX",
}
# what runs the kernels, and the engine against HF generate() on them
KERNEL_TESTS = [
    "tests/layers/test_cpu_attention.py",
    "tests/layers/test_fused_ops.py",
    "tests/layers/test_linear.py",
    "tests/layers/test_cpu_decode.py",
    "tests/layers/test_vision_tower.py",
    "tests/language/test_engine.py",
]


@pytest.mark.parametrize("march", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_each_kernel_compiles_without_a_warning_for_each_cpu_class(
    source: str, march: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPD_KERNEL_MARCH", march)
    extra = cpu_kernels.FUSED_OPS_FLAGS if source == "fused_ops.c" else ()
    warnings = ("-Wall", "-Wextra", "-Werror")
    line = cpu_kernels.command(cpu_kernels.CSRC / source, (*extra, *warnings), tmp_path / "k.so")
    assert f"-march={march}" in line
    built = subprocess.run(line, capture_output=True, text=True)
    assert built.returncode == 0, f"{source} for {TARGETS[march]} ({march}):\n{built.stderr}"


def _cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return {flag for ln in lines if ln.startswith("flags") for flag in ln.split(":")[1].split()}


# An AVX2 machine, as far as this process can tell: EPD's kernels built for it, and
# torch's, oneDNN's and MKL's dispatch held to AVX2
AVX2 = {
    "EPD_KERNEL_MARCH": "x86-64-v3",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="this CPU has no AVX2 and FMA")
def test_the_avx2_build_passes_the_kernel_and_engine_tests() -> None:
    """Built for x86-64-v3, the libraries have no AVX-512 kernels, the engine takes
    the paths an AVX2 machine takes (float32: EPD's projection kernel, the compiled
    decode step), and the tests that run the kernels, and the engine against HF
    generate(), pass."""
    environment = {**os.environ, **AVX2}
    choices = (
        "import torch\n"
        "from services.layers import backends, cpu_kernels as k\n"
        "cpu = torch.device('cpu')\n"
        "print(k.prefill_attention('avx512bf16') is None, k.linear_kernel() is not None,\n"
        "      k.paged_decode_attention() is not None, k.fused_ops() is not None,\n"
        "      backends.linear_backend('auto', torch.float32, cpu))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", choices], env=environment, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "True", "cpu"]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout.splitlines()[-1]
