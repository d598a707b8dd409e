"""Host-side cost of one call (what a decoding loop pays per token): wall time per call for
back-to-back calls, and a cProfile of where the Python time goes. Usage:
python tests/profile_calls.py [decode|forward]"""

import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import cuflash2
from cuflash2.bench import time_cuda_ms


def decode_call():
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((1, 1, 32, 128)).astype(np.float16))
    k_cache = cp.asarray(rng.standard_normal((1, 2048, 8, 128)).astype(np.float16))
    seqlens = cp.full((1,), 2048, dtype=cp.int32)
    return lambda: cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens)


def forward_call():
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((1, 128, 16, 128)).astype(np.float16))
    return lambda: cuflash2.flash_attn_func(q, q, q, causal=True)


fn = {"decode": decode_call, "forward": forward_call}[sys.argv[1] if len(sys.argv) > 1 else "decode"]()
for _ in range(20):
    fn()
cp.cuda.Device().synchronize()
n = 500
start = time.perf_counter()
for _ in range(n):
    fn()
cp.cuda.Device().synchronize()
print(f"wall per call (back-to-back, {n} calls): {(time.perf_counter() - start) / n * 1e6:.1f} us")
print(f"CUDA-event time per call: {time_cuda_ms(fn) * 1e3:.1f} us")
profile = cProfile.Profile()
profile.enable()
for _ in range(200):
    fn()
profile.disable()
cp.cuda.Device().synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
