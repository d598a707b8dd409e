"""Runs every kernel family once on small odd shapes, for compute-sanitizer (see sanitize.sh).

CuPy's memory pool is disabled so that every buffer is its own allocation and an out-of-bounds
access lands outside it (pooled memory would hide it).
"""

import os

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash2
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.families.mma_sync import fused_backward_supported, head_dim_bucket
from cuflash2.families.wgmma import backward as wgmma_backward
from cuflash2.families.wgmma import forward as wgmma_forward
from cuflash2.frameworks.arrays import describe
from cuflash2.materialize import as_float32
from cuflash2.problem.tensors import validate_qkv

cp.cuda.set_allocator(None)
# initcheck does not count TMA stores as writes: the Hopper backward's GQA sums, which it writes that
# way, are zero-filled first (outputs the same way, see forward_for_backward and zeroed_key_gradients).
os.environ[wgmma_backward.ZERO_TMA_SCRATCH_VARIABLE] = "1"
rng = np.random.default_rng(0)


def arrays(*shapes, dtype=ml_dtypes.bfloat16):
    return [cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(dtype)) for s in shapes]


def forward_for_backward(q, k, v, causal):
    """The forward's (out, lse) for a backward, out zero-filled first. initcheck reports reads of an
    output that the Hopper forward stored with TMA (bulk tensor) stores, by the backward's pre-pass
    or a CuPy conversion, as uninitialized although every row was written (the GPU tests fill
    outputs with a sentinel and compare): it does not count those stores as writes."""
    return cuflash2.flash_attn_forward(q, k, v, causal=causal, out=cp.zeros(q.shape, q.dtype))


def zeroed_key_gradients(k, v):
    """dk= and dv= for a backward, zero-filled first, for the same reason: the Hopper backward stores
    them with TMA stores where it can (the GPU tests fill them with NaN and compare). Given to every
    backward here for simplicity; the variants store from registers either way, and with GQA the
    Hopper backward's TMA stores write its fp32 sums (zero-filled through CUFLASH2_ZERO_TMA_SCRATCH)."""
    return dict(dk=cp.zeros(k.shape, k.dtype), dv=cp.zeros(v.shape, v.dtype))


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, dtype)
    (1, 37, 53, 2, 2, 40, False, ml_dtypes.bfloat16),
    (2, 53, 37, 4, 2, 64, True, np.float16),
    (1, 70, 130, 2, 1, 128, True, ml_dtypes.bfloat16),
    (1, 19, 33, 2, 2, 256, False, np.float16),
    (1, 70, 130, 4, 2, 256, True, ml_dtypes.bfloat16),  # GQA on the split tile (its TMA-stored sums)
    (1, 33, 19, 2, 2, 192, True, ml_dtypes.bfloat16),
    (1, 70, 130, 2, 2, 128, True, ml_dtypes.bfloat16),  # the fused one-pass backward (sm_90 default)
    (2, 45, 77, 4, 2, 128, False, np.float16),
]

for b, sq, sk, h, hk, d, causal, dtype in CASES:
    q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
    out, lse = forward_for_backward(q, k, v, causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **zeroed_key_gradients(k, v), causal=causal)
    # the main backward kernel accumulating dQ itself (sm_90), and the fused kernel where it exists
    atomic = [cp.empty_like(x) for x in (q, k, v)]
    infos = [describe("x", x) for x in (q, k, v)]
    launch.backward(describe("dout", dout), *infos, describe("out", out), describe("lse", lse),
                    *(describe("g", g) for g in atomic), validate_qkv(*infos), causal, False, 0,
                    cp.cuda.get_current_stream(), atomic_dq=True)
    fused = []
    if fused_backward_supported(head_dim_bucket(d), launch.device_arch(0), causal=causal, gqa=h != hk):
        fused = [cp.empty_like(x) for x in (q, k, v)]
        launch.backward(describe("dout", dout), *infos, describe("out", out), describe("lse", lse),
                        *(describe("g", g) for g in fused), validate_qkv(*infos), causal, False, 0,
                        cp.cuda.get_current_stream(), fused=True)
    cp.cuda.get_current_stream().synchronize()
    for g in (*grads, *atomic, *fused):
        assert bool(cp.isfinite(as_float32(cp, g)).all())
    print(f"ok b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {np.dtype(dtype).name}", flush=True)

# Deterministic backwards (on sm_90 the Hopper kernel with ordered dQ turns, cyclic walk included).
for b, sq, sk, h, hk, d, causal, dtype in [c for c in CASES if c[5] in (64, 128)]:
    q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
    out, lse = forward_for_backward(q, k, v, causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **zeroed_key_gradients(k, v), causal=causal,
                                         deterministic=True)
    cp.cuda.get_current_stream().synchronize()
    assert all(bool(cp.isfinite(as_float32(cp, g)).all()) for g in grads)
    print(f"ok deterministic b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal}", flush=True)

