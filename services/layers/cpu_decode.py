"""A decode step's decoder layers in one compiled call (csrc/decode.c).

On the CPU a decode step of a small model is bound by its per-operator cost:
the small demo's ~600 torch operators and ~80 ctypes calls a step, a few
microseconds of Python and dispatch each, are ~30 % of it. Where every part of
a layer already runs in EPD's kernels (the projections: bfloat16 on AMX or
AVX512-BF16, float32 on AVX2; the fused norms, rotary embedding and SiLU; the
compiled paged attention and KV writer), the step calls them layer after layer
from C, with the same inputs in the same order: the hidden states are bit-equal
to the Python path's.

Steps with a prompt (prefill chunks), with deepstack features, or with more
rows than the projection kernel takes stay on the Python path, as do models it
does not cover (MoE layers, q/k norms) and other dtypes and backends.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from services.layers.attention import TorchAttention
from services.layers.cpu_kernels import Bf16Linear, FusedOps, address, decode_step
from services.layers.language_model import MLP, DecoderLayer, LanguageModel, RMSNorm
from services.layers.linear import (
    KERNEL_MAX_ROWS,
    Bf16PackedLinear,
    F32PackedLinear,
    KernelLinear,
)

logger = logging.getLogger(__name__)

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _ptr)
        for name in (
            "linear",
            "linear_f32",
            "attention",
            "write_kv",
            "rms_norm",
            "add_rms_norm",
            "rotary",
            "silu_mul",
            "silu_mul_f32",
            "silu",
        )
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *(
            (name, _i64)
            for name in (
                "layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "page_size",
                "cache_rows",
                "bf16",
            )
        ),
        ("eps", _f32),
        ("scale", _f32),
        ("final_norm", _ptr),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _ptr)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "down",
            "keys",
            "values",
        )
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("max_pages", _i64),
        *((name, _ptr) for name in ("block_tables", "seq_lens", "slots", "cos", "sin")),
    ]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


Projection = Bf16PackedLinear | F32PackedLinear | KernelLinear


@dataclass(frozen=True, slots=True)
class _Parts:
    """A dense decoder layer's projections on one of EPD's kernels (bfloat16's or
    AVX-512 float32's packing, AVX2 float32's rows as loaded), and its norms."""

    input_norm: RMSNorm
    post_norm: RMSNorm
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


def weight(projection: Projection) -> torch.Tensor:
    """The weight as its kernel reads it."""
    return projection.weight if isinstance(projection, KernelLinear) else projection.tiles


def _parts(layer: nn.Module, dtype: torch.dtype) -> _Parts | str:
    """The layer's parts, or why the compiled step cannot run it."""
    assert isinstance(layer, DecoderLayer)
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, MLP):
        return "MoE layers"
    if not isinstance(attn.q_norm, nn.Identity):
        return "q/k norms"
    if layer.input_layernorm.ops is None or attn.ops is None:
        return "the fused operations are off"
    linears: list[nn.Module] = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    kinds = (Bf16PackedLinear,) if dtype == torch.bfloat16 else (F32PackedLinear, KernelLinear)
    on_kernel = [linear for linear in linears if isinstance(linear, kinds)]
    if len(on_kernel) < len(linears) or len({type(linear) for linear in on_kernel}) > 1:
        return f"the projections are not on one of EPD's {dtype} kernels"
    if dtype == torch.bfloat16 and on_kernel[-1].in_features % Bf16Linear.TILE_K:
        return "an intermediate size not a multiple of 32"
    return _Parts(layer.input_layernorm, layer.post_attention_layernorm, *on_kernel)


def _layers(model: LanguageModel, attention: object, dtype: torch.dtype) -> list[_Parts] | str:
    """Each decoder layer's parts, or why the compiled decode step cannot run this
    model on these backends."""
    if model.norm.weight.device.type != "cpu":
        return "not on a CPU"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (it runs bfloat16 and float32)"
    if not isinstance(attention, TorchAttention) or attention.decode_kernel is None:
        return "the attention is not the compiled paged kernel"
    if attention.kv_writer is None:
        return "no compiled KV writer"
    spec = model.spec
    widths = (spec.hidden_size, spec.num_heads * spec.head_dim)
    if dtype == torch.bfloat16 and any(n % Bf16Linear.TILE_K for n in widths):
        return "projection inputs not a multiple of 32"
    layers = []
    for layer in model.layers:
        if isinstance(parts := _parts(layer, dtype), str):
            return parts
        layers.append(parts)
    return layers


def unsupported(model: LanguageModel, attention: object, dtype: torch.dtype) -> str | None:
    """Why the compiled decode step cannot run this model on these backends, or None."""
    layers = _layers(model, attention, dtype)
    return layers if isinstance(layers, str) else None


