"""Public functions with FlashAttention-2's names, arguments and return conventions.

Flow of one call: classify the inputs (NumPy -> CPU reference path; CuPy / DLPack -> GPU path),
validate (pure), choose the kernel config (pure), compile (cached), launch on the caller's stream,
hand the result back as the caller's own array type.
"""

from __future__ import annotations

import math

import numpy as np

from . import interop, reference
from .config import forward_config
from .validate import (AttentionShape, check_compute_capability, check_unsupported_options, validate_out,
                       validate_qkv)

LOG2_E = 1.0 / math.log(2.0)
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}
_MAX_GRID_YZ = 65535


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None):
    """Exact attention softmax(scale * q k^T) v, FlashAttention-2 style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16 or bf16,
    nheads % nheads_kv == 0 (GQA/MQA). causal masks are aligned to the bottom-right corner.
    Returns out (same shape and type as q), or (out, softmax_lse, attn_probs) when return_attn_probs:
    softmax_lse is fp32 (batch, nheads, seqlen_q), natural log; attn_probs (batch, nheads, seqlen_q,
    seqlen_k) fp32 is materialised in full and meant for testing only.
    """
    check_unsupported_options(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes)
    if interop.framework_of(q) == "torch":  # differentiable torch.library custom op
        from . import torch_ops

        out, lse = torch_ops.forward(q, k, v, softmax_scale, causal, deterministic, out)
    else:
        out, lse = flash_attn_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, out=out)
    if not return_attn_probs:
        return out
    return out, lse, attention_probs(q, k, lse, softmax_scale=softmax_scale, causal=causal)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             out=None):
    """As flash_attn_func with kv of shape (batch, seqlen_k, 2, nheads_kv, headdim)."""
    _check_packed("kv", kv, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, out=out)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              out=None):
    """As flash_attn_func with qkv of shape (batch, seqlen, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, out=out)


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 5 or shape[2] != parts:
        raise ValueError(f"{name}: expected shape (batch, seqlen, {parts}, nheads, headdim), got {shape}")


def flash_attn_forward(q, k, v, softmax_scale=None, causal=False, out=None):
    """Forward pass returning (out, softmax_lse); the building block of the public functions."""
    if interop.framework_of(q) == "numpy":
        return _forward_numpy(q, k, v, softmax_scale, causal, out)
    with interop.gpu_call(q) as call:
        qc, kc, vc = (call.to_cupy(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
        shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", qc), ("k", kc), ("v", vc))), softmax_scale)
        _check_grid(shape)
        out_c = _prepare_out(call, out, shape, qc)
        lse_c = _forward_cupy(qc, kc, vc, out_c, shape, causal, call.device_id)
        out_result = out if out is not None else call.from_cupy(out_c)
        return out_result, call.from_cupy(lse_c)


def forward_into(q, k, v, out, softmax_lse, softmax_scale=None, causal=False) -> None:
    """Forward pass writing into caller-allocated out and softmax_lse (GPU arrays of any framework)."""
    with interop.gpu_call(q) as call:
        qc, kc, vc, lse_c = (call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("softmax_lse", softmax_lse)))
        shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", qc), ("k", kc), ("v", vc))), softmax_scale)
        _check_grid(shape)
        out_c = _prepare_out(call, out, shape, qc)
        expected = (shape.batch, shape.nheads, shape.seqlen_q)
        if tuple(lse_c.shape) != expected or np.dtype(lse_c.dtype) != np.float32 or not lse_c.flags.c_contiguous:
            raise ValueError(f"softmax_lse: expected a contiguous float32 array of shape {expected}, "
                             f"got {np.dtype(lse_c.dtype).name} {tuple(lse_c.shape)}")
        _forward_cupy(qc, kc, vc, out_c, shape, causal, call.device_id, lse=lse_c)


def _check_grid(shape: AttentionShape) -> None:
    for name, value in (("batch", shape.batch), ("nheads", shape.nheads)):
        if value > _MAX_GRID_YZ:
            raise ValueError(f"q: expected {name} <= {_MAX_GRID_YZ}, got {value}")


def _prepare_out(call, out, shape: AttentionShape, qc):
    cp = interop.import_cupy()
    if out is None:
        return cp.empty((shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim), dtype=qc.dtype)
    out_c = call.to_cupy("out", out) if call.framework != "cupy" else out
    validate_out(interop.describe("out", out_c), shape)
    return out_c


def _forward_cupy(q, k, v, out, shape: AttentionShape, causal: bool, device_id: int, config=None, lse=None):
    """Launch the forward kernel on CuPy arrays (current stream); returns softmax_lse.

    `config` overrides the tile choice (benchmarks and tuning only)."""
    cp = interop.import_cupy()
    from .compiler import get_kernel

    if lse is None:
        lse = cp.empty((shape.batch, shape.nheads, shape.seqlen_q), dtype=np.float32)
    if shape.seqlen_k == 0:  # FA2: no keys -> output 0, LSE +inf
        out.view(cp.uint16).fill(0)  # +0.0 in both 16-bit formats
        lse.fill(np.inf)
        return lse
    cc = cp.cuda.Device(device_id).compute_capability
    arch = check_compute_capability(int(cc[:-1]), int(cc[-1]))
    if config is None:
        config = forward_config(shape.head_dim, _SHORT_DTYPE[shape.dtype], causal, arch)
    kernel = get_kernel(config, device_id)
    grid = (math.ceil(shape.seqlen_q / config.block_m), shape.nheads, shape.batch)
    strides = [np.int64(s // x.dtype.itemsize) for x in (q, k, v, out) for s in x.strides[:3]]
    kernel(grid, (config.threads,),
           (q, k, v, out, lse, *strides, np.int32(shape.seqlen_q), np.int32(shape.seqlen_k),
            np.int32(shape.head_dim), np.int32(shape.kv_group), np.float32(shape.softmax_scale * LOG2_E)),
           shared_mem=config.smem_bytes)
    return lse


def _forward_numpy(q, k, v, softmax_scale, causal, out):
    """CPU path: the NumPy tiled reference (slow; for CPU use and tests)."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
                         check_pointers=False)
    if shape.seqlen_k == 0:
        result = np.zeros(q.shape, dtype=q.dtype)
        lse = np.full((shape.batch, shape.nheads, shape.seqlen_q), np.inf, dtype=np.float32)
    else:
        o32, lse = reference.attention_tiled(q, k, v, softmax_scale=shape.softmax_scale, causal=causal,
                                             p_dtype=q.dtype)
        result = o32.astype(q.dtype)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a NumPy array like q, got {type(out).__name__}")
        validate_out(interop.describe("out", out), shape, check_pointers=False)
        out[...] = result
        result = out
    return result, lse.astype(np.float32)


def attention_probs(q, k, softmax_lse, softmax_scale=None, causal=False):
    """softmax(scale * q k^T) as fp32 (batch, nheads, seqlen_q, seqlen_k), rebuilt from the LSE.

    Materialises the full matrix: for tests and debugging only.
    """
    if interop.framework_of(q) == "numpy":
        return _probs(np, q, k, softmax_lse, softmax_scale, causal)
    with interop.gpu_call(q) as call:
        qa, ka, la = (call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse)))
        return call.from_cupy(_probs(interop.import_cupy(), qa, ka, la, softmax_scale, causal))


def _probs(xp, q, k, lse, softmax_scale, causal):
    head_dim, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kf = xp.repeat(interop.as_float32(xp, k), q.shape[2] // k.shape[2], axis=2)
    logits = xp.einsum("bqhd,bkhd->bhqk", interop.as_float32(xp, q), kf) * scale
    if causal:
        visible = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        logits = xp.where(visible, logits, -xp.inf)
    return xp.exp(logits - lse[..., None]).astype(xp.float32)