# Non-causal forwards with more tiles than SMs, their tail split (tiles cut between two CTAs: rows
# handed over through global memory; on sm_90 only): three consumer groups, staged output beside and
# over the V stages.
os.environ[wgmma_forward.SPLIT_TAIL_VARIABLE] = "1"
for d, dtype in ((64, np.float16), (128, ml_dtypes.bfloat16), (256, ml_dtypes.bfloat16)):
    q, k, v = arrays((2, 33, 70, d), (2, 300, 70, d), (2, 300, 70, d), dtype=dtype)
    out, lse = cuflash2.flash_attn_forward(q, k, v, out=cp.zeros(q.shape, q.dtype))  # see forward_for_backward
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isfinite(as_float32(cp, out)).all())
    print(f"ok split tail d={d}", flush=True)
del os.environ[wgmma_forward.SPLIT_TAIL_VARIABLE]

# Non-causal forwards in CTA pairs (clusters sharing K and V by multicast; sm_90 only), forced at
# every head dim: more tiles than SMs, partial last key blocks, GQA.
os.environ[wgmma_forward.KV_CLUSTERS_VARIABLE] = "1"
for sq, sk, h, hk, d, dtype in ((384, 500, 70, 70, 64, np.float16), (256, 2000, 70, 10, 128, ml_dtypes.bfloat16),
                                (256, 1500, 70, 70, 256, ml_dtypes.bfloat16)):
    q, k, v = arrays((2, sq, h, d), (2, sk, hk, d), (2, sk, hk, d), dtype=dtype)
    out, lse = cuflash2.flash_attn_forward(q, k, v, out=cp.zeros(q.shape, q.dtype))  # see forward_for_backward
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isfinite(as_float32(cp, out)).all())
    print(f"ok CTA pairs d={d} sq={sq} sk={sk} h={h}/{hk}", flush=True)
del os.environ[wgmma_forward.KV_CLUSTERS_VARIABLE]

# Variant kernels (window, softcap, ALiBi, dropout) forward and backward, and varlen.
for b, sq, sk, h, hk, d, causal, dtype in CASES[:3]:
    q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
    slopes = cp.asarray(np.linspace(0.1, 0.5, h, dtype=np.float32))
    options = dict(causal=causal, window_size=(11, 5), softcap=4.0, alibi_slopes=slopes, dropout_p=0.3,
                   dropout_seed=b * 1000 + d)
    out, lse = cuflash2.flash_attn_forward(q, k, v, **options)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **zeroed_key_gradients(k, v), **options)
    cp.cuda.get_current_stream().synchronize()
    assert all(bool(cp.isfinite(as_float32(cp, g)).all()) for g in grads)
    print(f"ok variant b={b} sq={sq} sk={sk} d={d} causal={causal}", flush=True)

lens_q, lens_k = [5, 0, 37, 16], [9, 3, 50, 0]
cu_q = cp.asarray(np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32))
cu_k = cp.asarray(np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32))
for d in (64, 128):
    q, k, v, dout = arrays((sum(lens_q), 4, d), (sum(lens_k), 2, d), (sum(lens_k), 2, d), (sum(lens_q), 4, d))
    out, lse = cuflash2.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    grads = cuflash2.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                causal=True)
    cp.cuda.get_current_stream().synchronize()
    print(f"ok varlen d={d}", flush=True)

# Paged varlen (chunked prefill through block_table): odd page sizes, rows past the last sequence,
# out-of-range page ids (read as zero keys, never outside the cache).
lens_q, lens_k = [5, 0, 37, 16], [90, 3, 50, 16]
cu_q = cp.asarray(np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32))
cu_k = cp.asarray(np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32))
for d, page in ((64, 7), (128, 1), (96, 16)):
    per_seq = -(-max(lens_k) // page)
    q, = arrays((sum(lens_q) + 3, 4, d))
    pages_k, pages_v = arrays((4 * per_seq + 1, page, 2, d), (4 * per_seq + 1, page, 2, d))
    table = rng.permutation(4 * per_seq + 1)[:4 * per_seq].reshape(4, per_seq).astype(np.int32)
    table[2, 0], table[3, -1] = 10 ** 6, -3
    out, lse = cuflash2.flash_attn_varlen_forward(q, pages_k, pages_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                  causal=True, block_table=cp.asarray(table))
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isfinite(as_float32(cp, out)).all())
    print(f"ok paged varlen d={d} page={page}", flush=True)

