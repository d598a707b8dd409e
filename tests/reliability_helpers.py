"""Helpers shared by the reliability GPU tests (canaries, scale, concurrency, numerics).

Everything is array-module generic (`xp` is NumPy or CuPy) where it can be, so the references can
be checked on the CPU (tests/test_reliability_helpers.py) even though the tests using them need a
GPU. The tolerance rule is FA2's, as in tests/test_forward_gpu.py and tests/test_backward_gpu.py:
the kernel's max error against an fp32 reference is at most 2x (forward) / 3x (gradients) that of
the same computation done naively in the input precision, plus a small floor.
"""

import math

import ml_dtypes
import numpy as np
from attention_ref import attention_backward_ref, attention_ref, round_to

from cuflash2.materialize import as_float32

NP_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
#: Relative spacing of the 16-bit formats at 1.0 (one ulp): 2^-7 for bf16, 2^-10 for fp16.
ULP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}


def short_dtype(x) -> str:
    return "bf16" if np.dtype(x.dtype).name == "bfloat16" else "fp16"


def random_inputs(cp, shapes, dtype, seed, scale=1.0):
    """Standard-normal arrays (times `scale`) of the given shapes, made on the host, as CuPy arrays."""
    rng = np.random.default_rng(seed)
    return [cp.asarray((rng.standard_normal(s, dtype=np.float32) * scale).astype(NP_DTYPES[dtype])) for s in shapes]


def f32(cp, x):
    """float32 copy of a 16-bit CuPy array of any strides."""
    return as_float32(cp, cp.ascontiguousarray(x))


def bits(cp, x):
    """The raw bit pattern of a CuPy array as unsigned integers (contiguous copy)."""
    unsigned = {2: cp.uint16, 4: cp.uint32}[np.dtype(x.dtype).itemsize]
    return cp.ascontiguousarray(x).view(unsigned)


def same_bits(cp, a, b) -> bool:
    return a.shape == b.shape and bool((bits(cp, a) == bits(cp, b)).all())


def max_abs(xp, a, b) -> float:
    return float(xp.abs(a - b).max()) if a.size else 0.0


def report(name, err, bound):
    """Print an error against its bound (shown by pytest -rA / -s: margins for review)."""
    print(f"  {name}: error {err:.3e}  bound {bound:.3e}  ({err / bound if bound else 0:.2f} of bound)")


def scale_of(softmax_scale, head_dim):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


# ------------------------------------------------------------------------------------------------
# Whole-tensor checks with FA2's rule (references from tests/attention_ref.py)
# ------------------------------------------------------------------------------------------------

def check_forward(cp, q, k, v, out, lse, causal, softmax_scale=None, floor=1e-5, lse_tol=None):
    """Assert out/lse of attention(q, k, v) against the fp32 reference (FA2's 2x rule); no NaN."""
    q32, k32, v32 = (f32(cp, x) for x in (q, k, v))
    ref, ref_lse = attention_ref(cp, q32, k32, v32, causal, softmax_scale)
    naive, _ = attention_ref(cp, q32, k32, v32, causal, softmax_scale, low_precision=np.dtype(q.dtype).name)
    out32 = f32(cp, out)
    assert not bool(cp.isnan(out32).any()), "NaN in output"
    err, naive_err = max_abs(cp, out32, ref), max_abs(cp, naive, ref)
    report("out", err, 2 * naive_err + floor)
    assert err <= 2 * naive_err + floor, f"out: max error {err:.3e} > 2 x naive {naive_err:.3e} + {floor:.1e}"
    check_lse(cp, lse, ref_lse, lse_tol)


def check_lse(cp, lse, ref_lse, tol=None):
    """+inf exactly where the reference is +inf; elsewhere within `tol` (default: the GPU tests' rule)."""
    lse = cp.ascontiguousarray(lse)
    assert not bool(cp.isnan(lse).any()), "NaN in LSE"
    finite = cp.isfinite(ref_lse)
    assert bool((cp.isfinite(lse) == finite).all()), "LSE +inf pattern differs from reference"
    assert bool((lse[~finite] > 0).all()), "LSE of a row that sees no key must be +inf"
    err = float(cp.abs(cp.where(finite, lse, 0) - cp.where(finite, ref_lse, 0)).max()) if lse.size else 0.0
    if tol is None:
        tol = 1e-3 * max(1.0, float(cp.abs(cp.where(finite, ref_lse, 0)).max()))
    report("lse", err, tol)
    assert err <= tol, f"LSE error {err:.3e} > {tol:.3e}"


