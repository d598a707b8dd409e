"""What the kernels never store, materialised with NumPy or CuPy (`xp`) for tests and debugging:
attention probabilities rebuilt from the LSE (dropped entries negated, FA2's convention), the keys
of a paged cache gathered into packed rows, float32 copies of 16-bit arrays."""

from __future__ import annotations

import math

import numpy as np

from .dropout import NO_DROPOUT, DropoutSpec, keep_mask


def attention_probs_of(xp, q, k, lse, softmax_scale, causal, window=(-1, -1), softcap=0.0, slopes=None,
                       dropout: DropoutSpec = NO_DROPOUT):
    """The probabilities of a dense call as fp32 (batch, nheads, seqlen_q, seqlen_k)."""
    return mark_dropped(xp, probs_from_lse(xp, q, k, lse, softmax_scale, causal, window, softcap, slopes), dropout)


def mark_dropped(xp, probs, dropout: DropoutSpec):
    if dropout.p == 0:
        return probs
    b, h, sq, sk = probs.shape
    keep = keep_mask(xp, dropout.seed, dropout.offset, b, h, sq, sk, dropout.p)
    return xp.where(keep, probs, -probs)


def probs_from_lse(xp, q, k, lse, softmax_scale, causal, window=(-1, -1), softcap=0.0, slopes=None):
    """softmax of the masked, softcapped, ALiBi-biased logits rebuilt from the LSE, fp32
    (batch, nheads, seqlen_q, seqlen_k)."""
    head_dim, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kf = xp.repeat(as_float32(xp, k), q.shape[2] // k.shape[2], axis=2)
    logits = xp.einsum("bqhd,bkhd->bhqk", as_float32(xp, q), kf) * scale
    if softcap > 0:
        logits = softcap * xp.tanh(logits / softcap)
    distance = xp.arange(sk)[None, :] - (xp.arange(sq)[:, None] + (sk - sq))  # j - (i + shift)
    if slopes is not None:
        slopes = xp.broadcast_to(xp.asarray(slopes, dtype=xp.float32).reshape(-1, q.shape[2]), (q.shape[0], q.shape[2]))
        logits = logits - slopes[:, :, None, None] * xp.abs(distance).astype(xp.float32)
    left, right = window
    right = 0 if causal else right
    visible = xp.ones((sq, sk), dtype=bool)
    if right >= 0:
        visible &= distance <= right
    if left >= 0:
        visible &= distance >= -left
    logits = xp.where(visible, logits, -xp.inf)
    return xp.exp(logits - lse[..., None]).astype(xp.float32)


def sequences(cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def varlen_probs_of(xp, q, k, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap,
                  slopes, dropout=NO_DROPOUT):
    batch, nheads = len(cu_q) - 1, q.shape[1]
    probs = xp.zeros((batch, nheads, max_seqlen_q, max_seqlen_k), dtype=xp.float32)
    if softmax_scale is None:
        softmax_scale = 1.0 / float(np.sqrt(q.shape[-1]))
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        sq, sk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        if sq == 0 or sk == 0:
            continue
        slopes_b = None
        if slopes is not None:
            slopes_b = xp.broadcast_to(xp.asarray(slopes).reshape(-1, nheads), (batch, nheads))[b:b + 1]
        seq_probs = probs_from_lse(xp, q[None, rows_q], k[None, rows_k], lse[None, :, rows_q], softmax_scale, causal, window,
                           softcap, slopes_b)
        if dropout.p > 0:
            keep = keep_mask(xp, dropout.seed, dropout.offset, 1, nheads, sq, sk, dropout.p,
                                         batch_index=[b])
            seq_probs = xp.where(keep, seq_probs, -seq_probs)
        probs[b, :, :sq, :sk] = seq_probs[0]
    return probs


def gather_pages_of(xp, cache, table, cu_k):
    page_size = cache.shape[1]
    pages, rows = [], []
    for b in range(len(cu_k) - 1):
        j = np.arange(int(cu_k[b + 1]) - int(cu_k[b]))
        pages.append(j // page_size + b * table.shape[1])
        rows.append(j % page_size)
    flat = xp.asarray(np.concatenate(pages + [np.zeros(0, np.int64)]))
    page_ids = table.reshape(-1)[flat] if flat.size else xp.zeros(0, dtype=xp.int32)
    return cache[page_ids, xp.asarray(np.concatenate(rows + [np.zeros(0, np.int64)]))]


def as_float32(xp, x):
    """float32 copy of a float16/bfloat16/float32 array (bf16 widened bit-exactly, no dtype support needed)."""
    if np.dtype(x.dtype).name == "bfloat16":
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)
