"""Attention dropout: the keep mask the kernels draw, reproduced with NumPy or CuPy (`xp`).

The kernels draw one Philox4x32-10 block (16 random bytes) per query row and 16 consecutive keys:
counter = (key // 16, row, batch * nheads + head, offset), key = (seed low 32 bits, seed high 32
bits); entry (row, key) is dropped iff byte key % 16 is below threshold = round(256 p). The drop
probability is therefore quantised to multiples of 1/256 (`effective_dropout`), and kept entries
are scaled by 1 / (1 - effective p), so the expectation of the output is exact.
"""

from __future__ import annotations

import math

import numpy as np

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_seed_source = np.random.default_rng()


def check_dropout(dropout_p) -> float:
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}") from None
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout_p: expected 0 <= dropout_p < 1, got {p}")
    return p


def dropout_threshold(p: float) -> int:
    """Bytes below this are dropped (0: no dropout). At least 1 for any p > 0, at most 255."""
    if p <= 0.0:
        return 0
    return min(255, max(1, round(p * 256)))


def effective_dropout(p: float) -> float:
    """The drop probability the kernels apply for a requested p (a multiple of 1/256)."""
    return dropout_threshold(p) / 256.0


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
    words = philox4x32_10(xp, (cols // 16)[None, None, None, :], rows[None, None, :, None], bh[:, :, None, None],
                          offset & _MASK32, seed & _MASK32, (seed >> 32) & _MASK32)
    byte = cols % 16
    word_index, shift = (byte // 4)[None, None, None, :], (8 * (byte % 4)).astype(np.uint32)[None, None, None, :]
    stacked = xp.stack(words)  # (4, b, h, sq, sk)
    chosen = xp.take_along_axis(stacked, xp.broadcast_to(word_index, stacked.shape[1:])[None], axis=0)[0]
    value = (chosen >> xp.asarray(shift, dtype=xp.uint32)) & 0xFF
    return value >= threshold
