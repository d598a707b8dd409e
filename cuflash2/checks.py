"""Correctness sweep behind `cuflash2 check`: cases, references and FA2's tolerance rule.

FA2's rule: the kernel's max error against an fp32 reference must be at most `multiplier` times the
error of the same computation done naively in the input precision (every intermediate rounded to
fp16/bf16), plus a tiny floor: multiplier 2 for the forward output, 3 for gradients.

The references are array-module generic (`xp` is NumPy or CuPy), so the GPU sweep never copies the
problem back to the host.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np

from .materialize import as_float32
from .problem.tensors import DTYPE_NAMES

FWD_MULTIPLIER = 2.0
BWD_MULTIPLIER = 3.0
ABS_FLOOR = 1e-5


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "fwd" | "bwd"
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    causal: bool
    batch: int = 2
    heads: int = 4
    heads_kv: int = 4

    def case_id(self) -> str:
        heads = f"h{self.heads}" + (f"kv{self.heads_kv}" if self.heads_kv != self.heads else "")
        mask = "causal" if self.causal else "full"
        return (f"{self.kind}-{self.dtype}-d{self.head_dim}-b{self.batch}{heads}-"
                f"{self.seqlen_q}x{self.seqlen_k}-{mask}")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.case_id().encode())


@dataclasses.dataclass(frozen=True)
class CheckResult:
    case_id: str
    max_err: float
    naive_err: float
    multiplier: float
    passed: bool
    note: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.passed else "FAIL")

    @property
    def ratio(self) -> float:
        """max error / naive error (the rule allows up to `multiplier`)."""
        if self.naive_err > 0:
            return self.max_err / self.naive_err
        return 0.0 if self.max_err == 0 else math.inf


def judge(case_id: str, err: float, naive_err: float, multiplier: float, note: str = "",
          floor: float = ABS_FLOOR) -> CheckResult:
    passed = bool(err <= multiplier * naive_err + floor) and not note
    return CheckResult(case_id, float(err), float(naive_err), multiplier, passed, note)


QUICK_HEAD_DIMS = (64, 128, 256, 40)
QUICK_HEAD_DIMS_REDUCED = (64, 128)  # backward of the second dtype in --quick (keeps compiles < 1 min)
FULL_HEAD_DIMS = (8, 16, 32, 40, 64, 72, 80, 96, 128, 136, 160, 192, 224, 256)
ODD_SEQLENS = ((113, 203), (203, 113), (1, 239))
FULL_SEQLENS = ((1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (127, 513), (513, 127), (1023, 1024))
GQA = (8, 2, 128, (173, 301))  # heads, heads_kv, head_dim, (seqlen_q, seqlen_k)
MQA = (8, 1, 64, (97, 131))


def _both(kind, dtype, head_dim, seqlens, **kw) -> list[Case]:
    return [Case(kind, dtype, head_dim, sq, sk, causal, **kw) for sq, sk in seqlens for causal in (False, True)]


def _sweep(kind, dtype, head_dims, seqlens, extra_seqlens, groups) -> list[Case]:
    """Every head dim on `seqlens`, head dim 128 on `extra_seqlens`, then the GQA/MQA shapes."""
    cases = [c for head_dim in head_dims for c in _both(kind, dtype, head_dim, seqlens)]
    cases += _both(kind, dtype, 128, extra_seqlens)
    for heads, heads_kv, head_dim, shape in groups:
        cases += _both(kind, dtype, head_dim, (shape,), heads=heads, heads_kv=heads_kv)
    return cases


def gpu_cases(quick: bool, dtypes, backward: bool) -> list[Case]:
    """The GPU sweep: head dims on an odd shape, odd seqlens both ways, GQA/MQA, causal both ways.

    --quick trims the backward of every dtype after the first to head dims 64 and 128 and one of
    GQA/MQA: each backward plan is several kernels to compile."""
    if not quick:
        fwd = [c for d in dtypes for c in _sweep("fwd", d, FULL_HEAD_DIMS, ODD_SEQLENS,
                                                 FULL_SEQLENS + ((2048, 2048),), (GQA, MQA))]
        bwd = [c for d in dtypes for c in _sweep("bwd", d, FULL_HEAD_DIMS, ODD_SEQLENS, FULL_SEQLENS, (GQA, MQA))]
        return fwd + (bwd if backward else [])
    fwd = [c for d in dtypes for c in _sweep("fwd", d, QUICK_HEAD_DIMS, ((113, 203),),
                                             ((203, 113), (1, 239), (1024, 1024)), (GQA, MQA))]
    bwd = []
    for i, dtype in enumerate(dtypes):
        dims, groups = (QUICK_HEAD_DIMS, (GQA,)) if i == 0 else (QUICK_HEAD_DIMS_REDUCED, (MQA,))
        bwd += _sweep("bwd", dtype, dims, ((113, 203),), ((203, 113), (1, 239), (512, 512)), groups)
    return fwd + (bwd if backward else [])


def numpy_cases(dtypes, backward: bool) -> list[Case]:
    """Small shapes for the CPU path (NumPy tiled reference inside flash_attn_func)."""
    shapes = [(64, 40, 72, {}), (40, 33, 17, {}), (32, 1, 23, {}), (32, 45, 45, {"heads": 4, "heads_kv": 2})]
    cases = []
    for kind in ("fwd", "bwd") if backward else ("fwd",):
        for dtype in dtypes:
            for head_dim, sq, sk, kw in shapes:
                cases += [Case(kind, dtype, head_dim, sq, sk, causal, batch=1, **{"heads": 2, "heads_kv": 2, **kw})
                          for causal in (False, True)]
    return cases


# --------------------------------------------------------------------------------------------
# References (xp = numpy or cupy), on float32 inputs
# --------------------------------------------------------------------------------------------

def round_to(xp, x, dtype_name: str):
    """Round float32 values to bf16 / fp16 precision (round to nearest even), returned as float32."""
    x = x.astype(xp.float32)
    if dtype_name == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    bits = x.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    return xp.where(xp.isnan(x), x, rounded.view(xp.float32))


def _rounder(xp, low_precision):
    return (lambda x: round_to(xp, x, low_precision)) if low_precision else (lambda x: x)


def _probs(xp, q, k, causal, scale, rnd):
    """Softmax probabilities (b, h, sq, sk) and LSE (b, h, sq); rows seeing nothing get p = 0, lse = +inf."""
    sq, sk = q.shape[1], k.shape[1]
    s = rnd(xp.einsum("bqhd,bkhd->bhqk", q, k) * scale)
    if causal:
        visible = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        s = xp.where(visible, s, -xp.inf)
    row_max = s.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0)
    p = xp.exp(s - row_max)
    denom = p.sum(axis=-1, keepdims=True)
    seen = denom[..., 0] > 0
    lse = xp.where(seen, xp.log(xp.where(seen, denom[..., 0], 1)) + row_max[..., 0], xp.inf)
    return rnd(p / xp.where(denom == 0, 1, denom)), lse


def _scale(softmax_scale, head_dim):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def attention_ref(xp, q, k, v, causal=False, softmax_scale=None, low_precision=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d) float32 -> (out float32, lse float32 (b, h, sq)).

    With `low_precision` ("float16" / "bfloat16") every intermediate is rounded to that precision."""
    rnd = _rounder(xp, low_precision)
    group = q.shape[2] // k.shape[2]
    k, v = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    p, lse = _probs(xp, q, k, causal, _scale(softmax_scale, q.shape[3]), rnd)
    out = rnd(xp.einsum("bhqk,bkhd->bqhd", p, v))
    return out.astype(xp.float32), lse.astype(xp.float32)


