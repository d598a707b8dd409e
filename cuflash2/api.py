"""Public functions with FlashAttention-2's names, arguments and return conventions.

Flow of one call: classify the inputs (NumPy -> CPU reference path; CuPy / DLPack -> GPU path),
validate (pure), choose the kernel config (pure), compile (cached), launch on the caller's stream,
hand the result back as the caller's own array type.
"""

from __future__ import annotations

import math

import numpy as np

from . import call_plans, interop, launch, reference
from . import dropout as dropout_rng
from .config import MAX_GRID_YZ
from .dropout import check_dropout
from .features import PLAIN, Features, check_alibi, check_rng_state, check_softcap, check_window
from .validate import AttentionShape, check_bool, validate_out, validate_qkv


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None,
                    dropout_seed=None):
    """Exact attention softmax(scale * q k^T) v, FlashAttention-2 style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16 or bf16,
    nheads % nheads_kv == 0 (GQA/MQA). Masks are aligned to the bottom-right corner: query i sees
    key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, with
    window_size = (left, right) (-1 = unbounded) and causal meaning right = 0.
    softcap > 0: logits become softcap * tanh(scale * q.k / softcap). alibi_slopes: fp32 (nheads,)
    or (batch, nheads); adds -slope * |i + seqlen_k - seqlen_q - j| to the logits.
    dropout_p > 0: attention dropout with a counter-based Philox mask drawn from dropout_seed (a new
    random seed when None); the backward regenerates the same mask (cuflash2.dropout).
    Returns out (same shape and type as q), or (out, softmax_lse, attn_probs) when return_attn_probs:
    softmax_lse is fp32 (batch, nheads, seqlen_q), natural log; attn_probs (batch, nheads, seqlen_q,
    seqlen_k) fp32 is materialised in full and meant for testing only (with dropout, dropped entries
    are negated, as FA2's S_dmask).
    """
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    framework = interop.framework_of(q)
    dropout = call_dropout(framework, dropout_p, dropout_seed)
    window, softcap = check_window(window_size), check_softcap(softcap)
    if framework == "torch":  # differentiable torch.library custom op
        from . import torch_ops

        out, lse, dropout = torch_ops.forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                                              deterministic, out, dropout, seed_given=dropout_seed is not None)
    elif framework == "jax":  # differentiable, jit-able (custom_vjp over buffer_callback)
        from . import jax_ops

        jax_ops.check_call(out, return_attn_probs, dropout_p, dropout_seed, q, k, v, alibi_slopes)
        out, lse = jax_ops.forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                                   dropout)
    else:
        out, lse = flash_attn_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes, out=out, dropout_p=dropout.p,
                                      dropout_seed=dropout.seed if dropout.p else None)
    if not return_attn_probs:
        return out
    return out, lse, attention_probs(q, k, lse, softmax_scale=softmax_scale, causal=causal, window_size=window,
                                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout.p,
                                     **dropout_source(dropout))


def call_dropout(framework: str, dropout_p, dropout_seed) -> dropout_rng.DropoutSpec:
    """The dropout of an autograd entry point: torch calls without a seed leave it to torch_ops,
    which draws it from torch's CUDA generator; the others resolve (or draw) it here."""
    if framework == "torch" and dropout_seed is None:
        return dropout_rng.DropoutSpec(check_dropout(dropout_p))
    return resolve_dropout(dropout_p, dropout_seed, 0, draw_seed=True)


def dropout_source(dropout: dropout_rng.DropoutSpec) -> dict:
    """The keyword arguments that hand a resolved spec's seed (or device rng_state) on."""
    if dropout.p == 0:
        return {}
    if dropout.rng_state is not None:
        return {"dropout_rng_state": dropout.rng_state}
    return {"dropout_seed": dropout.seed, "dropout_offset": dropout.offset}


def resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed: bool,
                    rng_state=None) -> dropout_rng.DropoutSpec:
    """The checked DropoutSpec of a call. Without a seed, draw_seed picks a fresh one (the autograd
    entry points, which keep it for the backward); the explicit forward/backward functions need a
    seed or a device rng_state (int64 (seed, offset), as torch's generator fills it)."""
    p = check_dropout(dropout_p)
    if p == 0.0:
        return dropout_rng.NO_DROPOUT
    if rng_state is not None:
        if dropout_seed is not None:
            raise ValueError("dropout_seed: expected None when dropout_rng_state is given (the kernels read "
                             f"the seed from it), got {dropout_seed!r}")
        return dropout_rng.DropoutSpec(p, 0, 0, rng_state)
    if dropout_seed is None:
        if not draw_seed:
            raise ValueError("dropout_seed: expected an int with dropout_p > 0 (the backward must regenerate "
                             "the forward's mask), got None")
        dropout_seed = dropout_rng.new_seed()
    seed = dropout_rng.check_seed("dropout_seed", dropout_seed)
    offset = dropout_rng.check_seed("dropout_offset", dropout_offset)
    return dropout_rng.DropoutSpec(p, seed, offset)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             out=None, dropout_seed=None):
    """As flash_attn_func with kv of shape (batch, seqlen_k, 2, nheads_kv, headdim)."""
    _check_packed("kv", kv, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, out=out, dropout_seed=dropout_seed)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              out=None, dropout_seed=None):
    """As flash_attn_func with qkv of shape (batch, seqlen, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, out=out,
                           dropout_seed=dropout_seed)


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 5 or shape[2] != parts:
        raise ValueError(f"{name}: expected shape (batch, seqlen, {parts}, nheads, headdim), got {shape}")


def flash_attn_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, out=None, *, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                       dropout_rng_state=None):
    """Forward pass returning (out, softmax_lse); the building block of the public functions.
    With dropout_p > 0, dropout_seed (and dropout_offset) must be given, or dropout_rng_state: a
    device int64 array (seed, offset) the kernels read when they run (CUDA-graph friendly). Pass
    the same to the backward."""
    key = forward_plan_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    result = call_plans.replay(key, (q, k, v)) if out is None else None
    if result is not None:  # a call signature seen before (cuflash2.call_plans)
        return result
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    if interop.framework_of(q) == "numpy":
        return _forward_numpy(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, out, dropout)
    with interop.gpu_call(q) as call:
        shape, infos = _validated_inputs(call, q, k, v, softmax_scale)
        features = gpu_features(call, shape, infos[0].device, window, softcap, alibi_slopes, dropout)
        out_array, out_info = _output(call, out, shape, infos[0], q)
        lse, lse_info = call.empty((shape.batch, shape.nheads, shape.seqlen_q), "float32")
        _forward(call, infos, out_info, lse_info, shape, causal, features)
        call_plans.register_forward(key, (q, k, v), infos, (out_info, lse_info), shape, causal, features,
                                    call.device_id)
        return (out if out is not None else call.result(out_array)), call.result(lse)


def forward_plan_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p):
    """The call_plans key of a forward call as given (None when it cannot take a plan: ALiBi,
    dropout, or arguments the key cannot hold). Raw options: the full path validates them before
    any plan is kept under the key."""
    if alibi_slopes is not None or type(dropout_p) not in (int, float) or dropout_p != 0:
        return None
    return call_plans.forward_key(q, k, v, softmax_scale, causal, window_size, softcap)


def gpu_features(call, shape: AttentionShape, device: str, window, softcap, alibi_slopes,
                 dropout: dropout_rng.DropoutSpec = dropout_rng.NO_DROPOUT, **varlen) -> Features:
    """Validated Features of a GPU call (window, softcap and dropout already checked)."""
    alibi = rng_state = None
    if alibi_slopes is not None:
        alibi = call.tensor("alibi_slopes", alibi_slopes)
        check_alibi(alibi, shape.batch, shape.nheads, device)
    if dropout.rng_state is not None:
        rng_state = call.tensor("dropout_rng_state", dropout.rng_state)
        check_rng_state(rng_state, device)
    return Features(window[0], window[1], softcap, alibi, dropout_p=dropout.p, dropout_seed=dropout.seed,
                    dropout_offset=dropout.offset, dropout_rng_state=rng_state, **varlen)


def host_dropout(call, dropout: dropout_rng.DropoutSpec) -> dropout_rng.DropoutSpec:
    """The spec with the seed and offset on the host (reads a device rng_state back: a synchronising
    copy, for the paths that rebuild the mask on the host side, probabilities and references)."""
    if dropout.rng_state is None:
        return dropout
    seed, offset = (int(x) for x in call.to_cupy("dropout_rng_state", dropout.rng_state).get())
    return dropout_rng.DropoutSpec(dropout.p, seed, offset)


def forward_into(q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, *, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                 dropout_rng_state=None) -> None:
    """Forward pass writing into caller-allocated out and softmax_lse (GPU arrays of any framework)."""
    key = forward_plan_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    with interop.gpu_call(q) as call:
        shape, infos = _validated_inputs(call, q, k, v, softmax_scale)
        features = gpu_features(call, shape, infos[0].device, window, softcap, alibi_slopes, dropout)
        _, out_info = _output(call, out, shape, infos[0], q)
        lse_info = call.output("softmax_lse", softmax_lse)
        expected = (shape.batch, shape.nheads, shape.seqlen_q)
        if lse_info.shape != expected or lse_info.dtype != "float32" or (all(expected) and lse_info.strides != (
                shape.nheads * shape.seqlen_q, shape.seqlen_q, 1)):
            raise ValueError(f"softmax_lse: expected a contiguous float32 array of shape {expected}, "
                             f"got {lse_info.dtype} {lse_info.shape}")
        _forward(call, infos, out_info, lse_info, shape, causal, features)
        call_plans.register_forward(key, (q, k, v), infos, (out_info, lse_info), shape, causal, features,
                                    call.device_id)


def _validated_inputs(call, q, k, v, softmax_scale):
    infos = tuple(call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    shape = validate_qkv(*infos, softmax_scale)
    _check_grid(shape)
    return shape, infos


def _output(call, out, shape: AttentionShape, q_info, q):
    """(array, info) of the output: the caller's `out` (validated) or a new array."""
    if out is None:
        return call.empty((shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim), shape.dtype, like=q)
    info = call.output("out", out)
    validate_out(info, shape)
    return out, info


