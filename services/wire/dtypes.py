"""The dtypes a model and its embeddings may use, by name, and what `auto` picks.

`auto` is bfloat16 where the hardware computes in it natively (a CUDA GPU
that supports it; a CPU with AVX512-BF16 or AMX, where oneDNN runs bf16
matmuls), float32 elsewhere: on an AVX2-only CPU bf16 is emulated and slower
than float32.
"""

from __future__ import annotations

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
AUTO = "auto"


def native_bf16(device: str | torch.device) -> bool:
    """Whether `device` computes bfloat16 matmuls in hardware."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name, or `auto` for the best one on `device`; ValueError otherwise."""
    if name == AUTO:
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"dtype must be {AUTO} or one of {', '.join(DTYPES_BY_NAME)}")
    return DTYPES_BY_NAME[name]
