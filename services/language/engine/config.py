"""EngineConfig, and what its `auto` choices of backend (attention, projections,
fused operations, MoE experts) resolve to on this device and dtype."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field

import torch

from services.language.engine.cpu_kernels import (
    BF16_KINDS,
    KERNEL_DTYPES,
    bf16_linear,
    f32_linear,
    fused_ops,
    linear_kernel,
    paged_decode_attention,
)
from services.language.engine.linear import onednn_supports
from services.language.engine.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 * 1024 * 1024
    page_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # "torch", "cpu" (torch's, decodes in the compiled paged kernel; float32 or
    # bfloat16), "flashinfer", or "auto": FlashInfer on CUDA where it is installed,
    # "cpu" on a CPU in float32 or bfloat16 where the kernel builds, else torch
    attention: str = "auto"
    moe: str = "auto"  # MoE experts: "torch", "flashinfer", or "auto" (FlashInfer on CUDA)
    # projections: "torch", "cpu" (EPD's AVX2 kernel for few rows, float32), "avx512"
    # (EPD's float32 kernel on AVX-512, every call), "onednn" (packed), "amx" (EPD's
    # bfloat16 kernel on AMX for few rows, oneDNN above) or "avx512bf16" (on
    # AVX512-BF16, every call), or "auto": in float32 "avx512" where the CPU has
    # AVX-512, else "cpu" where the kernel builds (oneDNN where torch runs AVX-512
    # but EPD's kernels are built without); in bfloat16 "amx" where the CPU has
    # AMX, else "avx512bf16" where it has AVX512-BF16; else oneDNN where it packs
    # the dtype, else torch (linear.py)
    linear: str = "auto"
    # RMSNorm and rotary embedding: "torch", "cpu" (compiled and fused, float32 or
    # bfloat16), or "auto" ("cpu" on a CPU where the kernels build, else torch)
    ops: str = "auto"
    # a decode-only step's decoder layers: "python" (layer by layer), "compiled" (in
    # one C call, cpu_decode.py: the projections on EPD's kernels, the fused operations and
    # the compiled paged attention, a dense model without q/k norms), or "auto"
    # ("compiled" where it runs)
    decode_layers: str = "auto"
    cuda_graphs: bool = True  # decode steps from CUDA graphs (CUDA with FlashInfer attention)
    prefix_caching: bool = True  # prompts share the KV pages of the text they begin with
    # OpenMP threads of a step while requests of this instance await their embeddings
    # (0: all of them). Where the vision tower runs on the same cores (`epd serve` on
    # one host), the two then split the cores instead of contending for all of them.
    threads_while_encoding: int = 0
    # OpenMP threads of a step that only decodes (0: all). `epd serve` on a small
    # host may leave a core to the processes that stream the tokens: on the small
    # demo (2 cores) one thread decodes as fast there as two, which stall on every
    # parallel region when the front end takes a core (docs/performance.md)
    decode_threads: int = 0


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def _auto(choice: str, dtype: torch.dtype, device: torch.device, what: str) -> str:
    """`auto` is FlashInfer on CUDA unless the model is in float32 (FlashInfer's
    kernels are half precision only) or FlashInfer is not installed, then torch,
    with a log line."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "torch"
    if dtype == torch.float32:
        logger.info("float32 on %s: torch %s (FlashInfer has no float32 kernels)", device, what)
        return "torch"
    if not flashinfer_installed():
        logger.warning("FlashInfer is not installed (pip install .[gpu]): torch %s", what)
        return "torch"
    return "flashinfer"


def attention_backend(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "torch", "cpu" or "flashinfer" for EngineConfig.attention."""
    if choice == "flashinfer" and dtype == torch.float32:
        raise ValueError("FlashInfer attention needs float16 or bfloat16, not float32")
    compiled = device.type == "cpu" and dtype in KERNEL_DTYPES
    if choice == "cpu" and not (compiled and paged_decode_attention() is not None):
        raise ValueError(
            "the compiled paged attention needs a CPU, float32 or bfloat16, and a C compiler"
        )
    if choice == "auto" and compiled:
        choice = "cpu" if paged_decode_attention() is not None else "torch"
    return _auto(choice, dtype, device, "attention")


def avx512() -> bool:
    """Whether torch's CPU kernels run AVX-512 here (and so do oneDNN's)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def linear_backend(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "torch", "cpu", "avx512", "onednn", "amx" or "avx512bf16" for EngineConfig.linear (torch:
    cuBLAS on GPUs)."""
    cpu = device.type == "cpu"
    kernel = cpu and dtype == torch.float32 and linear_kernel() is not None
    packs = cpu and onednn_supports(dtype)
    bf16 = cpu and dtype == torch.bfloat16 and packs
    if choice == "cpu" and not kernel:
        raise ValueError("the CPU linear kernel needs a CPU with AVX2, float32 and a C compiler")
    if choice == "onednn" and not packs:
        raise ValueError(f"oneDNN packed projections need a CPU that packs {dtype}")
    for kind, needs in (("amx", "AMX-BF16"), ("avx512bf16", "AVX512-BF16")):
        if choice == kind and not (bf16 and bf16_linear(kind) is not None):
            raise ValueError(
                f"the {kind} linear kernel needs a CPU with {needs}, bfloat16 and a C compiler"
            )
    f32 = cpu and dtype == torch.float32 and f32_linear() is not None
    if choice == "avx512" and not f32:
        raise ValueError(
            "the avx512 linear kernel needs a CPU with AVX-512, float32 and a C compiler"
        )
    if choice != "auto":
        return choice
    if f32:
        return "avx512"
    if kernel and not (packs and avx512()):
        return "cpu"
    if bf16:
        return next((kind for kind in BF16_KINDS if bf16_linear(kind)), "onednn")
    return "onednn" if packs else "torch"


def ops_backend(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "torch" or "cpu" for EngineConfig.ops."""
    built = device.type == "cpu" and dtype in KERNEL_DTYPES and fused_ops() is not None
    if choice == "cpu" and not built:
        raise ValueError(
            "the fused CPU operations need a CPU, float32 or bfloat16, and a C compiler"
        )
    if choice == "auto":
        return "cpu" if built else "torch"
    return choice


def moe_backend(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """ "torch" or "flashinfer" for EngineConfig.moe (the experts of MoE layers)."""
    if choice == "flashinfer" and (device.type != "cuda" or dtype == torch.float32):
        raise ValueError("FlashInfer's fused MoE needs CUDA and float16 or bfloat16")
    return _auto(choice, dtype, device, "MoE experts")
