"""Tests for cuflash2.reference: the NumPy ground truth the CUDA kernels are checked against.

CPU-only and fast.  The naive float64 code is checked against an independent loop
implementation and finite differences; the tiled float32 code (which mirrors the
kernels' scheduling) is checked against the naive code on awkward shapes.
"""

import math

import numpy as np
import pytest

from cuflash2 import reference as ref

ml_dtypes = pytest.importorskip("ml_dtypes")


# ------------------------------------------------------------------------- helpers


def make_qkv(rng, b, sq, sk, hq, hk, d, dtype=np.float32):
    """Random q (b,sq,hq,d), k/v (b,sk,hk,d) in dtype."""
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return q, k, v


def slopes_for(rng, b, hq, per_batch=False):
    """ALiBi slopes of shape (hq,) or (b, hq), float32."""
    shape = (b, hq) if per_batch else (hq,)
    return rng.uniform(0.02, 0.5, size=shape).astype(np.float32)


def loop_attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                   slopes=None):
    """Independent scalar-loop attention written straight from the definitions."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window[0], (0 if causal else window[1])
    shift = sk - sq
    out = np.zeros((b, sq, hq, d))
    lse = np.zeros((b, hq, sq))
    for bi in range(b):
        for h in range(hq):
            kvh = h // (hq // hk)
            slope = None if slopes is None else np.broadcast_to(slopes, (b, hq))[bi, h]
            for i in range(sq):
                idx, logits = [], []
                for j in range(sk):
                    if left >= 0 and j < i + shift - left:
                        continue
                    if right >= 0 and j > i + shift + right:
                        continue
                    x = scale * float(np.dot(q[bi, i, h].astype(np.float64),
                                             k[bi, j, kvh].astype(np.float64)))
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slope is not None:
                        x -= float(slope) * abs(i + shift - j)
                    idx.append(j)
                    logits.append(x)
                if not logits:
                    lse[bi, h, i] = math.inf
                    continue
                mx = max(logits)
                w = [math.exp(x - mx) for x in logits]
                z = sum(w)
                for wj, j in zip(w, idx):
                    out[bi, i, h] += wj / z * v[bi, j, kvh].astype(np.float64)
                lse[bi, h, i] = mx + math.log(z)
    return out, lse


def kwargs_for(rng, cfg, b, hq):
    """Turn a test config dict into keyword arguments for the attention functions."""
    kw = {key: val for key, val in cfg.items() if key not in ("alibi", "alibi_b")}
    if cfg.get("alibi") or cfg.get("alibi_b"):
        kw["alibi_slopes"] = slopes_for(rng, b, hq, per_batch=bool(cfg.get("alibi_b")))
    return kw


def grad_atol(g):
    """Absolute tolerance for fp32 gradients: 1e-4 of their scale (at least 1e-4).

    The floor covers exactly-zero float64 gradients (e.g. dq when sk == 1, where the
    softmax is constant) that fp32 only reproduces up to rounding.
    """
    return 1e-4 * max(float(np.abs(g).max()), 1.0)


def rel_err(a, b):
    """max |a - b| / max |b| over finite entries."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ------------------------------------------------------------------------- masks


def test_visible_mask_hand_built():
    T, F = True, False
    # sq < sk: bottom-right alignment shifts the diagonal right by sk - sq = 2.
    np.testing.assert_array_equal(ref.visible_mask(3, 5, causal=True), [
        [T, T, T, F, F],
        [T, T, T, T, F],
        [T, T, T, T, T]])
    # sq > sk: the first sq - sk = 2 rows see nothing.
    np.testing.assert_array_equal(ref.visible_mask(5, 3, causal=True), [
        [F, F, F],
        [F, F, F],
        [T, F, F],
        [T, T, F],
        [T, T, T]])
    np.testing.assert_array_equal(ref.visible_mask(3, 5, window_size=(1, 1)), [
        [F, T, T, T, F],
        [F, F, T, T, T],
        [F, F, F, T, T]])
    np.testing.assert_array_equal(ref.visible_mask(4, 4, window_size=(1, 0)), [
        [T, F, F, F],
        [T, T, F, F],
        [F, T, T, F],
        [F, F, T, T]])
    # causal forces right = 0 whatever the window says, and keeps the left bound.
    np.testing.assert_array_equal(ref.visible_mask(4, 4, causal=True, window_size=(1, 2)),
                                  ref.visible_mask(4, 4, window_size=(1, 0)))
    assert ref.visible_mask(5, 3).all()
    assert ref.visible_mask(3, 5, causal=True).shape == (3, 5)