# KV cache: append with rotary into a paged cache (odd page size), split-KV and its combine kernel.
# Sequences span several key blocks (200-280 rows), so the requested splits really happen.
for d, page, splits in ((64, 5, 3), (128, 16, 1), (256, 7, 0)):
    per_seq = 280 // page
    q, k_new, v_new = arrays((2, 2, 4, d), (2, 2, 2, d), (2, 2, 2, d))
    pages_k, pages_v = arrays((2 * per_seq + 1, page, 2, d), (2 * per_seq + 1, page, 2, d))
    table = cp.asarray(rng.permutation(2 * per_seq + 1)[:2 * per_seq].reshape(2, per_seq).astype(np.int32))
    seqlens = cp.asarray(np.array([3, per_seq * page - 2], np.int32))
    theta = rng.uniform(0, 6.28, (per_seq * page + 4, d // 4))
    cos, sin = cp.asarray(np.cos(theta).astype(np.float32)), cp.asarray(np.sin(theta).astype(np.float32))
    out = cuflash2.flash_attn_with_kvcache(q, pages_k, pages_v, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=seqlens, block_table=table, causal=True, num_splits=splits)
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isfinite(as_float32(cp, out)).all())
    print(f"ok kvcache d={d} page={page} splits={splits}", flush=True)

# One-token GQA decoding (the key-splitting decoding kernel), lengths absent (the cache is full) and
# given, split or not; each call twice, so that the second runs through the decoding-step fast path.
q, k_cache, v_cache = arrays((3, 1, 8, 128), (3, 333, 2, 128), (3, 333, 2, 128))  # 3 key blocks
for seqlens in (None, cp.asarray(np.array([0, 140, 333], np.int32))):
    for splits in (0, 1):
        for _ in range(2):
            out = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        cp.cuda.get_current_stream().synchronize()
        print(f"ok decode d=128 seqlens={'none' if seqlens is None else 'given'} splits={splits}", flush=True)

# Forwards of a few hundred to 1100 rows (on sm_90 the Hopper forward: the staged output of calls up
# to 1k rows and the register epilogue above, more tiles than SMs, GQA, cross lengths); each call
# twice, so that the second replays its recorded launch.
for b, sq, sk, h, hk, d, causal, dtype in [(1, 200, 330, 2, 1, 128, True, ml_dtypes.bfloat16),
                                           (1, 333, 190, 2, 2, 192, True, ml_dtypes.bfloat16),
                                           (2, 129, 257, 4, 4, 96, False, np.float16),
                                           (1, 1100, 1100, 2, 1, 48, True, ml_dtypes.bfloat16),
                                           (2, 1100, 1100, 16, 4, 64, True, ml_dtypes.bfloat16),  # 192 tiles:
                                           # head dim 64's two-Q-tile boundary (a CTA's tiles follow on)
                                           (4, 1000, 1000, 16, 4, 64, True, ml_dtypes.bfloat16),  # short
                                           # causal, 512 tiles: the next tile's Q loads during a tile
                                           (3, 900, 300, 8, 8, 32, True, np.float16),  # and rows with no key
                                           (2, 1100, 1100, 8, 2, 256, True, ml_dtypes.bfloat16),
                                           # 144 tiles: the epilogue under the next tile's first S
                                           (2, 1100, 1100, 8, 2, 128, True, np.float16),
                                           (2, 1100, 1100, 8, 8, 128, False, np.float16),
                                           (4, 600, 300, 8, 8, 256, True, np.float16),
                                           # 8k keys and up at head dim 128: 192-key blocks, the
                                           # last one partial, causal or not
                                           (1, 300, 8300, 2, 1, 128, False, ml_dtypes.bfloat16),
                                           (1, 300, 8300, 2, 1, 128, True, np.float16)]:
    q, k, v = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), dtype=dtype)
    out = cp.zeros(q.shape, q.dtype)  # read below: zero-filled first (see forward_for_backward)
    for _ in range(2):
        cuflash2.flash_attn_forward(q, k, v, causal=causal, out=out)
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isfinite(as_float32(cp, out)).all())
    print(f"ok forward b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal}", flush=True)

# Causal backwards with more units of two key blocks than SMs (on sm_90 the Hopper backward's
# persistent grid: CTAs walk several tiles, an odd key-block count leaves a middle block alone).
for b, sq, sk, h, hk, d, causal, dtype in [(2, 520, 520, 70, 70, 128, True, ml_dtypes.bfloat16),
                                           (2, 700, 900, 40, 10, 128, True, np.float16),
                                           (3, 600, 530, 48, 48, 96, True, ml_dtypes.bfloat16)]:
    q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
    out, lse = forward_for_backward(q, k, v, causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **zeroed_key_gradients(k, v), causal=causal)
    cp.cuda.get_current_stream().synchronize()
    assert all(bool(cp.isfinite(as_float32(cp, g)).all()) for g in grads)
    print(f"ok persistent backward b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal}", flush=True)

# The Hopper backward (head dim 128) on the head-dim-128 cases, also the mma.sync one's on sm_90.
if launch.device_arch(0) == 90:
    from cuflash2 import families

    os.environ[families.FAMILY_VARIABLE] = "mma_sync"
    for b, sq, sk, h, hk, d, causal, dtype in [c for c in CASES if c[5] == 128]:
        q, k, v, dout = arrays((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d), dtype=dtype)
        out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
        grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
        cp.cuda.get_current_stream().synchronize()
        assert all(bool(cp.isfinite(as_float32(cp, g)).all()) for g in grads)
        print(f"ok mma.sync backward on sm_90 b={b} sq={sq} sk={sk} h={h}/{hk} causal={causal}", flush=True)
    del os.environ[families.FAMILY_VARIABLE]
