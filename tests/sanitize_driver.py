"""Runs every kernel family once on small odd shapes, for compute-sanitizer (see sanitize.sh).

CuPy's memory pool is disabled so that every buffer is its own allocation and an out-of-bounds
access lands outside it (pooled memory would hide it).
"""

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash2
from cuflash2 import launch
from cuflash2.interop import as_float32, describe
from cuflash2.validate import validate_qkv

cp.cuda.set_allocator(None)
rng = np.random.default_rng(0)


def arrays(*shapes, dtype=ml_dtypes.bfloat16):
    return [cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(dtype)) for s in shapes]


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, dtype)
    (1, 37, 53, 2, 2, 40, False, ml_dtypes.bfloat16),
    (2, 53, 37, 4, 2, 64, True, np.float16),
    (1, 70, 130, 2, 1, 128, True, ml_dtypes.bfloat16),
    (1, 19, 33, 2, 2, 256, False, np.float16),
    (1, 33, 19, 2, 2, 192, True, ml_dtypes.bfloat16),
]

for b, sq, sk, h, hk, d, causal, dtype in CASES:
    q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    # the fp32-atomic dQ variant of the main backward kernel
    atomic = [cp.empty_like(x) for x in (q, k, v)]
    infos = [describe("x", x) for x in (q, k, v)]
    launch.backward(describe("dout", dout), *infos, describe("out", out), describe("lse", lse),
                    *(describe("g", g) for g in atomic), validate_qkv(*infos), causal, False, 0,
                    cp.cuda.get_current_stream(), atomic_dq=True)
    cp.cuda.get_current_stream().synchronize()
    for g in (*grads, *atomic):
        assert bool(cp.isfinite(as_float32(cp, g)).all())
    print(f"ok b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {np.dtype(dtype).name}", flush=True)
