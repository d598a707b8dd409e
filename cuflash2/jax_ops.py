"""JAX integration: a differentiable attention function usable under jax.jit and jax.grad.

The kernels run inside `jax.experimental.buffer_callback` (experimental JAX API): XLA hands the
callback its device buffers and its compute stream, and cuflash2 launches on that stream, writing
the outputs in place. `jax.custom_vjp` pairs the forward with cuflash2's backward. Imported only
when a JAX array is passed in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import interop, launch
from .features import Features, check_alibi
from .validate import AttentionShape, TensorInfo, validate_qkv


def _contiguous_info(shape, dtype, ptr: int = 0) -> TensorInfo:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    dtype = np.dtype(dtype)
    return TensorInfo(tuple(shape), tuple(reversed(strides)), dtype.name, "cuda", ptr, dtype.itemsize)


def _buffer_info(buffer, shape, dtype) -> TensorInfo:
    interface = buffer.__cuda_array_interface__
    if interface.get("strides") is not None:
        raise ValueError("cuflash2 expects dense row-major XLA buffers")
    return _contiguous_info(shape, dtype, interface["data"][0])


def _layouts(shape: AttentionShape):
    """Shapes of (q, k, v, lse) for an attention problem."""
    q = (shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim)
    kv = (shape.batch, shape.seqlen_k, shape.nheads_kv, shape.head_dim)
    return q, kv, kv, (shape.batch, shape.nheads, shape.seqlen_q)


def _element_type(shape: AttentionShape):
    return jnp.bfloat16 if shape.dtype == "bfloat16" else np.float16


def _device_and_stream(ctx, ptr: int):
    cp = interop.import_cupy()
    device_id = cp.cuda.runtime.pointerGetAttributes(ptr).device
    return device_id, interop.external_stream(cp, ctx.stream, device_id)


def _features(options, alibi) -> Features:
    """Features of a call; `alibi` is the slopes' XLA buffer (a zero-size dummy when off)."""
    window, softcap, alibi_shape = options
    info = None if alibi_shape is None else _buffer_info(alibi, alibi_shape, np.float32)
    return Features(window[0], window[1], softcap, info)


def _forward_callback(ctx, outputs, q, k, v, alibi, *, shape: AttentionShape, causal: bool, options):
    out, lse = outputs
    q_shape, k_shape, v_shape, lse_shape = _layouts(shape)
    dtype = _element_type(shape)
    infos = [_buffer_info(b, s, dtype) for b, s in ((q, q_shape), (k, k_shape), (v, v_shape), (out, q_shape))]
    lse_info = _buffer_info(lse, lse_shape, np.float32)
    device_id, stream = _device_and_stream(ctx, infos[0].data_ptr)
    cp = interop.import_cupy()
    with cp.cuda.Device(device_id), stream:
        launch.forward(*infos, lse_info, shape, causal, device_id, stream, features=_features(options, alibi))


def _backward_callback(ctx, grads, dout, q, k, v, out, lse, alibi, *, shape: AttentionShape, causal: bool,
                       deterministic: bool, options):
    q_shape, k_shape, v_shape, lse_shape = _layouts(shape)
    dtype = _element_type(shape)
    tensors = [_buffer_info(b, s, dtype) for b, s in
               ((dout, q_shape), (q, q_shape), (k, k_shape), (v, v_shape), (out, q_shape))]
    lse_info = _buffer_info(lse, lse_shape, np.float32)
    grad_infos = [_buffer_info(g, s, dtype) for g, s in zip(grads, (q_shape, k_shape, v_shape))]
    device_id, stream = _device_and_stream(ctx, tensors[1].data_ptr)
    cp = interop.import_cupy()
    with cp.cuda.Device(device_id), stream:
        launch.backward(*tensors, lse_info, *grad_infos, shape, causal, deterministic, device_id, stream,
                        features=_features(options, alibi))


def _shape_of(q, k, v, softmax_scale) -> AttentionShape:
    infos = [_contiguous_info(x.shape, x.dtype) for x in (q, k, v)]
    return validate_qkv(*infos, softmax_scale, check_pointers=False)


def _forward(q, k, v, alibi, softmax_scale, causal, options):
    shape = _shape_of(q, k, v, softmax_scale)
    lse_type = jax.ShapeDtypeStruct((shape.batch, shape.nheads, shape.seqlen_q), jnp.float32)
    if shape.seqlen_k == 0 or shape.batch == 0 or shape.seqlen_q == 0:  # FA2: no keys -> output 0, LSE +inf
        return jnp.zeros_like(q), jnp.full(lse_type.shape, jnp.inf, jnp.float32)
    callback = functools.partial(_forward_callback, shape=shape, causal=causal, options=options)
    return buffer_callback(callback, (jax.ShapeDtypeStruct(q.shape, q.dtype), lse_type))(q, k, v, alibi)


# options = (window, softcap, alibi_shape): static; the slopes themselves are an (undifferentiated) input.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, alibi, softmax_scale, causal, options, deterministic):
    return _forward(q, k, v, alibi, softmax_scale, causal, options)


def _attention_fwd(q, k, v, alibi, softmax_scale, causal, options, deterministic):
    out, lse = _forward(q, k, v, alibi, softmax_scale, causal, options)
    return (out, lse), (q, k, v, alibi, out, lse)


def _attention_bwd(softmax_scale, causal, options, deterministic, residuals, cotangents):
    q, k, v, alibi, out, lse = residuals
    dout, _ = cotangents  # the LSE output is not differentiated (as in FA2)
    shape = _shape_of(q, k, v, softmax_scale)
    if shape.seqlen_k == 0 or shape.batch == 0 or shape.seqlen_q == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(alibi)
    callback = functools.partial(_backward_callback, shape=shape, causal=causal, deterministic=deterministic,
                                 options=options)
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dq, dk, dv = buffer_callback(callback, types)(dout.astype(q.dtype), q, k, v, out, lse, alibi)
    return dq, dk, dv, jnp.zeros_like(alibi)  # the slopes are not differentiated (as in FA2)


_attention.defvjp(_attention_fwd, _attention_bwd)


def forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic):
    """(out, softmax_lse), differentiable with respect to q, k, v; traceable under jit."""
    shape = _shape_of(q, k, v, softmax_scale)
    if alibi_slopes is None:
        alibi, alibi_shape = jnp.zeros((0,), jnp.float32), None
    else:
        alibi = jnp.asarray(alibi_slopes)
        check_alibi(_contiguous_info(alibi.shape, alibi.dtype), shape.batch, shape.nheads, "cuda")
        alibi_shape = tuple(alibi.shape)
    options = (tuple(int(w) for w in window), float(softcap), alibi_shape)
    return _attention(q, k, v, alibi, softmax_scale, bool(causal), options, bool(deterministic))
