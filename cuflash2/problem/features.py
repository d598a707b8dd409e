"""FlashAttention-2's optional features of one call (sliding window, softcap, ALiBi, varlen,
dropout): their validation. Pure functions over tensor descriptions.

A call that uses none of them can run kernels without them (Features.is_plain); a kernel family
turns them into its kernels' arguments.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .tensors import AttentionShape, TensorInfo, expect


@dataclasses.dataclass(frozen=True)
class Features:
    """The optional features of one call, validated. Window sides are -1 when unbounded."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: TensorInfo | None = None  # fp32 (nheads,) or (batch, nheads)
    cu_seqlens_q: TensorInfo | None = None  # int32 (batch + 1,)
    cu_seqlens_k: TensorInfo | None = None
    total_q: int = 0  # varlen: rows of the packed q and k tensors
    total_k: int = 0
    dropout_p: float = 0.0  # requested drop probability (applied as dropout.effective_dropout)
    dropout_seed: int = 0
    dropout_offset: int = 0
    dropout_rng_state: TensorInfo | None = None  # int64 (seed, offset) on the device, read instead

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def is_plain(self, causal: bool) -> bool:
        """True when the plain kernels compute this call exactly."""
        window_plain = self.window_left < 0 and (self.window_right < 0 or (causal and self.window_right >= 0))
        return (window_plain and self.softcap == 0.0 and self.alibi is None and not self.varlen
                and self.dropout_p == 0.0)

    @property
    def replayable(self) -> bool:
        """No ALiBi slopes, cu_seqlens or dropout: the kernel arguments hold no per-call address or
        seed, so recorded launches can be replayed with new buffers (cuflash2.core.replay)."""
        return self.alibi is None and not self.varlen and self.dropout_p == 0.0

    @property
    def modifies_scores(self) -> bool:
        """Softcap or ALiBi: the kernels then compute natural-log logits before the softmax."""
        return self.softcap > 0.0 or self.alibi is not None


PLAIN = Features()


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """One attention call as a kernel family sees it: sizes, mask and optional features (no
    addresses). What family_for chooses a family by, and what a family's entry points take."""

    shape: AttentionShape
    causal: bool = False
    features: Features = PLAIN

    @property
    def plain(self) -> bool:
        """True when kernels without the optional features compute this call exactly."""
        return self.features.is_plain(self.causal)


def check_window(window_size) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side."""
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    expect(left >= -1 and right >= -1,
            lambda: f"window_size: expected entries >= -1 (-1 = unbounded), got {(left, right)}")
    return left, right


def check_softcap(softcap) -> float:
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}") from None
    expect(math.isfinite(value) and value >= 0.0, lambda: f"softcap: expected a finite number >= 0, got {value}")
    return value


def check_alibi(info: TensorInfo, batch: int, nheads: int, device: str) -> None:
    expect(info.dtype == "float32", lambda: f"alibi_slopes: expected dtype float32, got {info.dtype}", TypeError)
    expect(info.shape in ((nheads,), (batch, nheads)),
            lambda: f"alibi_slopes: expected shape ({nheads},) or ({batch}, {nheads}), got {info.shape}")
    expect(info.strides[-1] == 1 or info.shape[-1] == 1,
            lambda: f"alibi_slopes: expected a contiguous last dim, got strides {info.strides}")
    expect(info.device == device, lambda: f"alibi_slopes: expected device {device} (same as q), got {info.device}")


def check_rng_state(info: TensorInfo, device: str) -> None:
    """A device (seed, offset) pair for dropout."""
    expect(info.dtype == "int64", lambda: f"dropout_rng_state: expected dtype int64, got {info.dtype}", TypeError)
    expect(info.shape == (2,) and info.strides == (1,),
           lambda: f"dropout_rng_state: expected a contiguous array of shape (2,), got shape {info.shape} "
                   f"strides {info.strides}")
    expect(info.device == device,
           lambda: f"dropout_rng_state: expected device {device} (same as q), got {info.device}")


def check_packed_dims(name: str, info: TensorInfo) -> None:
    """A varlen tensor: (total_seqlen, nheads, headdim)."""
    expect(len(info.shape) == 3,
           lambda: f"{name}: expected 3 dims (total_seqlen, nheads, headdim), got shape {info.shape}")


def check_cu_seqlens_layout(name: str, info: TensorInfo, batch: int | None, device: str) -> int:
    """What is static about cumulative sequence lengths (dtype, shape, layout, device, batch);
    returns the batch size."""
    expect(info.dtype == "int32", lambda: f"{name}: expected dtype int32, got {info.dtype}", TypeError)
    expect(len(info.shape) == 1 and info.shape[0] >= 2,
            lambda: f"{name}: expected shape (batch + 1,) with batch >= 1, got {info.shape}")
    expect(info.strides[0] == 1, lambda: f"{name}: expected a contiguous array, got stride {info.strides[0]}")
    expect(info.device == device, lambda: f"{name}: expected device {device} (same as q), got {info.device}")
    n = info.shape[0] - 1
    if batch is not None:
        expect(n == batch, lambda: f"{name}: expected {batch + 1} entries (same batch as cu_seqlens_q), got {n + 1}")
    return n


def check_cu_seqlens(name: str, info: TensorInfo, values, total: int, max_seqlen: int, batch: int | None,
                     device: str) -> int:
    """Checks cumulative sequence lengths (values: a host copy); returns the batch size."""
    n = check_cu_seqlens_layout(name, info, batch, device)
    values = np.asarray(values, dtype=np.int64)
    expect(values[0] == 0, lambda: f"{name}: expected the first entry to be 0, got {values[0]}")
    lengths = np.diff(values)
    expect(bool((lengths >= 0).all()), lambda: f"{name}: expected non-decreasing values, got {values.tolist()[:16]}")
    expect(values[-1] <= total, lambda: f"{name}: expected the last entry <= {total} (rows of the packed tensor), "
                                 f"got {values[-1]}")
    longest = int(lengths.max())
    expect(longest <= max_seqlen, lambda: f"{name}: expected sequences of at most max_seqlen = {max_seqlen}, "
                                   f"got one of {longest}")
    return n


def check_max_seqlen(name: str, value) -> int:
    expect(isinstance(value, (int, np.integer)) and not isinstance(value, bool),
            lambda: f"{name}: expected an int, got {type(value).__name__}", TypeError)
    expect(value >= 0, lambda: f"{name}: expected >= 0, got {value}")
    return int(value)


def varlen_shape(q: TensorInfo, k: TensorInfo, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float) -> AttentionShape:
    """The AttentionShape the kernels see for a varlen call (seqlens are the maxima)."""
    return AttentionShape(batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], q.dtype,
                          softmax_scale)


def as_batched(info: TensorInfo, batch: int, max_seqlen: int) -> TensorInfo:
    """A packed (total, nheads, dim) tensor described as (batch, max_seqlen, nheads, dim) with batch
    stride 0: the kernels find each sequence through cu_seqlens."""
    return dataclasses.replace(info, shape=(batch, max_seqlen, *info.shape[1:]), strides=(0, *info.strides))
