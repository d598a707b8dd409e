"""Backward pass: (dq, dk, dv) from dout and the forward's out and softmax_lse.

GPU flow: D = rowsum(dout * out) -> main kernel(s) (dK, dV, and dQ through fp32 atomics) ->
conversion of the fp32 accumulators (dQ scaled; dK/dV summed over GQA groups). deterministic=True
replaces the dQ atomics by a kernel that owns each query block, so results are bit-identical.
"""

from __future__ import annotations

import math

import numpy as np

from . import interop, reference
from .api import LOG2_E, _SHORT_DTYPE, _check_grid
from .config import backward_plan
from .validate import AttentionShape, check_compute_capability, check_unsupported_options, validate_qkv

_THREADS_ELEMENTWISE = 256


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients of flash_attn_func: returns (dq, dk, dv) shaped like q, k, v.

    dout, out: (batch, seqlen_q, nheads, headdim) like q; softmax_lse: fp32 (batch, nheads, seqlen_q)
    as returned by flash_attn_forward. dq/dk/dv may be given to receive the results.
    """
    check_unsupported_options(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    if interop.framework_of(q) == "numpy":
        return _backward_numpy(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dq, dk, dv)
    with interop.gpu_call(q) as call:
        qc, kc, vc, doc, oc = (call.to_cupy(n, x) for n, x in
                               (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)))
        shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", qc), ("k", kc), ("v", vc))), softmax_scale)
        _check_grid(shape)
        _check_like("dout", interop.describe("dout", doc), interop.describe("q", qc))
        _check_like("out", interop.describe("out", oc), interop.describe("q", qc))
        lse_c = call.to_cupy("softmax_lse", softmax_lse)
        _check_lse(lse_c.shape, np.dtype(lse_c.dtype).name, shape)
        grads = []
        for name, given, like in (("dq", dq, qc), ("dk", dk, kc), ("dv", dv, vc)):
            grads.append(_prepare_grad(call, name, given, like))
        _backward_cupy(doc, qc, kc, vc, oc, lse_c, *grads, shape, causal, deterministic, call.device_id)
        return tuple(given if given is not None else call.from_cupy(g)
                     for given, g in zip((dq, dk, dv), grads))


def _check_like(name, info, q_info) -> None:
    if info.shape != q_info.shape:
        raise ValueError(f"{name}: expected shape {q_info.shape} (same as q), got {info.shape}")
    if info.dtype != q_info.dtype:
        raise TypeError(f"{name}: expected dtype {q_info.dtype} (same as q), got {info.dtype}")


def _check_lse(lse_shape, lse_dtype: str, shape: AttentionShape) -> None:
    expected = (shape.batch, shape.nheads, shape.seqlen_q)
    if tuple(lse_shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected}, got {tuple(lse_shape)}")
    if lse_dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {lse_dtype}")


def _prepare_grad(call, name, given, like):
    cp = interop.import_cupy()
    if given is None:
        return cp.empty(like.shape, dtype=like.dtype)
    grad = call.to_cupy(name, given) if call.framework != "cupy" else given
    _check_like(name, interop.describe(name, grad), interop.describe(name, like))
    return grad


def _strides(x):
    return [np.int64(s // x.dtype.itemsize) for s in x.strides[:3]]


def _backward_cupy(dout, q, k, v, out, lse, dq, dk, dv, shape: AttentionShape, causal: bool, deterministic: bool,
                   device_id: int, split=None) -> None:
    """Launch the backward kernels on CuPy arrays (current stream), writing dq, dk, dv.

    `split` overrides the plan's choice of one or two main launches (benchmarks and tuning only)."""
    cp = interop.import_cupy()
    from .compiler import get_kernel

    b, sq, sk, h, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.head_dim
    if sk == 0:
        for g in (dq, dk, dv):
            g.view(cp.uint16).fill(0)
        return
    cc = cp.cuda.Device(device_id).compute_capability
    arch = check_compute_capability(int(cc[:-1]), int(cc[-1]))
    gqa = shape.kv_group > 1
    plan = backward_plan(d, _SHORT_DTYPE[shape.dtype], causal, arch, deterministic, gqa, split)
    i32, f32 = np.int32, np.float32
    scale = shape.softmax_scale

    delta = cp.empty((b, h, sq), dtype=np.float32)
    rows_threads = h * sq * 8
    get_kernel(plan.dot, device_id)((math.ceil(rows_threads / _THREADS_ELEMENTWISE), b), (_THREADS_ELEMENTWISE,),
                                    (dout, out, delta, *_strides(dout), *_strides(out), i32(sq), i32(h), i32(d)))

    dq_accum = None if deterministic else cp.zeros((b, sq, h, d), dtype=np.float32)
    if gqa:
        dk_target = cp.empty((b, sk, h, d), dtype=np.float32)
        dv_target = cp.empty((b, sk, h, d), dtype=np.float32)
        dk_strides = dv_strides = [np.int64(0)] * 3  # contiguous fp32 layout known to the kernel
    else:
        dk_target, dv_target, dk_strides, dv_strides = dk, dv, _strides(dk), _strides(dv)
    for config in plan.main:
        grid = (math.ceil(sk / config.block_n), h, b)
        get_kernel(config, device_id)(
            grid, (config.threads,),
            (q, k, v, dout, lse, delta, dq_accum if dq_accum is not None else delta, dk_target, dv_target,
             *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *dk_strides, *dv_strides,
             i32(sq), i32(sk), i32(d), i32(shape.kv_group), f32(scale * LOG2_E), f32(scale)),
            shared_mem=config.smem_bytes)

    if deterministic:
        config = plan.dq
        get_kernel(config, device_id)(
            (math.ceil(sq / config.block_m), h, b), (config.threads,),
            (q, k, v, dout, lse, delta, dq, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
             *_strides(dq), i32(sq), i32(sk), i32(d), i32(shape.kv_group), f32(scale * LOG2_E), f32(scale)),
            shared_mem=config.smem_bytes)
    else:
        _convert(get_kernel(plan.convert, device_id), dq_accum, dq, sq, h, d, 1, scale)
    if gqa:
        convert = get_kernel(plan.convert, device_id)
        _convert(convert, dk_target, dk, sk, shape.nheads_kv, d, shape.kv_group, 1.0)
        _convert(convert, dv_target, dv, sk, shape.nheads_kv, d, shape.kv_group, 1.0)


def _convert(kernel, acc, out, seqlen: int, nheads: int, head_dim: int, group: int, scale: float) -> None:
    batch = out.shape[0]
    work = seqlen * nheads * (head_dim // 2)
    kernel((math.ceil(work / _THREADS_ELEMENTWISE), batch), (_THREADS_ELEMENTWISE,),
           (acc, out, *_strides(out), np.int32(seqlen), np.int32(nheads), np.int32(head_dim), np.int32(group),
            np.float32(scale)))


def _backward_numpy(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dq, dk, dv):
    """CPU path: the NumPy tiled reference backward (slow; for CPU use and tests)."""
    arrays = {"dout": dout, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
                         check_pointers=False)
    _check_like("dout", interop.describe("dout", dout), interop.describe("q", q))
    _check_like("out", interop.describe("out", out), interop.describe("q", q))
    _check_lse(softmax_lse.shape, softmax_lse.dtype.name, shape)
    if shape.seqlen_k == 0:
        grads = tuple(np.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    else:
        grads = reference.attention_backward_tiled(dout, q, k, v, out, softmax_lse, softmax_scale=shape.softmax_scale,
                                                   causal=causal)
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
