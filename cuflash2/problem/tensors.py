"""Attention problems and their checks: pure functions over tensor descriptions, run before any
compile or launch.

Every error names the argument, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import math

from ..runtime.tensors import TensorInfo, contiguous_info

MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (batch and heads go there)
SUPPORTED_DTYPES = ("float16", "bfloat16")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}  # the kernels' and the CLI's names
DTYPE_NAMES = {short: name for name, short in SHORT_DTYPE.items()}
ALIGN_BYTES = 16  # the widest global access; narrower layouts take narrower ones (the kernel family's vector width)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    dtype: str
    softmax_scale: float

    @property
    def kv_group(self) -> int:
        return self.nheads // self.nheads_kv


def expect(condition: bool, message, error=ValueError) -> None:
    """Raise error(message()) unless condition. The message is a lambda so that the f-string is
    only formatted on failure: validation runs on every call, and formatting dominated its cost."""
    if not condition:
        raise error(message() if callable(message) else message)


def check_bool(name: str, value) -> bool:
    """`value` as a bool, or a TypeError naming the argument (causal=1 or causal="yes" is a mistake
    that would otherwise pass as truthy). NumPy's bool_ counts as a bool."""
    if value is True or value is False:
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name}: expected bool, got {type(value).__name__}")


def check_dtype(name: str, info: TensorInfo, expected: str | None = None) -> None:
    if expected is None:
        expect(info.dtype in SUPPORTED_DTYPES,
                lambda: f"{name}: expected dtype float16 or bfloat16, got {info.dtype}", TypeError)
    else:
        expect(info.dtype == expected, lambda: f"{name}: expected dtype {expected} (same as q), got {info.dtype}", TypeError)


def check_alignment(name: str, info: TensorInfo) -> None:
    """The kernels access whole elements: the base pointer must be a multiple of the element size.
    Pointers and strides need no more: a call whose layout does not allow 16-byte accesses runs
    kernels built for 8-, 4- or 2-byte ones (the kernel family's vector width), without a copy."""
    expect(info.data_ptr % info.itemsize == 0,
            lambda: f"{name}: expected a data pointer aligned to {info.itemsize} bytes (whole elements), got address "
            f"{info.data_ptr:#x}")


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}") from None
    expect(math.isfinite(scale) and scale > 0, lambda: f"softmax_scale: expected a finite positive number, got {scale}")
    return scale


def validate_qkv(q: TensorInfo, k: TensorInfo, v: TensorInfo, softmax_scale=None,
                 check_pointers: bool = True) -> AttentionShape:
    """Check q (b, sq, hq, d), k and v (b, sk, hk, d) against each other; return the problem size."""
    for name, info in (("q", q), ("k", k), ("v", v)):
        expect(len(info.shape) == 4,
                lambda: f"{name}: expected 4 dims (batch, seqlen, nheads, headdim), got shape {info.shape}")
    check_dtype("q", q)
    check_dtype("k", k, q.dtype)
    check_dtype("v", v, q.dtype)
    for name, info in (("k", k), ("v", v)):
        expect(info.device == q.device, lambda: f"{name}: expected device {q.device} (same as q), got {info.device}")
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    expect(v.shape == k.shape, lambda: f"v: expected shape {k.shape} (same as k), got {v.shape}")
    expect(k.shape[0] == batch, lambda: f"k: expected batch {batch} (same as q), got {k.shape[0]}")
    expect(k.shape[3] == head_dim, lambda: f"k: expected head dim {head_dim} (same as q), got {k.shape[3]}")
    expect(nheads >= 1 and nheads_kv >= 1, lambda: f"k: expected at least one head, got q {nheads}, k {nheads_kv}")
    expect(nheads % nheads_kv == 0,
            lambda: f"k: expected nheads of q ({nheads}) to be a multiple of nheads of k/v, got {nheads_kv}")
    expect(1 <= head_dim <= MAX_HEAD_DIM, lambda: f"q: expected head dim 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if check_pointers:
        for name, info in (("q", q), ("k", k), ("v", v)):
            check_alignment(name, info)
    scale = softmax_scale_or_default(softmax_scale, head_dim)
    return AttentionShape(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, q.dtype, scale)


def validate_out(out: TensorInfo, shape: AttentionShape, check_pointers: bool = True) -> None:
    expected = (shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim)
    expect(out.shape == expected, lambda: f"out: expected shape {expected}, got {out.shape}")
    expect(out.dtype == shape.dtype, lambda: f"out: expected dtype {shape.dtype} (same as q), got {out.dtype}", TypeError)
    expect(out.strides[-1] == 1, lambda: f"out: expected a contiguous last dim (stride 1), got stride {out.strides[-1]}")
    if check_pointers:
        check_alignment("out", out)


def check_grid(shape: AttentionShape) -> None:
    """Batch and heads index the launch grid's y and z dimensions."""
    for name, value in (("batch", shape.batch), ("nheads", shape.nheads)):
        if value > MAX_GRID_YZ:
            raise ValueError(f"q: expected {name} <= {MAX_GRID_YZ}, got {value}")


def check_like_input(name, info, q_info) -> None:
    if info.shape != q_info.shape:
        raise ValueError(f"{name}: expected shape {q_info.shape} (same as {like_name(name)}), got {info.shape}")
    if info.dtype != q_info.dtype:
        raise TypeError(f"{name}: expected dtype {q_info.dtype} (same as {like_name(name)}), got {info.dtype}")


def like_name(name: str) -> str:
    return {"dk": "k", "dv": "v"}.get(name, "q")


def check_lse(info, shape: AttentionShape) -> None:
    expected = (shape.batch, shape.nheads, shape.seqlen_q)
    if tuple(info.shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected}, got {tuple(info.shape)}")
    if info.dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {info.dtype}")
    if all(info.shape) and info.strides != (shape.nheads * shape.seqlen_q, shape.seqlen_q, 1):
        raise ValueError(f"softmax_lse: expected a contiguous array, got strides {info.strides}")


__all__ = ["ALIGN_BYTES", "DTYPE_NAMES", "MAX_GRID_YZ", "MAX_HEAD_DIM", "SHORT_DTYPE", "SUPPORTED_DTYPES", "AttentionShape", "TensorInfo",
           "check_alignment", "check_bool", "check_like_input", "check_lse", "like_name", "check_dtype", "check_grid", "contiguous_info", "expect",
           "softmax_scale_or_default", "validate_out", "validate_qkv"]
