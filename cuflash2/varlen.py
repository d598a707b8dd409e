"""Variable-length (packed) batches, FlashAttention-2's varlen API.

Sequences are packed along the first axis: q is (total_q, nheads, headdim), k and v are
(total_k, nheads_kv, headdim), and sequence b occupies rows cu_seqlens[b] : cu_seqlens[b + 1]
(int32, batch + 1 entries, starting at 0). softmax_lse is (nheads, total_q). Masks, softcap and
ALiBi apply per sequence, with each sequence's own seqlen_q and seqlen_k.

cu_seqlens are checked on the host (dtype, shape, first entry 0, non-decreasing, within the packed
tensors, no sequence longer than max_seqlen), which costs one small device-to-host copy per call.
Rows past the last sequence get out = 0, softmax_lse = +inf and zero gradients.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import interop, launch, reference
from . import dropout as dropout_rng
from .backward import gradient_outputs
from .api import _check_grid, _fill, _probs, gpu_features, numpy_alibi, resolve_dropout
from .features import (
    as_batched,
    check_cu_seqlens,
    check_max_seqlen,
    check_packed_dims,
    check_softcap,
    check_window,
    varlen_shape,
)
from .validate import AttentionShape, TensorInfo, check_alignment, validate_qkv
from .validate import check_bool


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, out=None, dropout_seed=None):
    """Attention over packed variable-length sequences; options as flash_attn_func.

    Returns out (total_q, nheads, headdim), or (out, softmax_lse, attn_probs) when return_attn_probs:
    softmax_lse fp32 (nheads, total_q); attn_probs fp32 (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero outside each sequence (testing only).
    """
    dropout = resolve_dropout(dropout_p, dropout_seed, 0, draw_seed=True)
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    window, softcap = check_window(window_size), check_softcap(softcap)
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    framework = interop.framework_of(q)
    if framework == "torch":
        from . import torch_ops

        out, lse = torch_ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window, softcap, alibi_slopes, deterministic, out,
                                            dropout)
    elif framework == "jax":  # differentiable, jit-able; cu_seqlens values are checked only outside jit
        from . import jax_ops

        jax_ops.check_call(out, return_attn_probs, dropout_p, dropout_seed, q, k, v, cu_seqlens_q, cu_seqlens_k,
                           alibi_slopes)
        out, lse = jax_ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                                          dropout)
    else:
        out, lse = flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window, softcap, alibi_slopes, out=out,
                                             dropout_p=dropout[0], dropout_seed=dropout[1])
    if not return_attn_probs:
        return out
    return out, lse, varlen_attention_probs(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window, softcap, alibi_slopes,
                                            dropout_p=dropout[0], dropout_seed=dropout[1])


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None,
                                    dropout_seed=None):
    """As flash_attn_varlen_func with kv of shape (total_k, 2, nheads_kv, headdim)."""
    _check_packed("kv", kv, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, out=out, dropout_seed=dropout_seed)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, out=None, dropout_seed=None):
    """As flash_attn_varlen_func with qkv of shape (total, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, out=out, dropout_seed=dropout_seed)


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or shape[1] != parts:
        raise ValueError(f"{name}: expected shape (total, {parts}, nheads, headdim), got {shape}")


# ---- validation ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _VarlenCall:
    shape: AttentionShape  # batch = number of sequences, seqlens = the maxima
    q: TensorInfo  # packed (total, nheads, dim) descriptions
    k: TensorInfo
    v: TensorInfo
    covers_all_rows: bool  # cu_seqlens_q[-1] == total_q and cu_seqlens_k[-1] == total_k


def _as_one_batch(info: TensorInfo) -> TensorInfo:
    return dataclasses.replace(info, shape=(1, *info.shape), strides=(0, *info.strides))


def _validate(q, k, v, softmax_scale, cu_q: TensorInfo, cu_q_values, cu_k: TensorInfo, cu_k_values, max_seqlen_q,
              max_seqlen_k, check_pointers: bool) -> _VarlenCall:
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_packed_dims(name, info)
    one = validate_qkv(_as_one_batch(q), _as_one_batch(k), _as_one_batch(v), softmax_scale,
                       check_pointers=check_pointers)
    total_q, total_k = q.shape[0], k.shape[0]
    batch = check_cu_seqlens("cu_seqlens_q", cu_q, cu_q_values, total_q, max_seqlen_q, None, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_k, cu_k_values, total_k, max_seqlen_k, batch, q.device)
    shape = varlen_shape(q, k, batch, max_seqlen_q, max_seqlen_k, one.softmax_scale)
    _check_grid(shape)
    covers = int(cu_q_values[-1]) == total_q and int(cu_k_values[-1]) == total_k
    return _VarlenCall(shape, q, k, v, covers)


def _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window,
                softcap, alibi_slopes, dropout):
    infos = [call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    cu = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if interop.framework_of(x, name) == "numpy":
            raise TypeError(f"{name}: expected a GPU array like q, got a NumPy array")
        cu.append((call.tensor(name, x), call.to_cupy(name, x).get()))  # host copy for the checks
    problem = _validate(*infos, softmax_scale, *cu[0], *cu[1], max_seqlen_q, max_seqlen_k, check_pointers=True)
    base = gpu_features(call, problem.shape, infos[0].device, window, softcap, alibi_slopes, dropout)
    features = dataclasses.replace(base, cu_seqlens_q=cu[0][0], cu_seqlens_k=cu[1][0], total_q=q.shape[0],
                                   total_k=k.shape[0])
    return problem, features


# ---- forward ------------------------------------------------------------------------------------

def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                              causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, out=None, *,
                              dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """Varlen forward returning (out, softmax_lse (nheads, total_q)). Dropout as flash_attn_forward
    (sequence b of the batch draws its mask as batch entry b)."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False)
    if interop.framework_of(q) == "numpy":
        return _forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window, softcap, alibi_slopes, out, dropout)
    with interop.gpu_call(q) as call:
        problem, features = _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window, softcap, alibi_slopes, dropout)
        shape = problem.shape
        if out is None:
            out, out_info = call.empty(problem.q.shape, shape.dtype, like=q)
        else:
            out_info = call.output("out", out)
            _check_like("out", out_info, problem.q)
            check_alignment("out", out_info)
        lse, lse_info = call.empty((shape.nheads, problem.q.shape[0]), "float32")
        if not problem.covers_all_rows:
            _fill(call, out_info, 0)
            _fill(call, lse_info, np.inf)
        if shape.seqlen_q > 0:
            launch.forward(*(as_batched(i, shape.batch, m) for i, m in ((problem.q, shape.seqlen_q),
                                                                         (problem.k, shape.seqlen_k),
                                                                         (problem.v, shape.seqlen_k))),
                           as_batched(out_info, shape.batch, shape.seqlen_q), lse_info, shape, causal,
                           call.device_id, call.stream, features=features)
        return call.result(out), call.result(lse)


def _check_like(name: str, info: TensorInfo, like: TensorInfo) -> None:
    if info.shape != like.shape:
        raise ValueError(f"{name}: expected shape {like.shape}, got {info.shape}")
    if info.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype}, got {info.dtype}")
    if info.strides[-1] != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got stride {info.strides[-1]}")


def _sequences(cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, alibi_slopes,
                   extra=()):
    arrays = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **dict(extra)}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    describe = interop.describe
    problem = _validate(describe("q", q), describe("k", k), describe("v", v), softmax_scale,
                        describe("cu_seqlens_q", cu_seqlens_q), cu_seqlens_q, describe("cu_seqlens_k", cu_seqlens_k),
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_pointers=False)
    slopes = numpy_alibi(alibi_slopes, problem.shape)
    if slopes is not None:
        slopes = np.broadcast_to(slopes.reshape(-1, problem.shape.nheads), (problem.shape.batch, problem.shape.nheads))
    return problem, slopes


def _sequence_mask(dropout, b: int, nheads: int, seqlen_q: int, seqlen_k: int):
    """(keep mask (1, nheads, seqlen_q, seqlen_k), rescale) of varlen sequence b, or (None, 1.0)."""
    if dropout[0] == 0:
        return None, 1.0
    keep = dropout_rng.keep_mask(np, dropout[1], dropout[2], 1, nheads, seqlen_q, seqlen_k, dropout[0],
                                 batch_index=[b])
    return keep, 1.0 / (1.0 - dropout_rng.effective_dropout(dropout[0]))


def _forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, out, dropout=(0.0, 0, 0)):
    """CPU path: the tiled NumPy reference, one sequence at a time."""
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes)
    result = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((problem.shape.nheads, q.shape[0]), np.inf, dtype=np.float32)
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        seq_slopes = None if slopes is None else slopes[b:b + 1]
        if dropout[0] > 0:  # the dense reference with the kernels' mask
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
        _check_like("out", interop.describe("out", out), interop.describe("q", q))
        out[...] = result
        result = out
    return result, lse


def varlen_attention_probs(q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """Attention probabilities of a varlen call as fp32 (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero-padded (testing only); entries dropped by dropout are negated."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False)
    if interop.framework_of(q) == "numpy":
        return _varlen_probs(np, q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window, softcap, alibi_slopes, dropout)
    with interop.gpu_call(q) as call:
        arrays = [call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse))]
        cu_q, cu_k = (call.to_cupy(n, x).get() for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                                             ("cu_seqlens_k", cu_seqlens_k)))
        slopes = None if alibi_slopes is None else call.to_cupy("alibi_slopes", alibi_slopes)
        return call.result(_varlen_probs(interop.import_cupy(), *arrays, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, window, softcap, slopes, dropout))


