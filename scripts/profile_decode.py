"""ncu driver for one-token decoding: a few flash_attn_with_kvcache calls on the decode benchmark's
problem (32 query / 8 kv heads, head dim 128, bf16). Usage:
    ncu --clock-control none --kernel-name regex:kvcache|decode|combine --launch-skip 4 --launch-count 2 \
        python scripts/profile_decode.py BATCH KV_LEN [NUM_SPLITS]"""

import sys

import cupy as cp

import cuflash2

batch, kv_len = int(sys.argv[1]), int(sys.argv[2])
num_splits = int(sys.argv[3]) if len(sys.argv) > 3 else 0
q = cp.random.standard_normal((batch, 1, 32, 128), dtype=cp.float32).astype(cp.float16)
k_cache = cp.random.standard_normal((batch, kv_len, 8, 128), dtype=cp.float32).astype(cp.float16)
v_cache = cp.random.standard_normal((batch, kv_len, 8, 128), dtype=cp.float32).astype(cp.float16)
seqlens = cp.full((batch,), kv_len, dtype=cp.int32)
for _ in range(4):
    cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits)
cp.cuda.Device().synchronize()
