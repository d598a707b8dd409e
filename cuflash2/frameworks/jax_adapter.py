"""The JAX adapter: differentiable attention functions usable under jax.jit and jax.grad.

The kernels run inside `jax.experimental.buffer_callback` (experimental JAX API): XLA hands the
callback its device buffers and its compute stream, and cuflash2 launches on that stream, writing
the outputs in place. `jax.custom_vjp` pairs the forward with cuflash2's backward. Imported only
when a JAX array is passed in.

Dropout: the kernels take the seed and offset as launch arguments, so they are static (Python
ints fixed when a function is traced). Under jax.jit a seed drawn because dropout_seed is None is
therefore drawn once, at trace time, and every call of the compiled function reuses its mask; pass
dropout_seed explicitly to change it (each new seed traces and compiles again).

Varlen: cu_seqlens are device arrays. Concrete ones (eager calls) are checked on the host as on the
CuPy path. Under jax.jit they are traced and their values cannot be checked: they are clamped on the
device into [0, total] and made non-decreasing so that the kernels stay inside the packed tensors,
and out/LSE/gradients are filled first (0, +inf, 0) so that rows no sequence covers are defined.
Values that break the other rules (a first entry other than 0, a sequence longer than max_seqlen)
then give wrong results, but no access outside the tensors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from ..core import ops
from ..problem.features import (
    AttentionProblem,
    Features,
    as_batched,
    check_alibi,
    check_cu_seqlens,
    check_cu_seqlens_layout,
    check_packed_dims,
    varlen_shape,
)
from ..problem.options import AttentionOptions
from ..problem.tensors import AttentionShape, TensorInfo, check_grid, contiguous_info, expect, validate_qkv
from ..problem.varlen import validate_paged_varlen
from ..runtime import launcher
from ..runtime.device import import_cupy
from .gpu import GpuAdapter, GpuCall, external_stream

NO_DROPOUT = (0.0, 0, 0)


def _contiguous_info(shape, dtype, ptr: int = 0) -> TensorInfo:
    dtype = np.dtype(dtype)
    return contiguous_info(shape, dtype.name, dtype.itemsize, "cuda", ptr)


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
    cp = import_cupy()
    device_id = cp.cuda.runtime.pointerGetAttributes(ptr).device
    return device_id, external_stream(cp, ctx.stream, device_id)


def _features(options, alibi, **varlen) -> Features:
    """Features of a call; `alibi` is the slopes' XLA buffer (a zero-size dummy when off)."""
    window, softcap, alibi_shape, dropout = options
    info = None if alibi_shape is None else _buffer_info(alibi, alibi_shape, np.float32)
    return Features(window[0], window[1], softcap, info, dropout_p=dropout[0], dropout_seed=dropout[1],
                    dropout_offset=dropout[2], **varlen)


def _forward_callback(ctx, outputs, q, k, v, alibi, *, shape: AttentionShape, causal: bool, options):
    out, lse = outputs
    q_shape, k_shape, v_shape, lse_shape = _layouts(shape)
    dtype = _element_type(shape)
    infos = [_buffer_info(b, s, dtype) for b, s in ((q, q_shape), (k, k_shape), (v, v_shape), (out, q_shape))]
    lse_info = _buffer_info(lse, lse_shape, np.float32)
    device_id, stream = _device_and_stream(ctx, infos[0].data_ptr)
    problem = AttentionProblem(shape, causal, _features(options, alibi))
    with import_cupy().cuda.Device(device_id), stream:
        ops.forward(problem, *infos, lse_info, device_id, stream)


def _backward_callback(ctx, grads, dout, q, k, v, out, lse, alibi, *, shape: AttentionShape, causal: bool,
                       deterministic: bool, options):
    q_shape, k_shape, v_shape, lse_shape = _layouts(shape)
    dtype = _element_type(shape)
    tensors = [_buffer_info(b, s, dtype) for b, s in
               ((dout, q_shape), (q, q_shape), (k, k_shape), (v, v_shape), (out, q_shape))]
    lse_info = _buffer_info(lse, lse_shape, np.float32)
    grad_infos = [_buffer_info(g, s, dtype) for g, s in zip(grads, (q_shape, k_shape, v_shape))]
    device_id, stream = _device_and_stream(ctx, tensors[1].data_ptr)
    problem = AttentionProblem(shape, causal, _features(options, alibi))
    with import_cupy().cuda.Device(device_id), stream:
        ops.backward(problem, deterministic, *tensors, lse_info, *grad_infos, device_id, stream)


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


