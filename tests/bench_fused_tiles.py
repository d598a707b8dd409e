"""Fused backward (flash_bwd_fused.cu) query-block sizes at head dim 64 against the default plan,
kernels only, bf16, non-causal. Usage: python tests/bench_fused_tiles.py"""

import torch
from bench_kernels import bench_bwd

from cuflash2 import bench

for seqlen in (1024, 4096):
    batch, heads, head_dim = 16384 // seqlen, 32, 64
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = bench.attention_flops(batch, seqlen, seqlen, heads, head_dim, False, "bwd")
    results = {"default": bench_bwd(q, k, v, False, flops),
               "fused m64": bench_bwd(q, k, v, False, flops, fused=True, tile=(64, 8, 2)),
               "fused m128": bench_bwd(q, k, v, False, flops, fused=True, tile=(128, 8, 2))}
    print(seqlen, {name: round(x, 1) for name, x in results.items()}, flush=True)
