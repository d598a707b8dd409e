"""The NumPy adapter: NumPy arrays run the CPU reference (cuflash2.reference) with the kernels'
semantics, dropout masks included (slow; for CPU use and tests)."""

from __future__ import annotations

import numpy as np

from .. import reference
from ..dropout import NO_DROPOUT, DropoutSpec, keep_mask, rescale
from ..materialize import attention_probs_of, gather_pages_of, sequences, varlen_probs_of
from ..problem.features import check_alibi
from ..problem.kvcache import check_cache_rows, validate_kvcache
from ..problem.options import AttentionOptions
from ..problem.tensors import AttentionShape, check_like_input, check_lse, validate_out, validate_qkv
from ..problem.varlen import check_packed_like, check_varlen_lse, validate_paged_varlen, validate_varlen
from .arrays import describe
from .base import Adapter


class NumpyAdapter(Adapter):
    """The entry points on NumPy arrays (every one runs the reference)."""

    name = "numpy"

    def forward(self, q, k, v, alibi_slopes, options: AttentionOptions, out=None):
        return _forward_numpy(q, k, v, options.softmax_scale, options.causal, options.window, options.softcap,
                              alibi_slopes, out, options.dropout)

    def backward(self, dout, q, k, v, out, softmax_lse, alibi_slopes, options: AttentionOptions, dq=None, dk=None,
                 dv=None):
        return _backward_numpy(dout, q, k, v, out, softmax_lse, options.softmax_scale, options.causal,
                               options.window, options.softcap, alibi_slopes, dq, dk, dv, options.dropout)

    def probs(self, q, k, softmax_lse, alibi_slopes, options: AttentionOptions):
        return attention_probs_of(np, q, k, softmax_lse, options.softmax_scale, options.causal, options.window,
                                  options.softcap, alibi_slopes, options.dropout)

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                       options: AttentionOptions, out=None):
        return _varlen_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     options.softmax_scale, options.causal, options.window, options.softcap,
                                     alibi_slopes, out, options.dropout)

    def varlen_backward(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, alibi_slopes, options: AttentionOptions, dq=None, dk=None, dv=None):
        return _varlen_backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, options.softmax_scale, options.causal, options.window,
                                      options.softcap, alibi_slopes, dq, dk, dv, options.dropout)

    def varlen_probs(self, q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     options: AttentionOptions):
        return varlen_probs_of(np, q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               options.softmax_scale, options.causal, options.window, options.softcap, alibi_slopes,
                               options.dropout)

    def paged_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                      alibi_slopes, options: AttentionOptions, out=None):
        return _paged_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    options.softmax_scale, options.causal, options.window, options.softcap,
                                    alibi_slopes, out, block_table)

    def gather_pages(self, cache, block_table, cu_seqlens_k):
        return gather_pages_of(np, cache, np.asarray(block_table), np.asarray(cu_seqlens_k))

    def kvcache(self, arrays: tuple, softmax_scale, causal: bool, window, softcap: float, interleaved: bool,
                num_splits: int, return_softmax_lse: bool, key, host_lengths, checked: bool):
        return _kvcache_numpy(*arrays[:5], arrays[10], arrays[11], *arrays[5:9], softmax_scale, causal, window,
                              softcap, interleaved, arrays[9], return_softmax_lse)


def check_host_dropout(dropout: DropoutSpec) -> None:
    """The NumPy path takes its seed on the host."""
    if dropout.rng_state is not None:
        raise TypeError("dropout_rng_state: expected None for NumPy arrays (pass dropout_seed), got "
                        f"{type(dropout.rng_state).__name__}")


def numpy_dropout_mask(dropout, shape: AttentionShape, xp=np):
    """(keep mask (batch, nheads, seqlen_q, seqlen_k), 1 / (1 - p)) of a dropout call (host seed)."""
    keep = keep_mask(xp, dropout.seed, dropout.offset, shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k,
                     dropout.p)
    return keep, rescale(dropout.p)


