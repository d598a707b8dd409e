"""Attention dropout: the keep mask the kernels draw, reproduced with NumPy or CuPy (`xp`).

Entry (row, key) of head bh = batch * nheads + head draws a 16-bit number and is dropped iff it is
below threshold = round(65536 p) (so the applied probability is within 2^-17 of p); kept entries
are scaled by 1 / (1 - p). The numbers come from Philox4x32-10 (counter-based: the backward
regenerates the forward's mask whatever its tiles): one call, counter = (group, row, bh, offset)
and key = (seed low 32 bits, seed high 32 bits), yields the eight numbers of keys
32 g + 8 t + 2 j + e (t = 0..3, e = 0..1) with group = 4 g + j, number 2 t + e.

Seeds: CuPy, JAX and NumPy calls take an explicit `dropout_seed` (a fresh one when None). Torch
calls without one draw (seed, offset) from torch's CUDA generator into a device tensor that the
kernels read (`dropout_rng_state`), so `torch.manual_seed` reproduces the mask, activation
checkpointing regenerates it, and CUDA-graph replays draw new ones.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_seed_source = np.random.default_rng()


class DropoutSpec(NamedTuple):
    """The dropout of one call: probability, and where the kernels take (seed, offset) from."""

    p: float = 0.0
    seed: int = 0
    offset: int = 0
    rng_state: Any = None  # a device int64 (seed, offset) pair, read by the kernels instead of seed/offset


NO_DROPOUT = DropoutSpec()


def check_dropout(dropout_p) -> float:
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}") from None
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout_p: expected 0 <= dropout_p < 1, got {p}")
    return p


#: Resolution of the drop probability: each entry draws a 16-bit number.
THRESHOLD_SCALE = 1 << 16


def dropout_threshold(p: float) -> int:
    """16-bit numbers below this are dropped (0: no dropout). At least 1 for any p > 0."""
    if p <= 0.0:
        return 0
    return min(THRESHOLD_SCALE - 1, max(1, round(p * THRESHOLD_SCALE)))


def effective_dropout(p: float) -> float:
    """The drop probability the kernels apply for a requested p (within 2^-17 of it, a multiple of
    2^-16; at least 2^-16 for any p > 0)."""
    return dropout_threshold(p) / THRESHOLD_SCALE


def rescale(p: float) -> float:
    """Factor of the kept entries: 1 / (1 - p) of the requested p (flash-attn's convention)."""
    return 1.0 / (1.0 - p) if p > 0.0 else 1.0


def new_seed() -> int:
    """A fresh 63-bit seed (from NumPy's entropy-seeded generator; no torch needed)."""
    return int(_seed_source.integers(0, 2**63 - 1))


def check_seed(name: str, seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"{name}: expected 0 <= {name} < 2**63, got {seed}")
    return seed


def philox4x32_10(xp, c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 on uint32 arrays (broadcast together); returns the four output words."""
    c = [xp.asarray(x).astype(xp.uint64) for x in (c0, c1, c2, c3)]
    c = list(xp.broadcast_arrays(*c))
    k0, k1 = k0 & _MASK32, k1 & _MASK32
    for _ in range(10):
        p0 = c[0] * _M0  # < 2**64: exact in uint64
        p1 = c[2] * _M1
        hi0, lo0 = p0 >> 32, p0 & _MASK32
        hi1, lo1 = p1 >> 32, p1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return [x.astype(xp.uint32) for x in c]


def keep_mask(xp, seed: int, offset: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, p: float,
              batch_index=None):
    """Bool (batch, nheads, seqlen_q, seqlen_k): True where the kernels keep the entry.

    batch_index: the batch entry numbers used for the counter (default 0..batch-1; a varlen
    sequence b passes [b])."""
    threshold = dropout_threshold(p)
    if batch_index is None:
        batch_index = np.arange(batch)
    bh = (xp.asarray(np.asarray(batch_index, np.int64))[:, None] * nheads + xp.arange(nheads)[None, :])
    rows = xp.arange(seqlen_q)
    cols = xp.arange(seqlen_k)
    group = (cols >> 5) * 4 + ((cols >> 1) & 3)
    words = philox4x32_10(xp, group[None, None, None, :], rows[None, None, :, None], bh[:, :, None, None],
                          offset & _MASK32, seed & _MASK32, (seed >> 32) & _MASK32)
    slot = ((cols >> 3) & 3) * 2 + (cols & 1)
    word_index, shift = (slot // 2)[None, None, None, :], (16 * (slot % 2)).astype(np.uint32)[None, None, None, :]
    stacked = xp.stack(words)  # (4, b, h, sq, sk)
    chosen = xp.take_along_axis(stacked, xp.broadcast_to(word_index, stacked.shape[1:])[None], axis=0)[0]
    value = (chosen >> xp.asarray(shift, dtype=xp.uint32)) & 0xFFFF
    return value >= threshold