SWEEP_WINDOWS = [(-1, -1), (0, 0), (2, 1), (3, -1), (-1, 2), (0, -1), (5, 0), (1, 4)]


def tile_stats(sq, sk, block_m, block_n, causal, window):
    """Per-tile (any visible, all visible) by brute force from visible_mask.

    "All visible" looks at in-bounds rows only and counts columns >= sk as invisible,
    which is the definition block_needs_mask implements.
    """
    vis = ref.visible_mask(sq, sk, causal, window)
    nm, nn = -(-sq // block_m), -(-sk // block_n)
    any_pad = np.zeros((nm * block_m, nn * block_n), bool)
    any_pad[:sq, :sk] = vis
    all_pad = np.ones_like(any_pad)
    all_pad[:sq] = False
    all_pad[:sq, :sk] = vis
    any_vis = any_pad.reshape(nm, block_m, nn, block_n).any(axis=(1, 3))
    all_vis = all_pad.reshape(nm, block_m, nn, block_n).all(axis=(1, 3))
    return any_vis, all_vis


def as_flags(lo_hi, n):
    """Bool vector of length n that is True on [lo, hi)."""
    lo, hi = lo_hi
    assert 0 <= lo and hi <= n, (lo_hi, n)
    flags = np.zeros(n, bool)
    flags[lo:hi] = True
    return flags


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(1, 1), (2, 3), (4, 4), (5, 2), (8, 16)])
def test_block_helpers_brute_force(causal, block_m, block_n):
    for sq in range(1, 14):
        for sk in range(1, 14):
            for window in SWEEP_WINDOWS:
                any_vis, all_vis = tile_stats(sq, sk, block_m, block_n, causal, window)
                nm, nn = any_vis.shape
                args = (block_m, block_n, sq, sk, causal, window)
                ctx = (sq, sk, window)
                for m in range(nm):
                    # The key range is exactly the set of tiles with a visible entry.
                    in_range = as_flags(ref.key_block_range(m, *args), nn)
                    np.testing.assert_array_equal(in_range, any_vis[m], err_msg=str(ctx))
                    needs = np.array([ref.block_needs_mask(m, n, *args) for n in range(nn)])
                    np.testing.assert_array_equal(needs, ~all_vis[m], err_msg=str(ctx))
                    assert in_range[~needs].all(), ctx
                for n in range(nn):
                    in_range = as_flags(ref.query_block_range(n, *args), nm)
                    np.testing.assert_array_equal(in_range, any_vis[:, n], err_msg=str(ctx))


def test_block_ranges_examples():
    # Causal 128 x 128 with 64 x 64 tiles: block 0 sees key block 0 only, block 1 both.
    assert ref.key_block_range(0, 64, 64, 128, 128, True) == (0, 1)
    assert ref.key_block_range(1, 64, 64, 128, 128, True) == (0, 2)
    assert ref.query_block_range(1, 64, 64, 128, 128, True) == (1, 2)
    assert ref.block_needs_mask(1, 1, 64, 64, 128, 128, True)
    assert not ref.block_needs_mask(1, 0, 64, 64, 128, 128, True)
    # Ragged keys force masking even without causal/window.
    assert ref.block_needs_mask(0, 1, 64, 64, 64, 100, False)
    # Causal with sq > sk: the first query block sees nothing at all.
    lo, hi = ref.key_block_range(0, 64, 64, 200, 100, True)
    assert lo >= hi


# ------------------------------------------------------------------ naive forward


LOOP_CASES = [
    dict(b=2, sq=5, sk=7, hq=2, hk=2, d=8, cfg={}),
    dict(b=2, sq=5, sk=7, hq=2, hk=2, d=8, cfg=dict(causal=True)),
    dict(b=1, sq=7, sk=4, hq=2, hk=1, d=8, cfg=dict(causal=True)),
    dict(b=2, sq=6, sk=6, hq=4, hk=2, d=8, cfg=dict(window_size=(2, 1))),
    dict(b=1, sq=4, sk=9, hq=2, hk=2, d=16, cfg=dict(causal=True, window_size=(3, -1))),
    dict(b=2, sq=5, sk=5, hq=2, hk=2, d=8, cfg=dict(softcap=2.0, softmax_scale=1.0)),
    dict(b=2, sq=6, sk=8, hq=4, hk=4, d=8, cfg=dict(alibi_b=True, causal=True)),
    dict(b=1, sq=8, sk=5, hq=3, hk=1, d=8, cfg=dict(alibi=True, window_size=(1, 2))),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: str(c["cfg"]) + f"{c['sq']}x{c['sk']}")