# options = (window, softcap, alibi_shape, dropout (p, seed, offset)): static; the slopes themselves
# are an (undifferentiated) input. The backward gets the same options, so it regenerates the
# forward's dropout mask.
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


def _static_flags(**flags) -> tuple[bool, ...]:
    """The flags as Python bools: they select kernels at trace time, so a traced value cannot be used."""
    for name, value in flags.items():
        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"{name}: expected a Python bool (static under jax.jit), got a traced {type(value).__name__}")
    return tuple(bool(value) for value in flags.values())


def _check_jax_inputs(**arrays) -> None:
    """k, v (and the other tensors) must be JAX arrays like q: NumPy arrays would be uploaded silently."""
    for name, x in arrays.items():
        if x is not None and not isinstance(x, jax.Array):
            raise TypeError(f"{name}: expected a JAX array like q, got {type(x).__name__}")


def _options(shape: AttentionShape, window, softcap, alibi_slopes, dropout):
    """(slopes array (a zero-size dummy when off), static options) of a call."""
    if alibi_slopes is None:
        alibi, alibi_shape = jnp.zeros((0,), jnp.float32), None
    else:
        alibi = jnp.asarray(alibi_slopes)
        check_alibi(_contiguous_info(alibi.shape, alibi.dtype), shape.batch, shape.nheads, "cuda")
        alibi_shape = tuple(alibi.shape)
    dropout = (float(dropout[0]), int(dropout[1]), int(dropout[2]))
    return alibi, (tuple(int(w) for w in window), float(softcap), alibi_shape, dropout)


def forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic, dropout=NO_DROPOUT):
    """(out, softmax_lse), differentiable with respect to q, k, v; traceable under jit. `dropout` is
    (p, seed, offset), already checked (cuflash2.problem.options.resolve_dropout)."""
    _check_jax_inputs(k=k, v=v)
    causal, deterministic = _static_flags(causal=causal, deterministic=deterministic)
    shape = _shape_of(q, k, v, softmax_scale)
    alibi, options = _options(shape, window, softcap, alibi_slopes, dropout)
    return _attention(q, k, v, alibi, softmax_scale, causal, options, deterministic)


def check_concrete(name: str, *arrays) -> None:
    """Raise unless the arrays hold values: features computed outside XLA (the attention
    probabilities) cannot run on traced arrays."""
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        raise NotImplementedError(f"{name}: with JAX arrays it needs concrete arrays (an eager call): the "
                                  "probabilities are built outside XLA, so not inside jax.jit, jax.grad or "
                                  "jax.vmap; call without it there")


def check_call(out, return_attn_probs, dropout_p, seed_given: bool, *arrays) -> None:
    """What a JAX call cannot do, refused before any tracing of the kernels: `out=` (JAX arrays are
    immutable), attention probabilities of traced arrays, a seed drawn at trace time."""
    if out is not None:
        raise TypeError("out: JAX arrays are immutable; out= is not supported with JAX inputs")
    if return_attn_probs:  # built outside XLA: fail before the launch when traced
        check_concrete("return_attn_probs", *arrays)
    check_dropout_seed(dropout_p, seed_given, *arrays)


def check_dropout_seed(dropout_p, seed_given: bool, *arrays) -> None:
    """Under jax.jit the seed is fixed when the function is traced: a seed drawn then would give every
    call of the compiled function the same mask, so a traced call must name its seed."""
    if dropout_p and not seed_given and any(isinstance(x, jax.core.Tracer) for x in arrays):
        raise ValueError("dropout_seed: expected an int under jax.jit / jax.grad (the seed is fixed at trace "
                         "time, so a seed drawn there would repeat the same mask on every call), got None")


