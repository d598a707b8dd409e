"""Numerical extremes: huge logits (|q.k * scale| ~ 1e4, both signs), all-equal rows, one-hot rows,
fp16 values near overflow; causal and not. Outputs, LSE and gradients must stay finite, match
closed forms where one exists, and pass FA2's rule against fp32 references. (test_backward_gpu.py
already covers moderately large fp16 q/k, fully masked rows; test_forward_gpu.py NaN isolation.)

The inputs are built so that every fp32 logit is exact (small integers times powers of two, partial
sums below 2^24 units), so the references are exact too, whatever the summation order.

Two rounding effects at |logits| ~ L are inherent to an fp32 softmax state and absent from FA2's
naive baseline, so they get explicit floors (`_lse_floors`):
- the running max is rounded in fp32 (spacing ~L * 2^-23): the forward's P is off by a common
  factor 1 + O(L * 2^-24), visible when one key (or all keys equally) dominates a row, and through
  D = rowsum(dO * O) it shifts dS by that factor times D;
- the backward rebuilds P from the fp32 LSE: relative error O(L * 2^-23) on every P.
"""

import math

import numpy as np
import pytest
from attention_ref import attention_backward_ref, attention_ref, round_to
from reliability_helpers import (
    DTYPE_NAMES,
    NP_DTYPES,
    ULP,
    check_backward,
    check_forward,
    check_lse,
    f32,
    max_abs,
    report,
)

pytestmark = pytest.mark.gpu

D = 64
SCALE = 1.0 / math.sqrt(D)  # 1/8, the default
LOGIT = 1.0e4