def test_naive_matches_loop_reference(case):
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, case["b"], case["sq"], case["sk"], case["hq"], case["hk"],
                       case["d"], np.float64)
    kw = kwargs_for(rng, case["cfg"], case["b"], case["hq"])
    out, lse = ref.attention_naive(q, k, v, **kw)
    exp_out, exp_lse = loop_attention(q, k, v, kw.get("softmax_scale"), kw.get("causal", False),
                                      kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                                      kw.get("alibi_slopes"))
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert out.shape == q.shape and lse.shape == (case["b"], case["hq"], case["sq"])
    np.testing.assert_allclose(out, exp_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, exp_lse, rtol=1e-12, atol=1e-12)


def test_naive_default_scale_and_softcap_effect():
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, 1, 6, 6, 2, 2, 16, np.float64)
    base = ref.attention_naive(q, k, v)[0]
    np.testing.assert_array_equal(base, ref.attention_naive(q, k, v, softmax_scale=0.25)[0])
    capped = ref.attention_naive(q, k, v, softmax_scale=1.0, softcap=1.0)[0]
    assert rel_err(capped, ref.attention_naive(q, k, v, softmax_scale=1.0)[0]) > 1e-2


# ------------------------------------------------------------------ tiled forward


SHAPES = [(1, 1), (1, 37), (37, 1), (113, 203), (203, 113), (64, 64), (65, 129)]
CONFIGS = [
    dict(),
    dict(causal=True),
    dict(window_size=(16, 0)),
    dict(window_size=(7, 3)),
    dict(causal=True, window_size=(5, -1)),
    dict(softcap=30.0, softmax_scale=1.0),
    dict(alibi=True),
    dict(alibi_b=True, causal=True, window_size=(20, -1)),
]
HEADS = [(2, 2), (4, 2), (4, 1)]
DIMS = [8, 40, 72]
BLOCKS = [(64, 64), (16, 32), (32, 16), (128, 64), (48, 80)]


