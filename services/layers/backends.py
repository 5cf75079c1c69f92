"""Which backend each `auto` choice of EngineConfig (attention, projections, fused
operations, MoE experts) resolves to on this device and dtype, and why a choice
that cannot run here is refused."""

from __future__ import annotations

import importlib.util
import logging

import torch

from services.layers.cpu_kernels import (
    BF16_KINDS,
    KERNEL_DTYPES,
    bf16_linear,
    f32_linear,
    fused_ops,
    linear_kernel,
    paged_decode_attention,
)
from services.layers.linear import onednn_supports

logger = logging.getLogger(__name__)


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
