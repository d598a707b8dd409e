"""Split-KV sweep of one-token decoding: GB/s of K+V for each num_splits at a few batch / cache
lengths (32 query / 8 kv heads, head dim 128, bf16), next to the automatic choice (0), each checked
against the unsplit output. Usage: python benchmarks/bench_decode_splits.py"""

import cupy as cp
import numpy as np

import cuflash2
from cuflash2.bench import time_cuda_ms

SPLITS = (0, 1, 2, 4, 8, 16, 24, 32, 33, 48, 64)

for batch, kv_len in ((1, 8192), (1, 32768), (1, 65536), (4, 16384), (16, 2048), (16, 8192)):
    q = cp.random.standard_normal((batch, 1, 32, 128), dtype=cp.float32).astype(cp.float16)
    k_cache, v_cache = (cp.random.standard_normal((batch, kv_len, 8, 128), dtype=cp.float32).astype(cp.float16)
                        for _ in range(2))
    seqlens = cp.full((batch,), kv_len, dtype=cp.int32)
    kv_bytes = k_cache.nbytes + v_cache.nbytes
    reference = cp.asnumpy(cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                            num_splits=1)).astype(np.float32)
    for splits in SPLITS:
        call = lambda splits=splits: cuflash2.flash_attn_with_kvcache(  # noqa: E731
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        err = float(np.abs(cp.asnumpy(call()).astype(np.float32) - reference).max())
        ms = time_cuda_ms(call, 5, 30)
        print(f"batch {batch:3d} kv {kv_len:6d} splits {splits:3d}: {kv_bytes / ms / 1e6:6.0f} GB/s "
              f"({ms * 1e3:7.1f} us, max diff vs 1 split {err:.1e})", flush=True)
    del k_cache, v_cache
    cp.get_default_memory_pool().free_all_blocks()