def _varlen_probs(xp, q, k, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap,
                  slopes, dropout=(0.0, 0, 0)):
    batch, nheads = len(cu_q) - 1, q.shape[1]
    probs = xp.zeros((batch, nheads, max_seqlen_q, max_seqlen_k), dtype=xp.float32)
    if softmax_scale is None:
        softmax_scale = 1.0 / float(np.sqrt(q.shape[-1]))
    for b, rows_q, rows_k in _sequences(cu_q, cu_k):
        sq, sk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        if sq == 0 or sk == 0:
            continue
        slopes_b = None
        if slopes is not None:
            slopes_b = xp.broadcast_to(xp.asarray(slopes).reshape(-1, nheads), (batch, nheads))[b:b + 1]
        seq_probs = _probs(xp, q[None, rows_q], k[None, rows_k], lse[None, :, rows_q], softmax_scale, causal, window,
                           softcap, slopes_b)
        if dropout[0] > 0:
            keep = dropout_rng.keep_mask(xp, dropout[1], dropout[2], 1, nheads, sq, sk, dropout[0], batch_index=[b])
            seq_probs = xp.where(keep, seq_probs, -seq_probs)
        probs[b, :, :sq, :sk] = seq_probs[0]
    return probs


# ---- backward -----------------------------------------------------------------------------------