def numpy_alibi(alibi_slopes, shape: AttentionShape):
    """Validated host ALiBi slopes for the NumPy path (None when off)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, np.ndarray):
        raise TypeError(f"alibi_slopes: expected a NumPy array like q, got {type(alibi_slopes).__name__}")
    check_alibi(describe("alibi_slopes", alibi_slopes), shape.batch, shape.nheads, "cpu")
    return alibi_slopes


def _sequence_mask(dropout, b: int, nheads: int, seqlen_q: int, seqlen_k: int):
    """(keep mask (1, nheads, seqlen_q, seqlen_k), rescale) of varlen sequence b, or (None, 1.0)."""
    if dropout.p == 0:
        return None, 1.0
    keep = keep_mask(np, dropout.seed, dropout.offset, 1, nheads, seqlen_q, seqlen_k, dropout.p, batch_index=[b])
    return keep, rescale(dropout.p)


def _forward_numpy(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, out,
                   dropout=NO_DROPOUT):
    """CPU path: the NumPy tiled reference (slow; for CPU use and tests)."""
    check_host_dropout(dropout)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
                         check_pointers=False)
    slopes = numpy_alibi(alibi_slopes, shape)
    if shape.seqlen_k == 0 or shape.batch == 0 or shape.seqlen_q == 0:
        result = np.zeros(q.shape, dtype=q.dtype)
        lse = np.full((shape.batch, shape.nheads, shape.seqlen_q), np.inf, dtype=np.float32)
    elif dropout.p > 0:  # the dense reference with the kernels' mask
        keep, rescale = numpy_dropout_mask(dropout, shape)
        o64, lse = reference.attention_naive(q, k, v, softmax_scale=shape.softmax_scale, causal=causal,
                                             window_size=window, softcap=softcap, alibi_slopes=slopes,
                                             dropout_mask=keep, dropout_rescale=rescale)
        result = o64.astype(q.dtype)
    else:
        o32, lse = reference.attention_tiled(q, k, v, softmax_scale=shape.softmax_scale, causal=causal,
                                             window_size=window, softcap=softcap, alibi_slopes=slopes,
                                             p_dtype=q.dtype)
        result = o32.astype(q.dtype)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a NumPy array like q, got {type(out).__name__}")
        validate_out(describe("out", out), shape, check_pointers=False)
        out[...] = result
        result = out
    return result, lse.astype(np.float32)


def _backward_numpy(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv,
                    dropout=NO_DROPOUT):
    """CPU path: the NumPy tiled reference backward (slow; for CPU use and tests)."""
    check_host_dropout(dropout)
    arrays = {"dout": dout, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
                         check_pointers=False)
    check_like_input("dout", describe("dout", dout), describe("q", q))
    check_like_input("out", describe("out", out), describe("q", q))
    check_lse(describe("softmax_lse", softmax_lse), shape)
    if shape.seqlen_k == 0 or shape.seqlen_q == 0 or shape.batch == 0:
        grads = tuple(np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    elif dropout.p > 0:  # the dense reference with the kernels' mask
        keep, rescale = numpy_dropout_mask(dropout, shape)
        grads = reference.attention_backward_naive(dout, q, k, v, out, softmax_lse, softmax_scale=shape.softmax_scale,
                                                   causal=causal, window_size=window, softcap=softcap,
                                                   alibi_slopes=numpy_alibi(alibi_slopes, shape), dropout_mask=keep,
                                                   dropout_rescale=rescale)
        grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    else:
        grads = reference.attention_backward_tiled(dout, q, k, v, out, softmax_lse, softmax_scale=shape.softmax_scale,
                                                   causal=causal, window_size=window, softcap=softcap,
                                                   alibi_slopes=numpy_alibi(alibi_slopes, shape))
        grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    result = []
    for name, given, g in (("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2])):
        if given is None:
            result.append(g)
        else:
            check_like_input(name, describe(name, given), describe(name, g))
            given[...] = g
            result.append(given)
    return tuple(result)


# ---- varlen ---------------------------------------------------------------------------------------

def _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, alibi_slopes,
                   extra=()):
    arrays = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **dict(extra)}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    problem = validate_varlen(describe("q", q), describe("k", k), describe("v", v), softmax_scale,
                        describe("cu_seqlens_q", cu_seqlens_q), cu_seqlens_q, describe("cu_seqlens_k", cu_seqlens_k),
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_pointers=False)
    slopes = numpy_alibi(alibi_slopes, problem.shape)
    if slopes is not None:
        slopes = np.broadcast_to(slopes.reshape(-1, problem.shape.nheads), (problem.shape.batch, problem.shape.nheads))
    return problem, slopes


def _varlen_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, out, dropout=NO_DROPOUT):
    """CPU path: the tiled NumPy reference, one sequence at a time."""
    check_host_dropout(dropout)
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes)
    result = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((problem.shape.nheads, q.shape[0]), np.inf, dtype=np.float32)
    for b, rows_q, rows_k in sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        seq_slopes = None if slopes is None else slopes[b:b + 1]
        if dropout.p > 0:  # the dense reference with the kernels' mask
            keep, rescale = _sequence_mask(dropout, b, problem.shape.nheads, rows_q.stop - rows_q.start,
                                           rows_k.stop - rows_k.start)
            o, l_b = reference.attention_naive(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                               softmax_scale=problem.shape.softmax_scale, causal=causal,
                                               window_size=window, softcap=softcap, alibi_slopes=seq_slopes,
                                               dropout_mask=keep, dropout_rescale=rescale)
        else:
            o, l_b = reference.attention_tiled(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                               softmax_scale=problem.shape.softmax_scale, causal=causal,
                                               window_size=window, softcap=softcap, alibi_slopes=seq_slopes,
                                               p_dtype=q.dtype)
        result[rows_q] = o[0].astype(q.dtype)
        lse[:, rows_q] = l_b[0]
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a NumPy array like q, got {type(out).__name__}")
        check_packed_like("out", describe("out", out), describe("q", q))
        out[...] = result
        result = out
    return result, lse


def _varlen_backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv, dropout=NO_DROPOUT):
    check_host_dropout(dropout)
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes, (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
    for name, x in (("dout", dout), ("out", out)):
        check_packed_like(name, describe(name, x), problem.q)
    check_varlen_lse(describe("softmax_lse", softmax_lse), problem.shape.nheads, q.shape[0])
    grads = [np.zeros(x.shape, dtype=np.float32) for x in (q, k, v)]
    for b, rows_q, rows_k in sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        args = (dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q],
                softmax_lse[None, :, rows_q])
        options = dict(softmax_scale=problem.shape.softmax_scale, causal=causal, window_size=window, softcap=softcap,
                       alibi_slopes=None if slopes is None else slopes[b:b + 1])
        if dropout.p > 0:
            keep, rescale = _sequence_mask(dropout, b, problem.shape.nheads, rows_q.stop - rows_q.start,
                                           rows_k.stop - rows_k.start)
            g = reference.attention_backward_naive(*args, **options, dropout_mask=keep, dropout_rescale=rescale)
        else:
            g = reference.attention_backward_tiled(*args, **options)
        grads[0][rows_q], grads[1][rows_k], grads[2][rows_k] = g[0][0], g[1][0], g[2][0]
    result = []
    for name, given, g, like in (("dq", dq, grads[0], q), ("dk", dk, grads[1], k), ("dv", dv, grads[2], v)):
        g = g.astype(like.dtype)
        if given is None:
            result.append(g)
        else:
            check_packed_like(name, describe(name, given), describe(name, like))
            given[...] = g
            result.append(given)
    return tuple(result)


def _paged_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window, softcap, alibi_slopes, out, block_table):
    """CPU path: the pages gathered into packed K/V, then the varlen NumPy path."""
    arrays = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "block_table": block_table}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    problem = validate_paged_varlen(describe("q", q), describe("k", k), describe("v", v),
                                    describe("block_table", block_table), softmax_scale,
                                    describe("cu_seqlens_q", cu_seqlens_q), cu_seqlens_q,
                                    describe("cu_seqlens_k", cu_seqlens_k), cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    check_pointers=False)
    num_blocks, page_size = k.shape[:2]
    for b, length in enumerate(np.diff(np.asarray(cu_seqlens_k, np.int64))):
        used = block_table[b, :-(-int(length) // page_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bad.any():
            raise ValueError(f"block_table: expected page ids in [0, {num_blocks}) for the pages sequence {b} uses, "
                             f"got {int(used[bad][0])}")
    k_packed, v_packed = (gather_pages_of(np, x, block_table, cu_seqlens_k) for x in (k, v))
    del problem
    return _varlen_forward_numpy(q, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window, softcap, alibi_slopes, out)


# ---- KV cache -------------------------------------------------------------------------------------

def _rotate(x, cos, sin, positions, interleaved):
    """x (rows, heads, d) float32 rotated at integer positions (rows,)."""
    half = cos.shape[1]
    rot = 2 * half
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half], out[..., half:rot] = a * c - b * s, a * s + b * c
    return out


def _kvcache_numpy(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, window, softcap, interleaved, alibi_slopes, return_softmax_lse):
    arrays = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
              "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
              "block_table": block_table}
    for name, x in arrays.items():
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    batch = q.shape[0] if q.ndim == 4 else 0
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full((batch,), int(cache_seqlens), np.int32)
    if cache_seqlens is not None and not isinstance(cache_seqlens, np.ndarray):
        raise TypeError(f"cache_seqlens: expected an int or a NumPy array like q, got {type(cache_seqlens).__name__}")
    d = describe
    cache = validate_kvcache(*(d(n, x) if x is not None else None for n, x in (
        ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad), ("block_table", block_table))), softmax_scale, check_pointers=False)
    shape = cache.shape
    if cache_seqlens is not None:
        check_cache_rows(cache_seqlens, cache.seqlen_new, cache.cache_rows, block_table is not None)
    slopes = numpy_alibi(alibi_slopes, shape)
    seqlens = (np.asarray(cache_seqlens, np.int64) if cache_seqlens is not None
               else np.full((batch,), cache.cache_rows, np.int64))
    leftpad = np.asarray(cache_leftpad, np.int64) if cache_leftpad is not None else np.zeros(batch, np.int64)
    cos = None if rotary_cos is None else np.asarray(rotary_cos, np.float32)
    sin = None if rotary_sin is None else np.asarray(rotary_sin, np.float32)

    def rows_of(b, positions):  # (cache entry or page, row) for logical rows of sequence b
        positions = np.asarray(positions)
        if block_table is not None:
            return block_table[b, positions // cache.page_size], positions % cache.page_size
        entry = cache_batch_idx[b] if cache_batch_idx is not None else b
        return np.full(positions.shape, entry), positions

    out = np.zeros(q.shape, q.dtype)
    lse = np.full((batch, cache.nheads, cache.seqlen_q), np.inf, np.float32)
    for b in range(batch):
        start, pad = int(seqlens[b]), int(leftpad[b])
        if k is not None:
            new_rows = np.arange(start, start + cache.seqlen_new)
            kn = np.asarray(k[b], np.float32)
            if cos is not None:
                kn = _rotate(kn, cos, sin, new_rows, interleaved)  # absolute rows, left pad included
            entries, rows = rows_of(b, new_rows)
            k_cache[entries, rows] = kn.astype(k_cache.dtype)
            v_cache[entries, rows] = v[b]
        end = start + cache.seqlen_new
        entries, rows = rows_of(b, np.arange(pad, end))
        kb, vb = k_cache[entries, rows][None], v_cache[entries, rows][None]
        qb = np.asarray(q[b], np.float32)
        if cos is not None:
            per_row = causal or window != (-1, -1)
            positions = start + (np.arange(cache.seqlen_q) if per_row else np.zeros(cache.seqlen_q, np.int64))
            qb = _rotate(qb, cos, sin, positions, interleaved).astype(q.dtype).astype(np.float32)
        if kb.shape[1] == 0:
            continue
        o, l_b = reference.attention_tiled(qb[None].astype(q.dtype), kb, vb, softmax_scale=shape.softmax_scale,
                                           causal=causal, window_size=window, softcap=softcap,
                                           alibi_slopes=None if slopes is None else
                                           np.broadcast_to(slopes.reshape(-1, cache.nheads), (batch, cache.nheads))[b:b + 1],
                                           p_dtype=q.dtype)
        out[b] = o[0].astype(q.dtype)
        lse[b] = l_b[0]
    return (out, lse) if return_softmax_lse else out
