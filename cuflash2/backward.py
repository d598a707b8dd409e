"""Backward pass: (dq, dk, dv) from dout and the forward's out and softmax_lse.

GPU flow (cuflash2.launch.backward): D = rowsum(dout * out) -> main kernel(s) for dK and dV ->
a dQ kernel that owns each query block (no atomics: deterministic, and as fast on the H200 as
accumulating dQ in the main kernel with bulk fp32 reductions, the planner's alternative on sm_90)
-> conversion of fp32 accumulators (dK/dV summed over GQA groups).
"""

from __future__ import annotations

import numpy as np

from . import call_plans, interop, launch, reference
from .api import (_check_grid, _fill, check_host_dropout, gpu_features, numpy_alibi, numpy_dropout_mask,
                  resolve_dropout)
from .dropout import NO_DROPOUT
from .features import check_softcap, check_window
from .validate import AttentionShape, check_alignment, validate_qkv
from .validate import check_bool


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, *,
                        dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Gradients of flash_attn_func: returns (dq, dk, dv) shaped like q, k, v.

    dout, out: (batch, seqlen_q, nheads, headdim) like q; softmax_lse: fp32 (batch, nheads, seqlen_q)
    as returned by flash_attn_forward. dq/dk/dv may be given to receive the results. Dropout takes
    the forward's dropout_p and dropout_seed/dropout_offset or dropout_rng_state (the mask is
    regenerated).
    """
    key = backward_plan_key(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, deterministic, dropout_p)
    outputs_given = dq is not None or dk is not None or dv is not None
    result = None if outputs_given else call_plans.replay(key, (dout, q, k, v, out, softmax_lse))
    if result is not None:  # a call signature seen before (cuflash2.call_plans)
        return result
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    if interop.framework_of(q) == "numpy":
        return _backward_numpy(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window, softcap, alibi_slopes,
                               dq, dk, dv, dropout)
    with interop.gpu_call(q) as call:
        q_i, k_i, v_i = (call.tensor(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
        shape = validate_qkv(q_i, k_i, v_i, softmax_scale)
        _check_grid(shape)
        features = gpu_features(call, shape, q_i.device, window, softcap, alibi_slopes, dropout)
        do_i, out_i, lse_i = (call.tensor(n, x) for n, x in (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
        _check_like("dout", do_i, q_i)
        _check_like("out", out_i, q_i)
        _check_lse(lse_i, shape)
        for name, info in (("dout", do_i), ("out", out_i)):
            check_alignment(name, info)
        arrays, infos = gradient_outputs(call, (("dq", dq, q, q_i), ("dk", dk, k, k_i), ("dv", dv, v, v_i)),
                                         _check_like)
        if shape.seqlen_k == 0 or shape.seqlen_q == 0 or shape.batch == 0:  # no query sees a key: zero gradients
            for info in infos:
                _fill(call, info, 0)
        else:
            launch.backward(do_i, q_i, k_i, v_i, out_i, lse_i, *infos, shape, causal, deterministic, call.device_id,
                            call.stream, features=features)
            call_plans.register_backward(key, (dout, q, k, v, out, softmax_lse), (do_i, q_i, k_i, v_i, out_i, lse_i),
                                         tuple(infos), shape, causal, deterministic, features, call.device_id)
        return tuple(call.result(a) for a in arrays)


def backward_plan_key(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, dropout_p):
    """The call_plans key of a backward call as given (None when it cannot take a plan)."""
    if alibi_slopes is not None or type(dropout_p) not in (int, float) or dropout_p != 0:
        return None
    return call_plans.backward_key(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size, softcap,
                                   deterministic)


def gradient_outputs(call, requests, check_like):
    """(arrays, infos) of dq, dk, dv: for each (name, given, like, like_info), the caller's buffer
    (checked with check_like and for alignment) or a new array shaped like the input."""
    arrays, infos = [], []
    for name, given, like, like_i in requests:
        if given is None:
            array, info = call.empty(like_i.shape, like_i.dtype, like=like)
        else:
            array, info = given, call.output(name, given)
            check_like(name, info, like_i)
            check_alignment(name, info)
        arrays.append(array)
        infos.append(info)
    return arrays, infos


def _check_like(name, info, q_info) -> None:
    if info.shape != q_info.shape:
        raise ValueError(f"{name}: expected shape {q_info.shape} (same as {_like_name(name)}), got {info.shape}")
    if info.dtype != q_info.dtype:
        raise TypeError(f"{name}: expected dtype {q_info.dtype} (same as {_like_name(name)}), got {info.dtype}")


def _like_name(name: str) -> str:
    return {"dk": "k", "dv": "v"}.get(name, "q")


def _check_lse(info, shape: AttentionShape) -> None:
    expected = (shape.batch, shape.nheads, shape.seqlen_q)
    if tuple(info.shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected}, got {tuple(info.shape)}")
    if info.dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {info.dtype}")
    if all(info.shape) and info.strides != (shape.nheads * shape.seqlen_q, shape.seqlen_q, 1):
        raise ValueError(f"softmax_lse: expected a contiguous array, got strides {info.strides}")


def _backward_numpy(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv,
                    dropout=NO_DROPOUT):
    """CPU path: the NumPy tiled reference backward (slow; for CPU use and tests)."""
    check_host_dropout(dropout)
    arrays = {"dout": dout, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
                         check_pointers=False)
    _check_like("dout", interop.describe("dout", dout), interop.describe("q", q))
    _check_like("out", interop.describe("out", out), interop.describe("q", q))
    _check_lse(interop.describe("softmax_lse", softmax_lse), shape)
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
            _check_like(name, interop.describe(name, given), interop.describe(name, g))
            given[...] = g
            result.append(given)
    return tuple(result)