def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, *, dropout_p=0.0,
                               dropout_seed=None, dropout_offset=0):
    """Gradients of flash_attn_varlen_func: (dq, dk, dv) shaped like the packed q, k, v."""
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False)
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    if interop.framework_of(q) == "numpy":
        return _backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv, dropout)
    with interop.gpu_call(q) as call:
        problem, features = _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window, softcap, alibi_slopes, dropout)
        shape = problem.shape
        do_i, out_i, lse_i = (call.tensor(n, x) for n, x in (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
        for name, info in (("dout", do_i), ("out", out_i)):
            _check_like(name, info, problem.q)
            check_alignment(name, info)
        _check_lse(lse_i, shape.nheads, problem.q.shape[0])
        arrays, infos = gradient_outputs(call, (("dq", dq, q, problem.q), ("dk", dk, k, problem.k),
                                                ("dv", dv, v, problem.v)), _check_like)
        if not problem.covers_all_rows or shape.seqlen_q == 0 or shape.seqlen_k == 0:
            for info in infos:
                _fill(call, info, 0)
        if shape.seqlen_q > 0 and shape.seqlen_k > 0:
            b = shape.batch
            batched = [as_batched(i, b, m) for i, m in ((do_i, shape.seqlen_q), (problem.q, shape.seqlen_q),
                                                        (problem.k, shape.seqlen_k), (problem.v, shape.seqlen_k),
                                                        (out_i, shape.seqlen_q))]
            grads = [as_batched(i, b, m) for i, m in zip(infos, (shape.seqlen_q, shape.seqlen_k, shape.seqlen_k))]
            launch.backward(*batched, lse_i, *grads, shape, causal, deterministic, call.device_id, call.stream,
                            features=features)
        return tuple(call.result(a) for a in arrays)


def _check_lse(info: TensorInfo, nheads: int, total_q: int) -> None:
    expected = (nheads, total_q)
    if tuple(info.shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected} (nheads, total_q), got {tuple(info.shape)}")
    if info.dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {info.dtype}")
    if info.strides != (total_q, 1):
        raise ValueError(f"softmax_lse: expected a contiguous array, got strides {info.strides}")


def _backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv, dropout=(0.0, 0, 0)):
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes, (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
    for name, x in (("dout", dout), ("out", out)):
        _check_like(name, interop.describe(name, x), problem.q)
    _check_lse(interop.describe("softmax_lse", softmax_lse), problem.shape.nheads, q.shape[0])
    grads = [np.zeros(x.shape, dtype=np.float32) for x in (q, k, v)]
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        args = (dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q],
                softmax_lse[None, :, rows_q])
        options = dict(softmax_scale=problem.shape.softmax_scale, causal=causal, window_size=window, softcap=softcap,
                       alibi_slopes=None if slopes is None else slopes[b:b + 1])
        if dropout[0] > 0:
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
            _check_like(name, interop.describe(name, given), interop.describe(name, like))
            given[...] = g
            result.append(given)
    return tuple(result)


__all__ = [
    "flash_attn_varlen_backward",
    "flash_attn_varlen_forward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "varlen_attention_probs",
]