# ---- varlen -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VarlenProblem:
    """Static description of a varlen call (hashable: a custom_vjp non-differentiable argument)."""

    shape: AttentionShape  # batch = number of sequences, seqlens = the given maxima
    total_q: int  # rows of the packed q and k
    total_k: int
    prefill: bool  # rows may lie outside every sequence (or cu_seqlens are unchecked): fill outputs first

    @property
    def empty(self) -> bool:
        """No sequence has both queries and keys: out 0, LSE +inf, zero gradients, no launch."""
        return min(self.total_q, self.total_k, self.shape.seqlen_q, self.shape.seqlen_k) == 0

    def packed(self):
        """Shapes of the packed (q, k and v, lse, cu_seqlens)."""
        s = self.shape
        return ((self.total_q, s.nheads, s.head_dim), (self.total_k, s.nheads_kv, s.head_dim),
                (s.nheads, self.total_q), (s.batch + 1,))

    def batched(self, info: TensorInfo, rows: str) -> TensorInfo:
        """The (batch, max_seqlen, nheads, dim) view the kernels take of a packed q-like or k-like tensor."""
        return as_batched(info, self.shape.batch, self.shape.seqlen_q if rows == "q" else self.shape.seqlen_k)


def _varlen_features(problem: VarlenProblem, options, alibi, cu_q, cu_k) -> Features:
    cu_shape = problem.packed()[3]
    return _features(options, alibi, cu_seqlens_q=_buffer_info(cu_q, cu_shape, np.int32),
                     cu_seqlens_k=_buffer_info(cu_k, cu_shape, np.int32), total_q=problem.total_q,
                     total_k=problem.total_k)


def _prefill(device_id: int, *pairs) -> None:
    """Fill described buffers (info, value) before the kernels write the rows they cover."""
    for info, value in pairs:
        launcher.fill(info, value, device_id)


def _varlen_forward_callback(ctx, outputs, q, k, v, cu_q, cu_k, alibi, *, problem: VarlenProblem, causal: bool,
                             options):
    out, lse = outputs
    q_shape, kv_shape, lse_shape, _ = problem.packed()
    dtype = _element_type(problem.shape)
    q_i, k_i, v_i, out_i = (_buffer_info(b, s, dtype) for b, s in
                            ((q, q_shape), (k, kv_shape), (v, kv_shape), (out, q_shape)))
    lse_i = _buffer_info(lse, lse_shape, np.float32)
    features = _varlen_features(problem, options, alibi, cu_q, cu_k)
    device_id, stream = _device_and_stream(ctx, q_i.data_ptr)
    with import_cupy().cuda.Device(device_id), stream:
        if problem.prefill:
            _prefill(device_id, (out_i, 0), (lse_i, np.inf))
        ops.varlen_forward(AttentionProblem(problem.shape, causal, features), problem.batched(q_i, "q"),
                           problem.batched(k_i, "k"), problem.batched(v_i, "k"), problem.batched(out_i, "q"), lse_i,
                           device_id, stream)


def _varlen_backward_callback(ctx, grads, dout, q, k, v, out, lse, cu_q, cu_k, alibi, *, problem: VarlenProblem,
                              causal: bool, deterministic: bool, options):
    q_shape, kv_shape, lse_shape, _ = problem.packed()
    dtype = _element_type(problem.shape)
    rows = ("q", "q", "k", "k", "q")  # dout, q, k, v, out
    tensors = [_buffer_info(b, s, dtype) for b, s in
               ((dout, q_shape), (q, q_shape), (k, kv_shape), (v, kv_shape), (out, q_shape))]
    grad_infos = [_buffer_info(g, s, dtype) for g, s in zip(grads, (q_shape, kv_shape, kv_shape))]
    lse_i = _buffer_info(lse, lse_shape, np.float32)
    features = _varlen_features(problem, options, alibi, cu_q, cu_k)
    device_id, stream = _device_and_stream(ctx, tensors[1].data_ptr)
    with import_cupy().cuda.Device(device_id), stream:
        if problem.prefill:
            _prefill(device_id, *((g, 0) for g in grad_infos))
        ops.varlen_backward(AttentionProblem(problem.shape, causal, features), deterministic,
                            *(problem.batched(t, r) for t, r in zip(tensors, rows)), lse_i,
                            *(problem.batched(g, r) for g, r in zip(grad_infos, ("q", "k", "k"))), device_id, stream)


