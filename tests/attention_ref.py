"""Array-module-generic attention references for the GPU tests (NumPy or CuPy as `xp`).

The forward reference and the rounding helper are cuflash2.checks' (also used by `cuflash2 check`).
With `low_precision=dtype` every intermediate is rounded to the input precision: the "naive
computation in the input precision" of FA2's tolerance rule.
"""

import math
import zlib

import numpy as np

from cuflash2.checks import attention_ref, round_to  # noqa: F401  (re-exported for the tests)
from cuflash2.materialize import as_float32


def stable_seed(*parts) -> int:
    """A seed from a test's parameters that is the same in every process (Python's hash() of strings
    is randomised per process, which made inputs, and any failure, differ from run to run)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def attention_backward_ref(xp, q, k, v, dout, causal=False, softmax_scale=None, low_precision=None):
    """Gradients (dq, dk, dv) in float32 of attention on float32 inputs; with `low_precision`, every
    intermediate is rounded to that dtype (FA2's naive same-precision baseline). Unlike
    cuflash2.checks.attention_backward_ref, D is rowsum(dout * out) from the rounded output, as the
    kernels compute it."""
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
    dk = rnd(dk.reshape(b, sk, hk, group, d).sum(axis=3))  # the group sum is stored rounded too
    dv = rnd(dv.reshape(b, sk, hk, group, d).sum(axis=3))
    return dq.astype(xp.float32), dk.astype(xp.float32), dv.astype(xp.float32)


def visible_ref(xp, sq, sk, causal=False, window=(-1, -1)):
    """(sq, sk) bool: query i sees key j (bottom-right aligned window; causal = right 0)."""
    left, right = window
    right = 0 if causal else right
    distance = xp.arange(sk)[None, :] - (xp.arange(sq)[:, None] + (sk - sq))
    visible = xp.ones((sq, sk), dtype=bool)
    if right >= 0:
        visible &= distance <= right
    if left >= 0:
        visible &= distance >= -left
    return visible, distance


def attention_features_ref(xp, q, k, v, dout=None, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                           slopes=None, low_precision=None, keep=None, rescale=1.0):
    """Forward (out, lse) and, given dout, gradients (dq, dk, dv) in float32 of attention with a
    sliding window, softcap, ALiBi (slopes: (nheads,) or (batch, nheads)) and dropout (keep: bool
    (batch, nheads, seqlen_q, seqlen_k), kept entries scaled by rescale), on float32 inputs.
    With `low_precision`, every intermediate is rounded to that dtype (FA2's naive baseline)."""
    rnd = (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = h // k.shape[2]
    kr, vr = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    s = rnd(xp.einsum("bqhd,bkhd->bhqk", q, kr) * scale)
    t = None
    if softcap > 0:
        t = rnd(xp.tanh(s / softcap))
        s = rnd(softcap * t)
    visible, distance = visible_ref(xp, sq, sk, causal, window)
    if slopes is not None:
        sl = xp.broadcast_to(xp.asarray(slopes, dtype=xp.float32).reshape(-1, h), (b, h))
        s = rnd(s - sl[:, :, None, None] * xp.abs(distance).astype(xp.float32))
    s = xp.where(visible, s, -xp.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0)
    e = xp.exp(s - row_max)
    denom = e.sum(axis=-1, keepdims=True)
    lse = xp.where(denom[..., 0] > 0, xp.log(xp.where(denom == 0, 1, denom))[..., 0] + row_max[..., 0], xp.inf)
    p = rnd(e / xp.where(denom == 0, 1, denom))
    p_kept = p if keep is None else rnd(xp.where(keep, p * rescale, 0))
    out = rnd(xp.einsum("bhqk,bkhd->bqhd", p_kept, vr))
    if dout is None:
        return out.astype(xp.float32), lse.astype(xp.float32)
    dv = rnd(xp.einsum("bhqk,bqhd->bkhd", p_kept, dout))
    dp = rnd(xp.einsum("bqhd,bkhd->bhqk", dout, vr))
    if keep is not None:
        dp = rnd(xp.where(keep, dp * rescale, 0))
    delta = xp.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = rnd(p * (dp - delta))
    if t is not None:
        ds = rnd(ds * (1 - t * t))
    dq = rnd(xp.einsum("bhqk,bkhd->bqhd", ds, kr) * scale)
    dk = rnd(xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    hk = k.shape[2]
    dk = rnd(dk.reshape(b, sk, hk, group, d).sum(axis=3))
    dv = rnd(dv.reshape(b, sk, hk, group, d).sum(axis=3))
    return tuple(x.astype(xp.float32) for x in (out, lse, dq, dk, dv))


def check_fa2_rule(xp, name, got, ref, naive, factor):
    """FA2's tolerance rule: max error of `got` at most factor x the naive same-precision error, plus
    half an ulp of the largest value (storing the result rounds it; that is the whole error when the
    naive computation is exact, e.g. one-hot P)."""
    eps = 2.0 ** -8 if np.dtype(got.dtype).name == "bfloat16" else 2.0 ** -11
    got = as_float32(xp, got)
    assert not bool(xp.isnan(got).any()), f"NaN in {name}"
    err = float(xp.abs(got - ref).max())
    naive_err = float(xp.abs(naive - ref).max())
    rounding = eps * float(xp.abs(ref).max())
    assert err <= factor * naive_err + rounding + 1e-4, \
        f"{name}: max error {err:.3e} > {factor} x naive {naive_err:.3e} + rounding {rounding:.1e}"


def forward_into(q, k, v, out, lse, causal=False):
    """The forward into given `out` and `lse` (the entry the torch custom op uses), through the
    arrays' framework adapter."""
    from cuflash2.frameworks import adapter_for
    from cuflash2.problem.options import AttentionOptions

    adapter_for(q).forward_into(q, k, v, out, lse, None, AttentionOptions(causal=causal))