def tiled_cases():
    """Shapes x configs, rotating heads / head dims / block sizes so all get covered."""
    cases = []
    for si, (sq, sk) in enumerate(SHAPES):
        for ci, cfg in enumerate(CONFIGS):
            idx = si * len(CONFIGS) + ci
            hq, hk = HEADS[idx % len(HEADS)]
            bm, bn = BLOCKS[idx % len(BLOCKS)]
            d = DIMS[(idx // len(HEADS)) % len(DIMS)]
            case = dict(sq=sq, sk=sk, hq=hq, hk=hk, d=d, block_m=bm, block_n=bn, cfg=cfg)
            cases.append(pytest.param(case, id=f"{sq}x{sk}-h{hq}/{hk}-d{d}-b{bm}x{bn}-{cfg}"))
    return cases


def run_case(case, seed, dtype=np.float32):
    """Inputs and keyword args for one tiled test case."""
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, 2, case["sq"], case["sk"], case["hq"], case["hk"], case["d"], dtype)
    return q, k, v, kwargs_for(rng, case["cfg"], 2, case["hq"])


@pytest.mark.parametrize("case", tiled_cases())
def test_tiled_forward_matches_naive(case):
    q, k, v, kw = run_case(case, 2)
    out_n, lse_n = ref.attention_naive(q, k, v, **kw)
    out_t, lse_t = ref.attention_tiled(q, k, v, block_m=case["block_m"],
                                       block_n=case["block_n"], **kw)
    assert out_t.dtype == np.float32 and lse_t.dtype == np.float32
    assert out_t.shape == q.shape and lse_t.shape == lse_n.shape
    assert not np.isnan(out_t).any() and not np.isnan(lse_t).any()
    np.testing.assert_allclose(out_t, out_n, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_t, lse_n, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_tiled_accepts_any_float_dtype(dtype):
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 2, 33, 47, 4, 2, 40, dtype)
    out_n, lse_n = ref.attention_naive(q, k, v, causal=True)
    out_t, lse_t = ref.attention_tiled(q, k, v, causal=True, block_m=16, block_n=32)
    assert out_t.dtype == np.float32
    np.testing.assert_allclose(out_t, out_n, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse_t, lse_n, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p_dtype,limit", [(np.float16, 2e-3), (ml_dtypes.bfloat16, 1e-2)])
def test_p_dtype_rounding(p_dtype, limit):
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, 2, 65, 129, 2, 2, 40)
    out_n, lse_n = ref.attention_naive(q, k, v, causal=True)
    out_t, lse_t = ref.attention_tiled(q, k, v, causal=True, p_dtype=p_dtype)
    fp32_err = rel_err(ref.attention_tiled(q, k, v, causal=True)[0], out_n)
    err = rel_err(out_t, out_n)
    # Rounding P must show (well above plain fp32 error) yet stay small.
    assert max(1e-5, 10 * fp32_err) < err < limit, (err, fp32_err)
    # lse uses the fp32 row sum, so it is unaffected by the rounding of P.
    np.testing.assert_allclose(lse_t, lse_n, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- the reference's slack


def _climbing_keys(rng, profile, sk=300, d=32):
    """q, k, v whose scores grow towards the first keys, which the kernel order visits last:
    by less than the Hopper slack per block ("ramp") or by far more at the end ("jump")."""
    q, k, v = make_qkv(rng, 2, 70, sk, 4, 2, d)
    position = np.arange(sk, dtype=np.float32) / sk
    gain = 1 + 6 * (1 - position) if profile == "ramp" else np.where(position < 0.05, 40.0, 1.0)
    return q, (k * gain[None, :, None, None]).astype(np.float32), v


@pytest.mark.parametrize("profile", ["random", "ramp", "jump"])
@pytest.mark.parametrize("cfg", [dict(), dict(causal=True), dict(window_size=(260, 7))])
def test_the_hopper_slack_gives_the_exact_result(profile, cfg):
    """A row's reference for the exponentials may lag its maximum by up to the slack: the row
    sum and the LSE are taken against the same reference, so out and lse match the float64
    ground truth as closely as the exact running maximum does, with scores that climb block
    after block by less than the slack or jump far above it."""
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 2, 70, 300, 4, 2, 32) if profile == "random" else _climbing_keys(rng, profile)
    out_n, lse_n = ref.attention_naive(q, k, v, **cfg)
    for slack in (0.0, ref.HOPPER_RESCALE_SLACK):
        out_t, lse_t = ref.attention_tiled(q, k, v, block_m=32, block_n=16, rescale_slack=slack, **cfg)
        assert np.isfinite(out_t).all()
        np.testing.assert_allclose(out_t, out_n, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse_t, lse_n, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("profile", ["random", "ramp", "jump"])
def test_the_hopper_slack_with_bf16_probabilities_meets_fa2s_rule(profile):
    """With the slack, a block's largest probability is 2^x for some x in [0, 8] rather than
    exactly 1, so it carries a rounding error of its own when P is rounded to bf16 for P V: in
    rows dominated by a few keys the output's error grows (here up to 2-3x that of the exact
    maximum; 0.0030 -> 0.0078 for "ramp") but stays far within FA2's rule, twice the error of
    the same attention computed naively in bf16 (0.117 there)."""
    from cuflash2.checks import attention_ref

    rng = np.random.default_rng(12)
    q, k, v = make_qkv(rng, 2, 70, 300, 4, 2, 32) if profile == "random" else _climbing_keys(rng, profile)
    q, k, v = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v))  # what a kernel gets
    out_n, _ = ref.attention_naive(q, k, v, causal=True)
    naive_bf16, _ = attention_ref(np, q, k, v, causal=True, low_precision="bfloat16")
    out_t, out_exact = (ref.attention_tiled(q, k, v, causal=True, block_n=16, p_dtype=ml_dtypes.bfloat16,
                                            rescale_slack=slack)[0] for slack in (ref.HOPPER_RESCALE_SLACK, 0.0))
    err, naive_err = (float(np.abs(x - out_n).max()) for x in (out_t, naive_bf16))
    assert err <= 2 * naive_err + 1e-5, (err, naive_err)
    # The references lag (probabilities above 1 round differently): not the exact maximum's output.
    # (After a jump the rows are the jumped-to keys', whose reference is then exact.)
    assert profile == "jump" or not np.array_equal(out_t, out_exact)