def _forward(call, infos, out_info, lse_info, shape: AttentionShape, causal: bool, features: Features = PLAIN) -> None:
    if shape.batch == 0 or shape.seqlen_q == 0:  # empty output, nothing to compute
        return
    if shape.seqlen_k == 0:  # FA2: no keys -> output 0, LSE +inf
        _fill(call, out_info, 0)
        _fill(call, lse_info, np.inf)
        return
    launch.forward(*infos, out_info, lse_info, shape, causal, call.device_id, call.stream, features=features)


def _fill(call, info, value) -> None:
    """Fill a described device tensor (rare paths only: wraps it as a CuPy array)."""
    cp = interop.import_cupy()
    if not all(info.shape):
        return
    itemsize = info.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(info.shape, info.strides)) if all(info.shape) else 0
    memory = cp.cuda.UnownedMemory(info.data_ptr, extent * itemsize, owner=None, device_id=call.device_id)
    dtype = np.float32 if info.dtype == "float32" else np.uint16
    view = cp.ndarray(info.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0),
                      strides=tuple(s * itemsize for s in info.strides))
    view.fill(value)  # value 0 is +0.0 in both 16-bit formats


def _check_grid(shape: AttentionShape) -> None:
    for name, value in (("batch", shape.batch), ("nheads", shape.nheads)):
        if value > MAX_GRID_YZ:
            raise ValueError(f"q: expected {name} <= {MAX_GRID_YZ}, got {value}")


def _forward_numpy(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, out,
                   dropout=dropout_rng.NO_DROPOUT):
    """CPU path: the NumPy tiled reference (slow; for CPU use and tests)."""
    check_host_dropout(dropout)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    shape = validate_qkv(*(interop.describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))), softmax_scale,
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
        validate_out(interop.describe("out", out), shape, check_pointers=False)
        out[...] = result
        result = out
    return result, lse.astype(np.float32)


def check_host_dropout(dropout: dropout_rng.DropoutSpec) -> None:
    """The NumPy path takes its seed on the host."""
    if dropout.rng_state is not None:
        raise TypeError("dropout_rng_state: expected None for NumPy arrays (pass dropout_seed), got "
                        f"{type(dropout.rng_state).__name__}")


def numpy_dropout_mask(dropout, shape: AttentionShape, xp=np):
    """(keep mask (batch, nheads, seqlen_q, seqlen_k), 1 / (1 - p)) of a dropout call (host seed)."""
    keep = dropout_rng.keep_mask(xp, dropout.seed, dropout.offset, shape.batch, shape.nheads, shape.seqlen_q,
                                 shape.seqlen_k, dropout.p)
    return keep, dropout_rng.rescale(dropout.p)


def numpy_alibi(alibi_slopes, shape: AttentionShape):
    """Validated host ALiBi slopes for the NumPy path (None when off)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, np.ndarray):
        raise TypeError(f"alibi_slopes: expected a NumPy array like q, got {type(alibi_slopes).__name__}")
    check_alibi(interop.describe("alibi_slopes", alibi_slopes), shape.batch, shape.nheads, "cpu")
    return alibi_slopes


def attention_probs(q, k, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """softmax of the (masked, softcapped, ALiBi-biased) logits as fp32 (batch, nheads, seqlen_q,
    seqlen_k), rebuilt from the LSE. With dropout, the entries the kernels dropped are negated
    (FA2's S_dmask convention); the kept ones are not rescaled.

    Materialises the full matrix: for tests and debugging only.
    """
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    if interop.framework_of(q) == "numpy":
        probs = _probs(np, q, k, softmax_lse, softmax_scale, causal, window, softcap, alibi_slopes)
        return _mark_dropped(np, probs, dropout)
    with interop.gpu_call(q) as call:
        qa, ka, la = (call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse)))
        slopes = None if alibi_slopes is None else call.to_cupy("alibi_slopes", alibi_slopes)
        cp = interop.import_cupy()
        probs = _probs(cp, qa, ka, la, softmax_scale, causal, window, softcap, slopes)
        return call.result(_mark_dropped(cp, probs, host_dropout(call, dropout)))


def _mark_dropped(xp, probs, dropout: dropout_rng.DropoutSpec):
    if dropout.p == 0:
        return probs
    b, h, sq, sk = probs.shape
    keep = dropout_rng.keep_mask(xp, dropout.seed, dropout.offset, b, h, sq, sk, dropout.p)
    return xp.where(keep, probs, -probs)


def _probs(xp, q, k, lse, softmax_scale, causal, window=(-1, -1), softcap=0.0, slopes=None):
    head_dim, sq, sk = q.shape[-1], q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kf = xp.repeat(interop.as_float32(xp, k), q.shape[2] // k.shape[2], axis=2)
    logits = xp.einsum("bqhd,bkhd->bhqk", interop.as_float32(xp, q), kf) * scale
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
