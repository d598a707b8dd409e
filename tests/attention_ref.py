"""Array-module-generic attention references for the GPU tests (NumPy or CuPy as `xp`).

`attention_ref` computes in float32 on upcast inputs (the accurate reference); with
`low_precision=dtype` every intermediate (S, P, O) is rounded to the input precision, which is the
"naive computation in the input precision" of FA2's tolerance rule.
"""

import math


def round_to(xp, x, dtype_name):
    """Round float32 values to bf16 / fp16 precision, returned as float32."""
    x = x.astype(xp.float32)
    if dtype_name == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    bits = x.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    return xp.where(xp.isnan(x), x, rounded.view(xp.float32))


def attention_ref(xp, q, k, v, causal=False, softmax_scale=None, low_precision=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d) float32 -> (out float32, lse float32 (b, h, sq))."""
    rnd = (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = q.shape[2] // k.shape[2]
    k = xp.repeat(k, group, axis=2)
    v = xp.repeat(v, group, axis=2)
    s = rnd(xp.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal:
        visible = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        s = xp.where(visible, s, -xp.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0)
    p = xp.exp(s - row_max)
    denom = p.sum(axis=-1, keepdims=True)
    lse = xp.where(denom[..., 0] > 0, xp.log(denom[..., 0]) + row_max[..., 0], xp.inf)
    p = rnd(p / xp.where(denom == 0, 1, denom))
    out = rnd(xp.einsum("bhqk,bkhd->bqhd", p, v))
    return out.astype(xp.float32), lse.astype(xp.float32)


def attention_backward_ref(xp, q, k, v, dout, causal=False, softmax_scale=None, low_precision=None):
    """Gradients (dq, dk, dv) in float32 of attention on float32 inputs; with `low_precision`, every
    intermediate is rounded to that dtype (FA2's naive same-precision baseline)."""
    rnd = (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = q.shape[2] // k.shape[2]
    kr, vr = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    s = xp.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        visible = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        s = xp.where(visible, s, -xp.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0)
    p = xp.exp(s - row_max)
    denom = p.sum(axis=-1, keepdims=True)
    p = rnd(p / xp.where(denom == 0, 1, denom))
    out = rnd(xp.einsum("bhqk,bkhd->bqhd", p, vr))
    dv = rnd(xp.einsum("bhqk,bqhd->bkhd", p, dout))
    dp = rnd(xp.einsum("bqhd,bkhd->bhqk", dout, vr))
    delta = xp.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = rnd(p * (dp - delta))
    dq = rnd(xp.einsum("bhqk,bkhd->bqhd", ds, kr) * scale)
    dk = rnd(xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    b, _, hk, _ = k.shape
    dk = dk.reshape(b, sk, hk, group, d).sum(axis=3)
    dv = dv.reshape(b, sk, hk, group, d).sum(axis=3)
    return dq.astype(xp.float32), dk.astype(xp.float32), dv.astype(xp.float32)