def _group_sum(xp, x, heads_kv):
    b, s, h, d = x.shape
    return x.reshape(b, s, heads_kv, h // heads_kv, d).sum(axis=3)


def attention_backward_ref(xp, dout, q, k, v, causal=False, softmax_scale=None, low_precision=None):
    """Gradients (dq, dk, dv) float32 of attention_ref, by the textbook softmax backward."""
    rnd = _rounder(xp, low_precision)
    heads_kv, group = k.shape[2], q.shape[2] // k.shape[2]
    scale = _scale(softmax_scale, q.shape[3])
    kr, vr = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    p, _ = _probs(xp, q, kr, causal, scale, rnd)
    dv = rnd(xp.einsum("bhqk,bqhd->bkhd", p, dout))
    dp = rnd(xp.einsum("bqhd,bkhd->bhqk", dout, vr))
    ds = rnd(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
    dq = rnd(xp.einsum("bhqk,bkhd->bqhd", ds, kr) * scale)
    dk = rnd(xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    return (dq.astype(xp.float32), rnd(_group_sum(xp, dk, heads_kv)).astype(xp.float32),
            rnd(_group_sum(xp, dv, heads_kv)).astype(xp.float32))


# --------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------

def host_dtype(dtype: str):
    if dtype == "fp16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def make_inputs(xp, case: Case, with_dout: bool = False):
    """Random q, k, v (and dout) of the case's dtype, on the host (NumPy) or uploaded (CuPy)."""
    rng = np.random.default_rng(case.seed)
    q_shape = (case.batch, case.seqlen_q, case.heads, case.head_dim)
    kv_shape = (case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    shapes = [q_shape, kv_shape, kv_shape] + ([q_shape] if with_dout else [])
    arrays = [rng.standard_normal(s, dtype=np.float32).astype(host_dtype(case.dtype)) for s in shapes]
    return arrays if xp is np else [xp.asarray(a) for a in arrays]


def _max_abs(xp, a, b) -> float:
    return float(xp.abs(a - b).max()) if a.size else 0.0


def _lse_note(xp, lse, ref_lse) -> str:
    finite = xp.isfinite(ref_lse)
    if not bool((xp.isfinite(lse) == finite).all()):
        return "LSE +inf pattern differs"
    if not lse.size:
        return ""
    err = float(xp.abs(xp.where(finite, lse, 0) - xp.where(finite, ref_lse, 0)).max())
    bound = 1e-3 * max(1.0, float(xp.abs(xp.where(finite, ref_lse, 0)).max()))
    return f"LSE error {err:.2e}" if err > bound else ""


def run_forward(xp, case: Case) -> list[CheckResult]:
    """cuflash2's forward against an fp32 reference (fp64 on the NumPy path)."""
    import cuflash2

    q, k, v = make_inputs(xp, case)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=case.causal)
    q32, k32, v32 = (as_float32(xp, x) for x in (q, k, v))
    if xp is np:
        from .reference import attention_naive

        ref, ref_lse = attention_naive(q32, k32, v32, causal=case.causal)
    else:
        ref, ref_lse = attention_ref(xp, q32, k32, v32, case.causal)
    naive, _ = attention_ref(xp, q32, k32, v32, case.causal, low_precision=DTYPE_NAMES[case.dtype])
    note = _lse_note(xp, xp.asarray(lse, dtype=xp.float64), xp.asarray(ref_lse, dtype=xp.float64))
    return [judge(case.case_id(), _max_abs(xp, as_float32(xp, out), ref), _max_abs(xp, naive, ref),
                  FWD_MULTIPLIER, note)]


def _reference_grads(xp, dout32, q32, k32, v32, causal):
    if xp is np:
        from .reference import attention_backward_naive, attention_naive

        out, lse = attention_naive(q32, k32, v32, causal=causal)
        return attention_backward_naive(dout32, q32, k32, v32, out, lse, causal=causal)
    return attention_backward_ref(xp, dout32, q32, k32, v32, causal)


def run_backward(xp, case: Case) -> list[CheckResult]:
    """cuflash2.flash_attn_backward's dq, dk, dv against an fp32 reference; one result per gradient."""
    import cuflash2

    q, k, v, dout = make_inputs(xp, case, with_dout=True)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=case.causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=case.causal)
    f32 = [as_float32(xp, x) for x in (dout, q, k, v)]
    refs = _reference_grads(xp, *f32, case.causal)
    naives = attention_backward_ref(xp, *f32, case.causal, low_precision=DTYPE_NAMES[case.dtype])
    # Where a gradient is exactly 0 (seqlen_k = 1: dS = P (dP - D) = 0), the naive computation is exact
    # and the kernel's fp32 rounding of dP - D alone would fail an absolute 1e-5: scale the floor by
    # the case's largest gradient instead.
    floor = ABS_FLOOR * max([1.0] + [float(xp.abs(r).max()) for r in refs if r.size])
    return [judge(f"{case.case_id()}:{name}", _max_abs(xp, as_float32(xp, g), r), _max_abs(xp, n, r),
                  BWD_MULTIPLIER, floor=floor)
            for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives)]


def run_case(xp, case: Case, skip_on: tuple = ()) -> list[CheckResult]:
    """Run one case; an exception becomes a failed result carrying its message (skipped for `skip_on`)."""
    try:
        return (run_forward if case.kind == "fwd" else run_backward)(xp, case)
    except Exception as exc:  # a crash is a failure of this case, not of the sweep
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        skipped = isinstance(exc, skip_on) if skip_on else False
        return [CheckResult(case.case_id(), math.nan, math.nan, 0.0, False, message, skipped)]


def has_backward() -> bool:
    import cuflash2

    return hasattr(cuflash2, "flash_attn_backward")