def _run(cp, q, k, v, dout, causal, softmax_scale=None):
    import cuflash2

    out, lse = cuflash2.flash_attn_forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal)
    for name, x in (("out", out), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert bool(cp.isfinite(f32(cp, x)).all()), f"{name}: non-finite values"
    assert not bool(cp.isnan(lse).any()), "NaN in the LSE"
    return out, lse, grads


def _device(cp, host, dtype):
    """Host float array -> CuPy array of the 16-bit dtype (built on the host: exact values)."""
    return cp.asarray(np.asarray(host, dtype=np.float32).astype(NP_DTYPES[dtype]))


def _normal(shape, seed, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * scale


def _visible(cp, sq, sk):
    return cp.arange(sk)[None, :] <= cp.arange(sq)[:, None] + (sk - sq)


def _lse_floors(cp, q32, k32, v32, do32, causal, scale):
    """Per-gradient error allowances (dq, dk, dv) for the two fp32-state effects of the module
    docstring, at the largest |LSE| of the problem. Zero for moderate logits, in effect."""
    ref_out, ref_lse = attention_ref(cp, q32, k32, v32, causal, scale)
    lse_max = float(cp.abs(cp.where(cp.isfinite(ref_lse), ref_lse, 0)).max())
    delta_fwd, delta_bwd = 2 * lse_max * 2.0 ** -24, 4 * lse_max * 2.0 ** -23
    group = q32.shape[2] // k32.shape[2]
    kr = cp.repeat(k32, group, axis=2)
    s = cp.einsum("bqhd,bkhd->bhqk", q32, kr) * scale
    if causal:
        s = cp.where(_visible(cp, q32.shape[1], k32.shape[1]), s, -cp.inf)
    p = cp.exp(s - ref_lse[..., None])  # rows that see nothing: exp(-inf) = 0
    d_rows = cp.abs(cp.einsum("bqhd,bqhd->bhq", do32, ref_out))  # |D|
    ref = attention_backward_ref(cp, q32, k32, v32, do32, causal, scale)
    e_q = scale * float(d_rows.max()) * float(cp.abs(k32).max())  # sum_j P_ij = 1
    e_k = scale * group * float((p * d_rows[..., None]).sum(axis=2).max()) * float(cp.abs(q32).max())
    e_v = group * float(cp.einsum("bhqk,bqhd->bkhd", p, cp.abs(do32)).max())
    return (delta_fwd * e_q + delta_bwd * float(cp.abs(ref[0]).max()),
            delta_fwd * e_k + delta_bwd * float(cp.abs(ref[1]).max()),
            delta_bwd * e_v)


def _naive_forward_exact_logits(cp, q32, k32, v32, causal, scale, dtype):
    """attention_ref's naive (input-precision) output without rounding the exact logits (rounding
    1e4 to 16 bits would move it by tens and make the baseline meaningless)."""
    rnd = (lambda x: round_to(cp, x, DTYPE_NAMES[dtype]))
    group = q32.shape[2] // k32.shape[2]
    kr, vr = cp.repeat(k32, group, axis=2), cp.repeat(v32, group, axis=2)
    s = cp.einsum("bqhd,bkhd->bhqk", q32, kr) * scale
    if causal:
        s = cp.where(_visible(cp, q32.shape[1], k32.shape[1]), s, -cp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = cp.exp(s - cp.where(cp.isfinite(m), m, 0))
    denom = p.sum(axis=-1, keepdims=True)
    p = rnd(p / cp.where(denom == 0, 1, denom))
    return rnd(cp.einsum("bhqk,bkhd->bqhd", p, vr))


def _check_out_exact_logits(cp, q, k, v, out, causal, scale, dtype, floor):
    q32, k32, v32 = (f32(cp, x) for x in (q, k, v))
    ref, _ = attention_ref(cp, q32, k32, v32, causal, scale)
    naive = _naive_forward_exact_logits(cp, q32, k32, v32, causal, scale, dtype)
    err, naive_err = max_abs(cp, f32(cp, out), ref), max_abs(cp, naive, ref)
    report("out (exact logits)", err, 2 * naive_err + floor)
    assert err <= 2 * naive_err + floor, f"out: max error {err:.3e} > 2 x naive {naive_err:.3e} + {floor:.2e}"


# ------------------------------------------------------------------------------------------------
# All-equal rows: q and k constant, so every visible logit of a row is the same number (+-1e4):
# softmax is uniform over the visible keys. Closed forms: out_i = mean of the n_i visible v,
# lse_i = logit + log(n_i), dv_j = sum over rows i seeing j of dO_i / n_i, dq = 0.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sign", [1, -1], ids=["plus1e4", "minus1e4"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_uniform_rows_with_huge_logits(dtype, sign, causal):
    import cupy as cp

    sq, sk = (301, 173) if causal else (173, 301)  # causal: rows 0..127 see no key
    b, h, hk = 2, 4, 2
    group = h // hk
    # q.k * scale = 64 * 25 * (50 * sign) / 8 = sign * 1e4 exactly (25 and 50 are exact in both dtypes)
    q = _device(cp, np.full((b, sq, h, D), 25.0), dtype)
    k = _device(cp, np.full((b, sk, hk, D), 50.0 * sign), dtype)
    v = _device(cp, _normal((b, sk, hk, D), 1), dtype)
    dout = _device(cp, _normal((b, sq, h, D), 2), dtype)
    out, lse, (dq, dk, dv) = _run(cp, q, k, v, dout, causal)

    n = np.clip(np.arange(sq) + sk - sq + 1, 0, sk) if causal else np.full(sq, sk)  # keys seen per row
    seen = n > 0
    weights = cp.asarray((np.arange(sk)[None, :] < n[:, None]) / np.maximum(n, 1)[:, None])  # P, (sq, sk)
    v64, do64 = (f32(cp, x).astype(cp.float64) for x in (v, dout))
    v_rep = cp.repeat(v64, group, axis=2)
    expected_out = cp.einsum("qk,bkhd->bqhd", weights, v_rep)
    expected_lse = cp.broadcast_to(cp.asarray(np.where(seen, sign * LOGIT + np.log(np.maximum(n, 1)), np.inf)),
                                   (b, h, sq)).astype(cp.float32)
    expected_dv = cp.einsum("qk,bqhd->bkhd", weights, do64).reshape(b, sk, hk, group, D).sum(axis=3)
    dv_terms = cp.einsum("qk,bqhd->bkhd", weights, cp.abs(do64)).reshape(b, sk, hk, group, D).sum(axis=3)

    eps = ULP[dtype]
    # out: all of a row's P are equal, so P's rounding scales the row's mean by one factor
    out64 = f32(cp, out).astype(cp.float64)
    tol_out = 2 * eps * cp.abs(expected_out) + 1e-4 * float(cp.abs(v64).max())
    report("out vs mean (worst element, relative to its tolerance)", float((cp.abs(out64 - expected_out) / tol_out).max()), 1.0)
    assert bool((cp.abs(out64 - expected_out) <= tol_out).all()), \
        f"out != mean of visible v: max error {max_abs(cp, out64, expected_out):.3e}"
    # LSE: fp32 holds 1e4 to ~1e-3; the kernel adds a few roundings of that size
    check_lse(cp, lse, expected_lse, tol=4e-6 * LOGIT + 5e-3)
    # dv: each P rebuilt from the fp32 LSE (relative error ~1e-3 at 1e4) and rounded to 16 bits
    dv64 = f32(cp, dv).astype(cp.float64)
    tol_dv = (2 * eps + 5e-3) * dv_terms + 1e-6
    report("dv vs P^T dO (worst element, relative to its tolerance)", float((cp.abs(dv64 - expected_dv) / tol_dv).max()), 1.0)
    assert bool((cp.abs(dv64 - expected_dv) <= tol_dv).all()), \
        f"dv != P^T dO: max error {max_abs(cp, dv64, expected_dv):.3e}"
    unseen = cp.asarray(~seen)
    assert bool((out64[:, unseen] == 0).all()) and bool((f32(cp, dq)[:, unseen] == 0).all()), \
        "a row that sees no key must have zero output and zero dq"
    # dq = scale * k_c * sum_j dS_ij = 0 exactly and dk has no simpler form than the reference:
    # both (and out, dv again) go through FA2's rule; the naive backward keeps the exact logits
    check_forward(cp, q, k, v, out, lse, causal, lse_tol=4e-6 * LOGIT + 5e-3)
    floors = _lse_floors(cp, *(f32(cp, x) for x in (q, k, v, dout)), causal, SCALE)
    check_backward(cp, q, k, v, dout, (dq, dk, dv), causal, extra=floors)


# ------------------------------------------------------------------------------------------------
# Shifted logits: q = [A, q'], k = [+-A, k'] with A = 100 on the first 8 columns, so every logit is
# +-1e4 + scale * q'.k'. q' and k' are multiples of 1/4 (|.| <= 2): the fp32 logits are exact,
# and softmax equals that of the small logits. FA2's rule against the fp32 references (the naive
# baseline keeps the exact logits), plus the fp32-state floors.
# ------------------------------------------------------------------------------------------------

def _quarters(shape, seed):
    return np.clip(np.round(_normal(shape, seed) * 4), -8, 8) / 4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sign", [1, -1], ids=["plus1e4", "minus1e4"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_shifted_logits_match_reference(dtype, sign, causal):
    import cupy as cp

    b, sq, sk, h, hk = 2, 203, 257, 4, 2
    q_host, k_host = _quarters((b, sq, h, D), 3), _quarters((b, sk, hk, D), 4)
    q_host[..., :8] = 100.0  # 8 * 100 * 100 * sign / 8 = sign * 1e4
    k_host[..., :8] = 100.0 * sign
    q, k = _device(cp, q_host, dtype), _device(cp, k_host, dtype)
    v = _device(cp, _normal((b, sk, hk, D), 5), dtype)
    dout = _device(cp, _normal((b, sq, h, D), 6), dtype)
    out, lse, grads = _run(cp, q, k, v, dout, causal)

    q32, k32, v32, do32 = (f32(cp, x) for x in (q, k, v, dout))
    floors = _lse_floors(cp, q32, k32, v32, do32, causal, SCALE)
    _check_out_exact_logits(cp, q, k, v, out, causal, SCALE, dtype,
                            1e-5 + 2 * LOGIT * 2.0 ** -24 * float(cp.abs(v32).max()))
    _, ref_lse = attention_ref(cp, q32, k32, v32, causal)
    check_lse(cp, lse, ref_lse, tol=4e-6 * LOGIT + 5e-3)
    # the LSE minus the shift is the LSE of the small logits: ~log(sk) + a few, not ~1e4
    assert bool((cp.abs(lse - sign * LOGIT) < 2 * math.log(sk) + 10).all())
    check_backward(cp, q, k, v, dout, grads, causal, extra=floors)


# ------------------------------------------------------------------------------------------------
# One-hot rows: integer q, k in [-64, 64] with softmax_scale = 1: the logits are exact integers
# spread over ~+-4e4, so each row's softmax is (nearly) one-hot: out is the v of the winning key.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_hot_rows_from_huge_logit_gaps(dtype, causal):
    import cupy as cp

    b, sq, sk, h = 2, 113, 203, 4
    rng = np.random.default_rng(7)
    q, k = (_device(cp, rng.integers(-64, 65, size=s), dtype) for s in ((b, sq, h, D), (b, sk, h, D)))
    v = _device(cp, _normal((b, sk, h, D), 8), dtype)
    dout = _device(cp, _normal((b, sq, h, D), 9), dtype)
    out, lse, grads = _run(cp, q, k, v, dout, causal, softmax_scale=1.0)

    q32, k32, v32, do32 = (f32(cp, x) for x in (q, k, v, dout))
    _, ref_lse = attention_ref(cp, q32, k32, v32, causal, 1.0)
    lse_max = float(cp.abs(ref_lse).max())
    assert lse_max > 1e4, "test set-up: the logits are not large"
    # the winning P is 2^r with r the fp32 rounding of the running max (|r| <~ lse_max * 2^-24 * 1.5):
    # rounded to 1 in P V but not in the row sum, it scales out by 1 - O(r)
    v_max = float(cp.abs(v32).max())
    _check_out_exact_logits(cp, q, k, v, out, causal, 1.0, dtype,
                            1e-5 + (2 * lse_max * 2.0 ** -24 + ULP[dtype] / 2) * v_max)
    check_lse(cp, lse, ref_lse, tol=4e-6 * lse_max + 5e-3)
    check_backward(cp, q, k, v, dout, grads, causal, softmax_scale=1.0,
                   extra=_lse_floors(cp, q32, k32, v32, do32, causal, 1.0))


# ------------------------------------------------------------------------------------------------
# fp16 values near the top of the range: |v| up to 6e4 (fp16 max 65504). The output is a convex
# combination of v rows, so |out| <= max|v| and nothing may overflow on the way (P V accumulates in
# fp32). dout is scaled so that the true gradients, dP (<~4e4) and dS = P (dP - D) stay in fp16.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_fp16_values_near_overflow(causal):
    import cupy as cp

    b, h = 2, 4
    sq, sk = (257, 257) if causal else (173, 301)  # causal: row 0 sees one key, row 1 two, ...
    q = _device(cp, _normal((b, sq, h, D), 10), "fp16")
    k = _device(cp, _normal((b, sk, h, D), 11), "fp16")
    v_host = np.clip(_normal((b, sk, h, D), 12, 2e4), -6e4, 6e4)
    v_host[0, 0, 0, :] = 6e4  # whole rows at the bound, both signs
    v_host[1, -1, -1, :] = -6e4
    v = _device(cp, v_host, "fp16")
    dout = _device(cp, _normal((b, sq, h, D), 13, 0.02), "fp16")
    out, lse, grads = _run(cp, q, k, v, dout, causal)

    out32, v32 = f32(cp, out), f32(cp, v)
    v_max = float(cp.abs(v32).max())
    assert v_max == 6e4
    assert float(cp.abs(out32).max()) <= v_max * (1 + ULP["fp16"]), "out is not a convex combination of v"
    if causal:  # row 0 of each head sees only key 0: out = v[0] up to the rounding of P
        assert float(cp.abs(out32[:, 0] - v32[:, 0]).max()) <= ULP["fp16"] * v_max
    check_forward(cp, q, k, v, out, lse, causal)
    check_backward(cp, q, k, v, dout, grads, causal)