def _max_rows(projection: Projection) -> int | None:
    """The most rows a call of its kernel takes (None: any)."""
    if isinstance(projection, Bf16PackedLinear):
        return projection.kernel.max_rows
    return KERNEL_MAX_ROWS if isinstance(projection, KernelLinear) else None


def _kernels(qkv: Projection, attention: TorchAttention, ops: FusedOps) -> _Kernels:
    """Where each kernel the step calls lies: the projections' of qkv's dtype
    (the other's NULL), attention's and the fused operations'."""
    assert attention.decode_kernel is not None and attention.kv_writer is not None
    bf16 = isinstance(qkv, Bf16PackedLinear)
    rms_norm, add_rms_norm, rotary, silu_mul, silu_mul_f32 = ops.addresses()
    return _Kernels(
        qkv.kernel.address() if bf16 else None,
        None if bf16 else qkv.kernel.address(),
        address(attention.decode_kernel),
        address(attention.kv_writer),
        rms_norm,
        add_rms_norm,
        rotary,
        silu_mul,
        silu_mul_f32,
        ops.silu.data_ptr(),
    )


class CompiledDecode:
    """The decoder layers of `model` (its `layers`, as `_layers` found them) over the
    KV cache `caches`, for a decode step at a time: `__call__`."""

    def __init__(
        self,
        library: ctypes.CDLL,
        model: LanguageModel,
        layers: list[_Parts],
        attention: TorchAttention,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
    ) -> None:
        ops = layers[0].input_norm.ops
        assert ops is not None
        assert attention.decode_kernel is not None and attention.kv_writer is not None
        assert all(k.is_contiguous() and v.is_contiguous() for k, v in caches)
        self._run = library.decode_layers
        self._attention = attention
        qkv = layers[0].qkv
        bf16 = isinstance(qkv, Bf16PackedLinear)
        # the rows a call of its projection kernel takes (None: any)
        self._max_rows = _max_rows(qkv)
        self._kernels = _kernels(qkv, attention, ops)
        spec = model.spec
        self._model = _Model(
            spec.num_layers,
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            layers[0].down.in_features,
            page_size,
            caches[0][0].numel() // (spec.num_kv_heads * spec.head_dim),
            int(bf16),
            model.norm.eps,
            attention.scale,
            model.norm.weight.data_ptr(),
        )
        self._layers = (_Layer * len(layers))(
            *(
                _Layer(
                    p.input_norm.weight.data_ptr(),
                    p.post_norm.weight.data_ptr(),
                    weight(p.qkv).data_ptr(),
                    _pointer(p.qkv.bias),
                    weight(p.o).data_ptr(),
                    _pointer(p.o.bias),
                    weight(p.gate_up).data_ptr(),
                    weight(p.down).data_ptr(),
                    keys.data_ptr(),
                    values.data_ptr(),
                )
                for p, (keys, values) in zip(layers, caches, strict=True)
            )
        )

    def takes(self, num_seqs: int) -> bool:
        """Whether a decode step of this many sequences runs here (the rows the
        projection kernel takes)."""
        return self._max_rows is None or num_seqs <= self._max_rows

    def __call__(
        self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The final norm's output [rows, hidden] for a decode step whose attention was
        planned: embeds [rows, hidden] (overwritten with it), cos/sin [rows, head_dim],
        slots [rows] (each new key's cache row)."""
        pages, lens = self._attention.decode_tables()
        rows = embeds.shape[0]
        assert pages.shape[0] == rows == len(slots) and embeds.is_contiguous()
        assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == embeds.dtype
        step = _Step(
            rows,
            pages.shape[1],
            pages.data_ptr(),
            lens.data_ptr(),
            slots.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )
        failed = self._run(
            ctypes.byref(self._kernels),
            ctypes.byref(self._model),
            self._layers,
            ctypes.byref(step),
            embeds.data_ptr(),
            torch.get_num_threads(),
        )
        if failed == -2:
            raise IndexError("a KV slot lies outside the cache")
        if failed:
            raise MemoryError("compiled decode step: no memory for its buffers or scores")
        return embeds


def compiled_decode(
    choice: str,
    model: LanguageModel,
    attention: object,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    page_size: int,
    dtype: torch.dtype,
) -> CompiledDecode | None:
    """EngineConfig.decode_layers: the compiled decode step for this model ("compiled",
    or "auto" where it can run), or None ("python", or "auto" where it cannot: a log
    line says why). ValueError for "compiled" where it cannot."""
    if choice == "python":
        return None
    layers = _layers(model, attention, dtype)
    library = decode_step() if not isinstance(layers, str) else None
    reason = layers if isinstance(layers, str) else "csrc/decode.c did not build"
    if isinstance(layers, str) or library is None:
        if choice == "compiled":
            raise ValueError(f"the compiled decode step cannot run here: {reason}")
        logger.info("decode steps layer by layer in Python: %s", reason)
        return None
    assert isinstance(attention, TorchAttention)
    return CompiledDecode(library, model, layers, attention, caches, page_size)