def test_the_reference_slack_is_the_hopper_kernels():
    """HOPPER_RESCALE_SLACK mirrors kReferenceSlack in the Hopper forward's source."""
    import re

    from cuflash2.runtime import compiler

    source = compiler.kernel_dir() / "wgmma" / "flash_fwd_sm90.cu"
    found = re.search(r"constexpr float kReferenceSlack = ([0-9.]+)f;", source.read_text())
    assert found and float(found.group(1)) == ref.HOPPER_RESCALE_SLACK


def test_numpy_scalars_are_a_rescale_slack_too():
    q, k, v = make_qkv(np.random.default_rng(14), 1, 8, 8, 1, 1, 8)
    expected = ref.attention_tiled(q, k, v, rescale_slack=8.0)
    for slack in (np.float32(8), np.int64(8), 8):
        out, lse = ref.attention_tiled(q, k, v, rescale_slack=slack)
        np.testing.assert_array_equal(out, expected[0])


@pytest.mark.parametrize("bad", [-1.0, 16.0, float("nan"), float("inf"), "8", True])
def test_a_bad_rescale_slack_is_refused(bad):
    q, k, v = make_qkv(np.random.default_rng(13), 1, 8, 8, 1, 1, 8)
    with pytest.raises(ValueError, match="rescale_slack"):
        ref.attention_tiled(q, k, v, rescale_slack=bad)


# -------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (3, 2), (4, 8)])
@pytest.mark.parametrize("cfg,sq,sk", [
    (dict(causal=True), 9, 4),            # rows 0..4 see nothing
    (dict(window_size=(2, 1)), 10, 3),    # rows 0..5 see nothing
    (dict(causal=True, alibi=True), 70, 3),  # a whole 64-row block sees nothing
])
def test_fully_masked_rows(cfg, sq, sk, block_m, block_n):
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 2, sq, sk, 4, 2, 8)
    kw = kwargs_for(rng, cfg, 2, 4)
    empty = ~ref.visible_mask(sq, sk, kw.get("causal", False),
                              kw.get("window_size", (-1, -1))).any(axis=1)
    assert empty.any() and not empty.all()
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out_n, lse_n = ref.attention_naive(q, k, v, **kw)
    out_t, lse_t = ref.attention_tiled(q, k, v, block_m=block_m, block_n=block_n, **kw)
    grads_n = ref.attention_backward_naive(dout, q, k, v, out_n, lse_n, **kw)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out_t, lse_t, block_m=block_m,
                                           block_n=block_n, **kw)
    for out, lse in ((out_n, lse_n), (out_t, lse_t)):
        assert (out[:, empty] == 0).all()
        assert np.isposinf(lse[:, :, empty]).all()
        assert np.isfinite(lse[:, :, ~empty]).all()
        assert not np.isnan(out).any()
    for dq, dk, dv in (grads_n, grads_t):
        assert (dq[:, empty] == 0).all()
        assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    for gn, gt in zip(grads_n, grads_t):
        np.testing.assert_allclose(gt, gn, rtol=1e-4, atol=grad_atol(gn))


def test_unseen_keys_get_zero_gradients():
    # Causal with a left window of 1 and sq < sk: keys 0..4 are seen by no row.
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, 1, 3, 9, 2, 2, 8)
    kw = dict(causal=True, window_size=(1, -1))
    unseen = ~ref.visible_mask(3, 9, **kw).any(axis=0)
    assert unseen.sum() == 5
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = ref.attention_tiled(q, k, v, block_m=2, block_n=2, **kw)
    for fn, extra in ((ref.attention_backward_naive, {}),
                      (ref.attention_backward_tiled, dict(block_m=2, block_n=2))):
        _, dk, dv = fn(dout, q, k, v, out, lse, **kw, **extra)
        assert (dk[:, unseen] == 0).all() and (dv[:, unseen] == 0).all()
        assert (np.abs(dv[:, ~unseen]) > 0).all()