def _varlen_forward(q, k, v, cu_q, cu_k, alibi, problem: VarlenProblem, causal, options):
    lse_type = jax.ShapeDtypeStruct(problem.packed()[2], jnp.float32)
    if problem.empty:
        return jnp.zeros_like(q), jnp.full(lse_type.shape, jnp.inf, jnp.float32)
    callback = functools.partial(_varlen_forward_callback, problem=problem, causal=causal, options=options)
    return buffer_callback(callback, (jax.ShapeDtypeStruct(q.shape, q.dtype), lse_type))(q, k, v, cu_q, cu_k, alibi)


def _no_cotangent(x):
    """The cotangent of an integer input (cu_seqlens): float0 zeros."""
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _varlen_attention(q, k, v, cu_q, cu_k, alibi, problem, causal, options, deterministic):
    return _varlen_forward(q, k, v, cu_q, cu_k, alibi, problem, causal, options)


def _varlen_attention_fwd(q, k, v, cu_q, cu_k, alibi, problem, causal, options, deterministic):
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, alibi, problem, causal, options)
    return (out, lse), (q, k, v, cu_q, cu_k, alibi, out, lse)


def _varlen_attention_bwd(problem, causal, options, deterministic, residuals, cotangents):
    q, k, v, cu_q, cu_k, alibi, out, lse = residuals
    dout, _ = cotangents  # the LSE output is not differentiated (as in FA2)
    rest = (_no_cotangent(cu_q), _no_cotangent(cu_k), jnp.zeros_like(alibi))
    if problem.empty:
        return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), *rest)
    callback = functools.partial(_varlen_backward_callback, problem=problem, causal=causal,
                                 deterministic=deterministic, options=options)
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dq, dk, dv = buffer_callback(callback, types)(dout.astype(q.dtype), q, k, v, out, lse, cu_q, cu_k, alibi)
    return (dq, dk, dv, *rest)


_varlen_attention.defvjp(_varlen_attention_fwd, _varlen_attention_bwd)


def _check_packed_dims(name: str, x) -> TensorInfo:
    info = _contiguous_info(x.shape, x.dtype)
    check_packed_dims(name, info)
    return info


def _cu_seqlens_batch(name: str, x, batch: int | None) -> int:
    """Checks what is static about cu_seqlens (type, dtype, shape); returns the batch size."""
    expect(isinstance(x, jax.Array), lambda: f"{name}: expected a JAX int32 array like q, got {type(x).__name__}",
           TypeError)
    return check_cu_seqlens_layout(name, _contiguous_info(x.shape, x.dtype), batch, "cuda")