def check_backward(cp, q, k, v, dout, grads, causal, softmax_scale=None, floor=1e-4, rel_floor=0.0, extra=(0, 0, 0)):
    """Assert (dq, dk, dv) against the fp32 reference gradients (FA2's 3x rule); no NaN.

    The floor is `floor + rel_floor * max|reference| + extra[i]` for gradient i."""
    f = [f32(cp, x) for x in (q, k, v, dout)]
    ref = attention_backward_ref(cp, *f, causal, softmax_scale)
    low = np.dtype(q.dtype).name
    # attention_backward_ref sums the GQA group of the rounded dk/dv without rounding the sum: round
    # it, as the kernels must (otherwise a naive error of 0, e.g. seqlen 1 with MQA, fails the rule)
    naive = [round_to(cp, n, low) for n in attention_backward_ref(cp, *f, causal, softmax_scale, low_precision=low)]
    for name, g, r, n, e in zip(("dq", "dk", "dv"), grads, ref, naive, extra):
        g32 = f32(cp, g)
        assert not bool(cp.isnan(g32).any()), f"NaN in {name}"
        assert bool(cp.isfinite(n).all()), f"{name}: the naive reference overflowed (test set-up error)"
        err, naive_err = max_abs(cp, g32, r), max_abs(cp, n, r)
        bound = 3 * naive_err + floor + rel_floor * float(cp.abs(r).max()) + e
        report(name, err, bound)
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (naive {naive_err:.3e})"


# ------------------------------------------------------------------------------------------------
# References for one head, chunked over query rows (long sequences), with sampled gradients
# ------------------------------------------------------------------------------------------------

def _visible(xp, rows, cols, seqlen_q, seqlen_k):
    """Bottom-right-aligned causal visibility of (rows x cols) index vectors."""
    return cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q)


def head_forward_ref(xp, q, k, v, causal, scale, low_precision=None, round_logits=False, chunk=2048):
    """Attention of one head: q (sq, d), k/v (sk, d) float32 -> (out, lse, row_max, row_sum).

    fp32 reference with `low_precision=None`. With `low_precision`, P and O are rounded to that
    precision; `round_logits=True` also rounds the logits (cuflash2.checks.attention_ref's naive
    forward), `round_logits=False` does not (tests/attention_ref.attention_backward_ref's naive
    forward, whose output is what its D uses). row_max/row_sum: the max of the (possibly rounded)
    logits (0 for rows that see nothing) and sum of exp(s - row_max), what the gradients need.
    Works on row chunks so the (sq x sk) matrix never exists whole; causal chunks skip keys no
    row of the chunk sees.
    """
    sq, sk = q.shape[0], k.shape[0]
    rnd = (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)
    out = xp.zeros((sq, v.shape[1]), dtype=xp.float32)
    row_max = xp.zeros((sq,), dtype=xp.float32)
    row_sum = xp.zeros((sq,), dtype=xp.float32)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        k_end = min(sk, r1 + sk - sq) if causal else sk
        if k_end <= 0:
            continue  # no row of this chunk sees a key: out 0, sum 0
        s = (q[r0:r1] @ k[:k_end].T) * xp.float32(scale)
        if round_logits:
            s = rnd(s)
        if causal:
            s = xp.where(_visible(xp, xp.arange(r0, r1), xp.arange(k_end), sq, sk), s, -xp.inf)
        m = s.max(axis=1)
        m = xp.where(xp.isfinite(m), m, 0).astype(xp.float32)
        p = xp.exp(s - m[:, None])
        del s
        denom = p.sum(axis=1)
        p = rnd(p / xp.where(denom == 0, 1, denom)[:, None])
        out[r0:r1] = rnd(p @ v[:k_end])
        row_max[r0:r1] = m
        row_sum[r0:r1] = denom
    seen = row_sum > 0
    lse = xp.where(seen, xp.log(xp.where(seen, row_sum, 1)) + row_max, xp.inf).astype(xp.float32)
    return out, lse, row_max, row_sum


