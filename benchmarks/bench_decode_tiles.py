"""Tile sweep of the KV-cache (decoding) kernel: GB/s of K+V per tile shape at a few batch / cache
lengths, each checked against the default tile's output. Usage: python benchmarks/bench_decode_tiles.py"""

import cupy as cp
import numpy as np

import cuflash2
from cuflash2.core import replay
from cuflash2.families import mma_sync as config
from cuflash2.families.mma_sync import kvcache_launches
from cuflash2.bench import time_cuda_ms

# (kernel, block_m, block_n, warps, stages). Row-split tiles: small query blocks, since a 4-row GQA
# group wastes fewer tensor-core rows in a 16- or 32-row block. Key-split decoding tiles: 16 rows,
# each warp block_n / warps keys of every tile.
KV, DEC = config.FWD_KVCACHE, config.FWD_DECODE
CANDIDATES = [(KV, 64, 128, 4, 3), (KV, 32, 128, 2, 3), (KV, 32, 64, 2, 4), (DEC, 16, 128, 4, 3), (DEC, 16, 128, 8, 3),
              (DEC, 16, 64, 4, 4), (DEC, 16, 64, 4, 6), (DEC, 16, 128, 4, 2), (DEC, 16, 256, 8, 2)]
default_config = kvcache_launches.kvcache_config

for batch, kv_len in ((64, 2048), (64, 8192), (16, 2048), (16, 8192), (16, 65536), (1, 65536)):
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((batch, 1, 32, 128), dtype=np.float32).astype(np.float16))
    k_cache, v_cache = (cp.random.standard_normal((batch, kv_len, 8, 128), dtype=cp.float32).astype(cp.float16)
                        for _ in range(2))
    seqlens = cp.full((batch,), kv_len, dtype=cp.int32)
    call = lambda: cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    reference = cp.asnumpy(call()).astype(np.float32)
    kv_bytes = k_cache.nbytes + v_cache.nbytes
    for tile in CANDIDATES:
        kernel, block_m, block_n, warps, stages = tile
        chosen = config.KernelConfig(kernel, "fp16", 128, block_m, block_n, warps, stages, False, variant=True)
        kvcache_launches.kvcache_config = lambda *args, chosen=chosen: chosen
        replay.clear()  # recorded launches hold their tile: record them again for this one
        try:
            err = float(np.abs(cp.asnumpy(call()).astype(np.float32) - reference).max())
            ms = time_cuda_ms(call, 5, 20)
            print(f"batch {batch:3d} kv {kv_len:6d} tile {chosen.short_id():<42}: {kv_bytes / ms / 1e6:6.0f} GB/s  "
                  f"({ms:.4f} ms, max diff vs default {err:.1e})", flush=True)
        except Exception as exc:  # a tile that does not fit this GPU
            print(f"batch {batch} kv {kv_len} tile {chosen.short_id()}: {type(exc).__name__}: {exc}"[:160], flush=True)
        finally:
            kvcache_launches.kvcache_config = default_config
            replay.clear()
    del k_cache, v_cache
    cp.get_default_memory_pool().free_all_blocks()
