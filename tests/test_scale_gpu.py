"""Scale: tensors over 2^31 elements (64-bit offsets), 128k-token sequences, and peak device memory
growing linearly with the sequence length.

These tests allocate tens of GiB (an H200 holds them) and take about a minute in all. Outputs are
passed in pre-filled with NaN, so "every element finite" also proves every element was written.
References are fp32 CuPy computations of one head at a time, chunked over query rows
(reliability_helpers.head_forward_ref / head_backward_ref, checked on the CPU by
test_reliability_helpers.py), with FA2's tolerance rule. Run with -s (or -rA) to see the tables.
"""

import gc
import math

import numpy as np
import pytest
from reliability_helpers import (
    NP_DTYPES,
    f32,
    fill_normal,
    head_backward_ref,
    head_forward_ref,
    max_abs,
    report,
    sample_indices,
)

pytestmark = pytest.mark.gpu

INT32_LIMIT = 2 ** 31


@pytest.fixture
def cp():
    """CuPy, with every cached block of its pool handed back after the test (tens of GiB here)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    yield cupy
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


def _releasing_memory(body, *args):
    """Run a test body holding tens of GiB; a failure is reported without the body's frames (a kept
    traceback would pin the arrays, and the next large test would run out of memory)."""
    message = None
    try:
        body(*args)
    except AssertionError as exc:
        message = str(exc)
    if message is not None:
        gc.collect()
        pytest.fail(message, pytrace=False)


def _alloc(cp, shape, dtype, layout="bshd", seed=None):
    """(batch, seqlen, nheads, head_dim) array stored as `layout` ("bhsd": a transposed view whose
    head stride exceeds its row stride), filled with standard-normal values (`seed`) or NaN."""
    b, s, h, d = shape
    base = cp.empty((b, s, h, d) if layout == "bshd" else (b, h, s, d), dtype=dtype)
    if seed is not None:
        fill_normal(cp, base, seed)
    else:
        base.view(cp.uint16).fill(0x7E00 if np.dtype(dtype).name == "float16" else 0x7FC0)  # NaN
    return base if layout == "bshd" else base.transpose(0, 2, 1, 3)


def _all_finite(cp, x) -> bool:
    """Every element of a huge fp16/bf16 array finite (exponent bits not all ones), checked on the
    raw bits (no bf16 arithmetic needed), one batch entry and 256 heads at a time."""
    exponent = 0x7C00 if np.dtype(x.dtype).name == "float16" else 0x7F80
    for b in range(x.shape[0]):
        for h0 in range(0, x.shape[2], 256):
            raw = cp.ascontiguousarray(x[b, :, h0:h0 + 256]).view(cp.uint16)
            if bool(((raw & exponent) == exponent).any()):
                return False
    return True


def _run_checked(cp, q, k, v, dout, causal, layout):
    """forward_into + flash_attn_backward into NaN-filled outputs of the same layout as the inputs."""
    import cuflash2
    from attention_ref import forward_into

    dtype = q.dtype
    out = _alloc(cp, q.shape, dtype, layout)
    lse = cp.full((q.shape[0], q.shape[2], q.shape[1]), cp.nan, dtype=cp.float32)
    forward_into(q, k, v, out, lse, causal=causal)
    grads = tuple(_alloc(cp, x.shape, dtype, layout) for x in (q, k, v))
    result = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                          dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(r is g for r, g in zip(result, grads))
    cp.cuda.Device().synchronize()
    return out, lse, grads


def _check_heads(cp, tensors, heads, causal, rows=None, cols=None):
    """FA2's rule on the sampled (batch, head) pairs: out and LSE on every row, dq on `rows`, dk and
    dv on `cols` (default: all). Errors are maxima over all sampled heads, as in the other GPU
    tests. Gradient floor: 1e-5 + 1e-3 * max|reference| (gradients shrink like 1/sqrt(seqlen))."""
    q, k, v, dout, out, lse, dq, dk, dv = tensors
    seqlen_q, seqlen_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim)
    low = np.dtype(q.dtype).name
    rows = cp.arange(seqlen_q) if rows is None else cp.asarray(rows)
    cols = cp.arange(seqlen_k) if cols is None else cp.asarray(cols)
    err = {name: 0.0 for name in ("out", "lse", "dq", "dk", "dv")}
    naive_err, ref_max = dict(err), dict(err)
    for b, h in heads:
        qh, kh, vh, doh = (f32(cp, x[b, :, h, :]) for x in (q, k, v, dout))
        ref_out, ref_lse, row_max, row_sum = head_forward_ref(cp, qh, kh, vh, causal, scale)
        naive_out, _, _, _ = head_forward_ref(cp, qh, kh, vh, causal, scale, low, round_logits=True)
        err["out"] = max(err["out"], max_abs(cp, f32(cp, out[b, :, h, :]), ref_out))
        naive_err["out"] = max(naive_err["out"], max_abs(cp, naive_out, ref_out))
        del naive_out
        got_lse = lse[b, h]
        assert bool((cp.isfinite(got_lse) == cp.isfinite(ref_lse)).all()), f"LSE +inf pattern, head {(b, h)}"
        finite = cp.isfinite(ref_lse)
        err["lse"] = max(err["lse"], float(cp.abs(cp.where(finite, got_lse, 0) - cp.where(finite, ref_lse, 0)).max()))
        ref_max["lse"] = max(ref_max["lse"], float(cp.abs(cp.where(finite, ref_lse, 0)).max()))
        ref_g = head_backward_ref(cp, qh, kh, vh, doh, ref_out, row_max, row_sum, rows, cols, causal, scale)
        del ref_out
        nb_out, _, nb_max, nb_sum = head_forward_ref(cp, qh, kh, vh, causal, scale, low)
        naive_g = head_backward_ref(cp, qh, kh, vh, doh, nb_out, nb_max, nb_sum, rows, cols, causal, scale, low)
        got = (f32(cp, dq[b, :, h, :])[rows], f32(cp, dk[b, :, h, :])[cols], f32(cp, dv[b, :, h, :])[cols])
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref_g, naive_g):
            err[name] = max(err[name], max_abs(cp, g, r))
            naive_err[name] = max(naive_err[name], max_abs(cp, n, r))
            ref_max[name] = max(ref_max[name], float(cp.abs(r).max()))
    bound = 2 * naive_err["out"] + 1e-5
    report("out", err["out"], bound)
    assert err["out"] <= bound, f"out: max error {err['out']:.3e} > 2 x naive {naive_err['out']:.3e}"
    lse_tol = 1e-3 * max(1.0, ref_max["lse"])
    report("lse", err["lse"], lse_tol)
    assert err["lse"] <= lse_tol, f"LSE error {err['lse']:.3e}"
    for name in ("dq", "dk", "dv"):
        bound = 3 * naive_err[name] + 1e-5 + 1e-3 * ref_max[name]
        report(name, err[name], bound)
        assert err[name] <= bound, f"{name}: max error {err[name]:.3e} > bound {bound:.3e} (naive {naive_err[name]:.3e})"


# ------------------------------------------------------------------------------------------------
# (a) more than 2^31 elements per tensor: every offset a kernel computes past element 2^31 must be
# 64-bit. Three layouts put the large part of the offset in the batch term, the row term, and the
# head term. Over 2^31 elements of fp16 is > 4 GiB a tensor; q, k, v, dout, out, dq, dk, dv ~40 GiB.
# ------------------------------------------------------------------------------------------------

LARGE = {  # name: (batch, seqlen, nheads, head_dim, layout, causal, sampled (batch, head) pairs)
    # batch stride 1200 * 2048 * 128 = 314,572,800: batch 7 starts at 2,202,009,600 > 2^31
    "batch-offset": (8, 1200, 2048, 128, "bshd", False, [(0, 0), (6, 2047), (7, 0), (7, 1023), (7, 2047)]),
    # row stride 2048 * 128 = 262,144: rows >= 8192 lie past 2^31 in every head
    "row-offset": (1, 8448, 2048, 128, "bshd", True, [(0, 0), (0, 1), (0, 1023), (0, 2047)]),
    # stored (batch, head, row, dim): head stride 8448 * 128 = 1,081,344, heads >= 1986 past 2^31
    "head-offset": (1, 8448, 2048, 128, "bhsd", False, [(0, 0), (0, 1985), (0, 1986), (0, 2047)]),
}


@pytest.mark.parametrize("name", list(LARGE))
def test_tensors_over_2_31_elements(cp, name):
    _releasing_memory(_large_tensors, cp, name)


def _large_tensors(cp, name):
    batch, seqlen, heads, head_dim, layout, causal, sampled = LARGE[name]
    shape = (batch, seqlen, heads, head_dim)
    assert math.prod(shape) > INT32_LIMIT
    q, k, v, dout = (_alloc(cp, shape, np.float16, layout, seed=seed) for seed in (1, 2, 3, 4))
    out, lse, grads = _run_checked(cp, q, k, v, dout, causal, layout)
    assert bool(cp.isfinite(lse).all()), "LSE: non-finite (or unwritten) entries"
    for label, x in (("out", out), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert _all_finite(cp, x), f"{label}: non-finite (or unwritten) elements"
    _check_heads(cp, (q, k, v, dout, out, lse, *grads), sampled, causal)


# ------------------------------------------------------------------------------------------------
# (b) 128k tokens, batch 1, 2 heads: out and LSE on every row, dq on sampled rows, dk/dv on sampled
# keys (block edges, both ends, random), against fp32 references.
# ------------------------------------------------------------------------------------------------

SEQLEN_128K = 131072


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_seqlen_128k(cp, head_dim, causal):
    _releasing_memory(_seqlen_128k, cp, head_dim, causal)


def _seqlen_128k(cp, head_dim, causal):
    shape = (1, SEQLEN_128K, 2, head_dim)
    q, k, v, dout = (_alloc(cp, shape, NP_DTYPES["bf16"], seed=seed) for seed in (11, 12, 13, 14))
    out, lse, grads = _run_checked(cp, q, k, v, dout, causal, "bshd")
    assert bool(cp.isfinite(lse).all())
    for label, x in (("out", out), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert _all_finite(cp, x), f"{label}: non-finite (or unwritten) elements"
    rows = sample_indices(SEQLEN_128K, 48, seed=head_dim)
    cols = sample_indices(SEQLEN_128K, 48, seed=head_dim + 1)
    _check_heads(cp, (q, k, v, dout, out, lse, *grads), [(0, 0), (0, 1)], causal, rows, cols)


# ------------------------------------------------------------------------------------------------
# (c) peak device memory of forward + backward against the sequence length: O(N), never an N x N
# buffer. Outputs: (out, dq, dk, dv) 4 * 2N*H*D bytes, (LSE, D) 2 * 4*N*H bytes; inputs excluded.
# ------------------------------------------------------------------------------------------------

MEM_SEQLENS = (8192, 16384, 32768, 65536)
MEM_HEADS, MEM_HEAD_DIM = 8, 128


def _ideal_bytes(n):
    return 4 * 2 * n * MEM_HEADS * MEM_HEAD_DIM + 2 * 4 * n * MEM_HEADS


def _check_linear(table, label):
    lines = [(f"peak device memory of forward + backward ({label}), batch 1, {MEM_HEADS} heads, "
              f"head dim {MEM_HEAD_DIM}, bf16, inputs excluded:"),
             "| seqlen | peak bytes | bytes / token | N x N bf16 matrix (one head) |", "|---|---|---|---|"]
    for n, peak in table:
        lines.append(f"| {n} | {peak:,} | {peak / n:,.0f} | {2 * n * n:,} |")
    print("\n" + "\n".join(lines))
    (n0, p0), (n1, p1) = table[0], table[-1]
    growth = (p1 / p0) / (n1 / n0)
    assert 1 / 1.3 <= growth <= 1.3, f"{label}: peak grows {p1 / p0:.2f}x for {n1 / n0:.0f}x tokens (not linear)"
    for n, peak in table:
        assert peak <= 2 * _ideal_bytes(n), f"{label}: {peak:,} B at seqlen {n}, over 2x the outputs' {_ideal_bytes(n):,}"
    assert p1 < 2 * n1 * n1 / 8, f"{label}: {p1:,} B at seqlen {n1} is not far below an N x N matrix"


def test_peak_memory_is_linear_in_seqlen_cupy(cp):
    """CuPy inputs: outputs and scratch all come from CuPy's pool, whose size after a call (blocks
    are kept, none released) is the high-water mark since free_all_blocks()."""
    import cuflash2

    pool = cp.get_default_memory_pool()
    dtype = NP_DTYPES["bf16"]
    warm = [_alloc(cp, (1, 256, MEM_HEADS, MEM_HEAD_DIM), dtype, seed=s) for s in range(4)]
    out, lse = cuflash2.flash_attn_forward(*warm[:3])  # compile outside the measurement
    cuflash2.flash_attn_backward(warm[3], *warm[:3], out, lse)
    del warm, out, lse
    table = []
    for n in MEM_SEQLENS:
        q, k, v, dout = (_alloc(cp, (1, n, MEM_HEADS, MEM_HEAD_DIM), dtype, seed=s) for s in range(4))
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        base = pool.total_bytes()
        out, lse = cuflash2.flash_attn_forward(q, k, v)
        grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse)
        cp.cuda.Device().synchronize()
        table.append((n, pool.total_bytes() - base))
        del q, k, v, dout, out, lse, grads
        pool.free_all_blocks()
    _check_linear(table, "CuPy arrays")


def test_peak_memory_is_linear_in_seqlen_torch(cp):
    """torch tensors with autograd: outputs from torch's allocator (max_memory_allocated), backward
    scratch from CuPy's pool."""
    torch = pytest.importorskip("torch")
    import cuflash2

    pool = cp.get_default_memory_pool()

    def inputs(n):
        gen = torch.Generator(device="cuda").manual_seed(n)
        return [torch.randn(1, n, MEM_HEADS, MEM_HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen,
                            requires_grad=i < 3) for i in range(4)]

    q, k, v, dout = inputs(256)
    cuflash2.flash_attn_func(q, k, v).backward(dout)  # compile outside the measurement
    table = []
    for n in MEM_SEQLENS:
        q, k, v, dout = inputs(n)
        torch.cuda.synchronize()
        pool.free_all_blocks()
        base_cupy = pool.total_bytes()
        torch.cuda.reset_peak_memory_stats()
        base_torch = torch.cuda.memory_allocated()
        cuflash2.flash_attn_func(q, k, v).backward(dout)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base_torch + pool.total_bytes() - base_cupy
        table.append((n, peak))
        del q, k, v, dout
        torch.cuda.empty_cache()
        pool.free_all_blocks()
    _check_linear(table, "torch tensors, autograd")