def _checked_cu_seqlens(name: str, x, total: int, max_seqlen: int, batch: int):
    """(device array, whether its values were checked and its last entry is `total`). Concrete
    values are checked on the host as on the CuPy path; traced ones are clamped on the device."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.cummax(jnp.clip(x, 0, total)), False
    values = np.asarray(x)  # one small device-to-host copy, as on the CuPy path
    check_cu_seqlens(name, _contiguous_info(x.shape, x.dtype), values, total, max_seqlen, batch, "cuda")
    return x, int(values[-1]) == total


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, softmax_scale, causal,
                   window, softcap, alibi_slopes, deterministic, dropout=NO_DROPOUT):
    """(out (total_q, nheads, d), softmax_lse (nheads, total_q)) of a varlen call, differentiable
    with respect to q, k, v; traceable under jit. max_seqlen_q/k are checked ints, `dropout` is
    (p, seed, offset), already checked."""
    _check_jax_inputs(k=k, v=v)
    infos = [_check_packed_dims(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    # the packed tensors as one batch entry: validate_qkv's checks of dtypes, heads and head dim
    one = validate_qkv(*(as_batched(i, 1, i.shape[0]) for i in infos), softmax_scale, check_pointers=False)
    batch = _cu_seqlens_batch("cu_seqlens_q", cu_seqlens_q, None)
    _cu_seqlens_batch("cu_seqlens_k", cu_seqlens_k, batch)
    shape = varlen_shape(infos[0], infos[1], batch, max_seqlen_q, max_seqlen_k, one.softmax_scale)
    check_grid(shape)
    alibi, options = _options(shape, window, softcap, alibi_slopes, dropout)
    total_q, total_k = q.shape[0], k.shape[0]
    cu_q, covers_q = _checked_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, batch)
    cu_k, covers_k = _checked_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, batch)
    problem = VarlenProblem(shape, total_q, total_k, prefill=not (covers_q and covers_k))
    causal, deterministic = _static_flags(causal=causal, deterministic=deterministic)
    return _varlen_attention(q, k, v, cu_q, cu_k, alibi, problem, causal, options, deterministic)


# ---- paged varlen (flash_attn_varlen_func with block_table; forward only) ------------------------
# As FA2, no backward: differentiating through it raises (the custom_vjp's backward). Concrete
# cu_seqlens are checked on the host (validate_paged_varlen, the overflow of the page table
# included); traced ones only for what is static, cu_seqlens_q then clamped on the device as above.
# Key counts need no clamp: the kernel bounds each by its row of the page table.

@dataclasses.dataclass(frozen=True)
class PagedVarlenProblem:
    """Static description of a paged varlen call (hashable)."""

    shape: AttentionShape  # batch = number of sequences, seqlens = the given maxima
    total_q: int
    cache_shape: tuple  # (num_blocks, page_size, nheads_kv, headdim)
    table_shape: tuple  # (batch, max_num_blocks_per_seq)
    prefill: bool  # rows may lie outside every sequence (or cu_seqlens are unchecked)


def _paged_forward_callback(ctx, outputs, q, k, v, cu_q, cu_k, table, alibi, *, problem: PagedVarlenProblem,
                            causal: bool, options):
    out, lse = outputs
    s = problem.shape
    dtype = _element_type(s)
    q_shape, cu_shape = (problem.total_q, s.nheads, s.head_dim), (s.batch + 1,)
    q_i, out_i = (_buffer_info(b, q_shape, dtype) for b in (q, out))
    k_i, v_i = (_buffer_info(b, problem.cache_shape, dtype) for b in (k, v))
    lse_i = _buffer_info(lse, (s.nheads, problem.total_q), np.float32)
    features = _features(options, alibi, cu_seqlens_q=_buffer_info(cu_q, cu_shape, np.int32),
                         cu_seqlens_k=_buffer_info(cu_k, cu_shape, np.int32), total_q=problem.total_q)
    device_id, stream = _device_and_stream(ctx, q_i.data_ptr)
    with import_cupy().cuda.Device(device_id), stream:
        if problem.prefill:
            _prefill(device_id, (out_i, 0), (lse_i, np.inf))
        ops.paged_varlen_forward(AttentionProblem(s, causal, features), q_i, k_i, v_i, out_i, lse_i,
                                 _buffer_info(table, problem.table_shape, np.int32), problem.cache_shape[1], device_id,
                                 stream)


def _paged_forward(q, k, v, cu_q, cu_k, table, alibi, problem: PagedVarlenProblem, causal, options):
    lse_type = jax.ShapeDtypeStruct((problem.shape.nheads, problem.total_q), jnp.float32)
    if min(problem.total_q, problem.shape.seqlen_q) == 0:
        return jnp.zeros_like(q), jnp.full(lse_type.shape, jnp.inf, jnp.float32)
    callback = functools.partial(_paged_forward_callback, problem=problem, causal=causal, options=options)
    return buffer_callback(callback, (jax.ShapeDtypeStruct(q.shape, q.dtype), lse_type))(q, k, v, cu_q, cu_k, table,
                                                                                         alibi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _paged_attention(q, k, v, cu_q, cu_k, table, alibi, problem, causal, options):
    return _paged_forward(q, k, v, cu_q, cu_k, table, alibi, problem, causal, options)


def _paged_attention_fwd(q, k, v, cu_q, cu_k, table, alibi, problem, causal, options):
    return _paged_forward(q, k, v, cu_q, cu_k, table, alibi, problem, causal, options), None


def _paged_attention_bwd(problem, causal, options, residuals, cotangents):
    raise NotImplementedError("block_table: flash_attn_varlen_func with paged K/V has no backward (as in "
                              "flash-attn); differentiate only calls without block_table")


_paged_attention.defvjp(_paged_attention_fwd, _paged_attention_bwd)


def varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, softmax_scale,
                         causal, window, softcap, alibi_slopes, block_table):
    """(out (total_q, nheads, d), softmax_lse (nheads, total_q)) of a varlen call against paged K/V;
    traceable under jit, not differentiable."""
    _check_jax_inputs(k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    infos = {name: _contiguous_info(x.shape, x.dtype) for name, x in
             (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
              ("block_table", block_table))}
    traced = any(isinstance(x, jax.core.Tracer) for x in (cu_seqlens_q, cu_seqlens_k))
    if traced:  # only the static checks: zeros pass the value checks
        values_q, values_k = np.zeros(cu_seqlens_q.shape, np.int64), np.zeros(cu_seqlens_k.shape, np.int64)
    else:  # one small device-to-host copy each, as on the CuPy path
        values_q, values_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    problem = validate_paged_varlen(infos["q"], infos["k"], infos["v"], infos["block_table"], softmax_scale,
                                    infos["cu_seqlens_q"], values_q, infos["cu_seqlens_k"], values_k, max_seqlen_q,
                                    max_seqlen_k, check_pointers=False)
    shape = problem.shape
    alibi, options = _options(shape, window, softcap, alibi_slopes, NO_DROPOUT)
    total_q = q.shape[0]
    cu_q = jax.lax.cummax(jnp.clip(cu_seqlens_q, 0, total_q)) if traced else cu_seqlens_q
    static = PagedVarlenProblem(shape, total_q, tuple(k.shape), tuple(block_table.shape),
                                prefill=traced or not problem.covers_all_rows)
    (causal,) = _static_flags(causal=causal)
    return _paged_attention(q, k, v, cu_q, cu_seqlens_k, block_table, alibi, static, causal, options)


class JaxCall(GpuCall):
    """An eager GPU call on JAX arrays (the explicit forward/backward functions): through DLPack."""

    def result(self, x):
        return jax.dlpack.from_dlpack(x)


class JaxAdapter(GpuAdapter):
    """JAX arrays: the differentiable entry points through custom_vjp over buffer_callback; the
    explicit ones eagerly through DLPack."""

    call_type = JaxCall

    def __init__(self):
        self.name = "jax"

    def attention(self, q, k, v, alibi_slopes, options: AttentionOptions, out, seed_given: bool,
                  return_attn_probs: bool):
        check_call(out, return_attn_probs, options.dropout.p, seed_given, q, k, v, alibi_slopes)
        dropout = options.dropout
        out, lse = forward(q, k, v, options.softmax_scale, options.causal, options.window, options.softcap,
                           alibi_slopes, options.deterministic, (dropout.p, dropout.seed, dropout.offset))
        return out, lse, dropout

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                         options: AttentionOptions, out, seed_given: bool, return_attn_probs: bool):
        check_call(out, return_attn_probs, options.dropout.p, seed_given, q, k, v, cu_seqlens_q, cu_seqlens_k,
                   alibi_slopes)
        dropout = options.dropout
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  options.softmax_scale, options.causal, options.window, options.softcap, alibi_slopes,
                                  options.deterministic, (dropout.p, dropout.seed, dropout.offset))
        return out, lse, dropout

    def paged_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                        alibi_slopes, options: AttentionOptions, out, return_attn_probs: bool):
        check_call(out, return_attn_probs, 0.0, True, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes)
        return varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    options.softmax_scale, options.causal, options.window, options.softcap,
                                    alibi_slopes, block_table)

    def kvcache(self, arrays: tuple, softmax_scale, causal: bool, window, softcap: float, interleaved: bool,
                num_splits: int, return_softmax_lse: bool, key, host_lengths, checked: bool):
        raise NotImplementedError("q: flash_attn_with_kvcache updates the cache in place; JAX arrays are immutable")


ADAPTER = JaxAdapter()