def head_backward_ref(xp, q, k, v, dout, out, row_max, row_sum, rows, cols, causal, scale, low_precision=None):
    """dq at query `rows`, dk and dv at key `cols` of one head, as tests/attention_ref.py's
    attention_backward_ref computes them (every intermediate rounded with `low_precision`).

    out, row_max, row_sum: from head_forward_ref with the same `low_precision` (and
    round_logits=False): D = rowsum(dout * out) uses that output, as the reference does.
    rows/cols: integer index arrays.
    """
    sq, sk = q.shape[0], k.shape[0]
    rnd = (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)
    denom = xp.where(row_sum == 0, 1, row_sum)
    delta = (dout * out).sum(axis=1)
    all_rows, all_cols = xp.arange(sq), xp.arange(sk)

    def probs(row_idx, col_idx):
        s = (q[row_idx] @ k[col_idx].T) * xp.float32(scale)
        if causal:
            s = xp.where(_visible(xp, row_idx, col_idx, sq, sk), s, -xp.inf)
        return rnd(xp.exp(s - row_max[row_idx][:, None]) / denom[row_idx][:, None])

    p_rows = probs(rows, all_cols)  # (len(rows), sk)
    dp_rows = rnd(dout[rows] @ v.T)
    ds_rows = rnd(p_rows * (dp_rows - delta[rows][:, None]))
    dq = rnd((ds_rows @ k) * xp.float32(scale))

    p_cols = probs(all_rows, cols)  # (sq, len(cols))
    dv = rnd(p_cols.T @ dout)
    dp_cols = rnd(dout @ v[cols].T)
    ds_cols = rnd(p_cols * (dp_cols - delta[:, None]))
    dk = rnd((ds_cols.T @ q) * xp.float32(scale))
    return dq.astype(xp.float32), dk.astype(xp.float32), dv.astype(xp.float32)


def sample_indices(n, count, seed, block=128):
    """Sorted unique indices in [0, n): both ends, both sides of the first and last block
    boundaries, and random ones (fixed seed)."""
    fixed = {0, 1, n - 1, n - 2, block - 1, block, n // 2, (n // block) * block - 1, (n // block) * block}
    rng = np.random.default_rng(seed)
    picks = {int(i) for i in rng.choice(n, size=min(n, count), replace=False)}
    return np.array(sorted(i for i in fixed | picks if 0 <= i < n), dtype=np.int64)


def fill_normal(cp, x, seed, scale=1.0, chunk=1 << 27):
    """Fill a contiguous fp16/bf16 CuPy array with standard-normal values (times `scale`) made on the
    device, in chunks (arrays of several GiB: no host round trip, bounded temporaries). bf16 values
    are rounded to nearest from fp32."""
    assert x.flags.c_contiguous
    rs = cp.random.RandomState(seed)
    flat = x.view(cp.uint16).reshape(-1)
    bf16 = np.dtype(x.dtype).name == "bfloat16"
    for start in range(0, flat.size, chunk):
        n = min(chunk, flat.size - start)
        values = rs.standard_normal(n, dtype=np.float32)
        if scale != 1.0:
            values *= np.float32(scale)
        if bf16:
            flat[start:start + n] = (round_to(cp, values, "bfloat16").view(cp.uint32) >> 16).astype(cp.uint16)
        else:
            flat[start:start + n] = values.astype(cp.float16).view(cp.uint16)
        del values
    return x



def backward_is_reproducible(dtype: str, head_dim: int, nheads: int, nheads_kv: int, causal: bool) -> bool:
    """Whether the default backward plan on GPU 0 gives bit-identical gradients run to run: true
    unless the main kernel adds dQ with fp32 reductions in a varying order (the sm_90 fused plan)."""
    from cuflash2.families import mma_sync as config
    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher

    plan = config.backward_plan(head_dim, launch.SHORT_DTYPE.get(dtype, dtype), causal, launch.device_arch(0), gqa=nheads != nheads_kv)
    return plan.dq is not None
