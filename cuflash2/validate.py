"""Input validation: pure functions over tensor descriptions, run before any compile or launch.

Every error names the argument, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import math

from .config import MAX_HEAD_DIM

SUPPORTED_DTYPES = ("float16", "bfloat16")
ALIGN_BYTES = 16  # the widest global access; narrower layouts take narrower ones (config.vector_width)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What validation needs to know about an array, framework-independent."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # numpy-style name: "float16", "bfloat16", ...
    device: str  # "cpu" or "cuda:N"
    data_ptr: int = 0
    itemsize: int = 2


def contiguous_info(shape, dtype: str, itemsize: int, device: str = "", data_ptr: int = 0) -> TensorInfo:
    """TensorInfo of a dense row-major array of this shape."""
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(tuple(shape), strides, dtype, device, data_ptr, itemsize)


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
    kernels built for 8-, 4- or 2-byte ones (config.vector_width), without a copy."""
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


def check_compute_capability(major: int, minor: int) -> int:
    arch = major * 10 + minor
    expect(arch >= 80, lambda: f"device: expected a GPU of compute capability >= 8.0 (Ampere or newer), "
                        f"got {major}.{minor}", RuntimeError)
    return arch