def test_backward_treats_infinite_lse_as_empty_row():
    # Contract shared with the kernel: lse = +inf means "this row has P = 0".
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 1, 6, 5, 2, 2, 8)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = ref.attention_naive(q, k, v)
    lse[:, :, 2] = np.inf
    out[:, 2] = 0
    for fn in (ref.attention_backward_naive, ref.attention_backward_tiled):
        dq, dk, dv = fn(dout, q, k, v, out, lse)
        assert (dq[:, 2] == 0).all() and (np.abs(dq[:, 3]) > 0).all()
        assert all(np.isfinite(g).all() for g in (dq, dk, dv))


# -------------------------------------------------------------------- backward


def numeric_grads(q, k, v, weight, kw, eps=1e-5):
    """Central finite differences of sum(out * weight) w.r.t. q, k, v (float64)."""
    def loss(qq, kk, vv):
        return float((ref.attention_naive(qq, kk, vv, **kw)[0] * weight).sum())

    grads = []
    for which in range(3):
        tensors = [q.copy(), k.copy(), v.copy()]
        x = tensors[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            up = loss(*tensors)
            x[idx] = orig - eps
            down = loss(*tensors)
            x[idx] = orig
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


FD_CASES = [
    dict(b=2, sq=5, sk=6, hq=2, hk=2, cfg={}),
    dict(b=1, sq=4, sk=7, hq=2, hk=2, cfg=dict(causal=True)),
    dict(b=2, sq=7, sk=4, hq=1, hk=1, cfg=dict(causal=True)),
    dict(b=1, sq=6, sk=6, hq=2, hk=2, cfg=dict(window_size=(2, 1))),
    dict(b=2, sq=5, sk=5, hq=2, hk=2, cfg=dict(softcap=1.5, softmax_scale=1.0)),
    dict(b=1, sq=6, sk=7, hq=2, hk=2, cfg=dict(alibi=True, causal=True)),
    dict(b=2, sq=5, sk=6, hq=4, hk=2, cfg={}),
    dict(b=1, sq=5, sk=6, hq=3, hk=1, cfg=dict(causal=True, softcap=2.0)),
]


@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: f"{c['sq']}x{c['sk']}-h{c['hq']}/{c['hk']}-{c['cfg']}")
def test_backward_naive_matches_finite_differences(case):
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, case["b"], case["sq"], case["sk"], case["hq"], case["hk"], 8,
                       np.float64)
    kw = kwargs_for(rng, case["cfg"], case["b"], case["hq"])
    weight = rng.standard_normal(q.shape)
    out, lse = ref.attention_naive(q, k, v, **kw)
    grads = ref.attention_backward_naive(weight, q, k, v, out, lse, **kw)
    for name, g, gn, x in zip("qkv", grads, numeric_grads(q, k, v, weight, kw), (q, k, v)):
        assert g.shape == x.shape and g.dtype == np.float64, name
        np.testing.assert_allclose(g, gn, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("case", tiled_cases())
def test_tiled_backward_matches_naive(case):
    q, k, v, kw = run_case(case, 8)
    dout = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    out, lse = ref.attention_naive(q, k, v, **kw)
    grads_n = ref.attention_backward_naive(dout, q, k, v, out, lse, **kw)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out, lse, block_m=case["block_m"],
                                           block_n=case["block_n"], **kw)
    for name, gn, gt in zip("qkv", grads_n, grads_t):
        assert gt.dtype == np.float32 and gt.shape == gn.shape, name
        assert not np.isnan(gt).any(), name
        np.testing.assert_allclose(gt, gn, rtol=1e-4, atol=grad_atol(gn),
                                   err_msg=name)


def test_tiled_backward_from_tiled_forward():
    # The kernel chain: fp32 forward output and lse feed the fp32 backward.
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, 2, 77, 51, 4, 1, 40)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(causal=True, softcap=30.0, alibi_slopes=slopes_for(rng, 2, 4))
    out_t, lse_t = ref.attention_tiled(q, k, v, block_m=32, block_n=16, **kw)
    grads_t = ref.attention_backward_tiled(dout, q, k, v, out_t, lse_t, block_m=16,
                                           block_n=32, **kw)
    out_n, lse_n = ref.attention_naive(q, k, v, **kw)
    grads_n = ref.attention_backward_naive(dout, q, k, v, out_n, lse_n, **kw)
    for gn, gt in zip(grads_n, grads_t):
        np.testing.assert_allclose(gt, gn, rtol=1e-4, atol=grad_atol(gn))
