"""Fused backward (kernels_cu/mma_sync/flash_bwd_fused.cu) against the default plan, kernels only, bf16, causal or not.
At head dim 64 also its two query-block sizes. Usage: python benchmarks/bench_fused_tiles.py [head_dim ...]"""

import sys

import torch
from bench_kernels import bench_bwd

from cuflash2 import bench

for head_dim in [int(x) for x in sys.argv[1:]] or [64]:
    for seqlen in (1024, 4096):
        for causal in (False, True):
            batch, heads = 16384 // seqlen, 2048 // head_dim
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            flops = bench.attention_flops(batch, seqlen, seqlen, heads, head_dim, causal, "bwd")
            results = {"default": bench_bwd(q, k, v, causal, flops),
                       "two-kernel": bench_bwd(q, k, v, causal, flops, fused=False),
                       "fused": bench_bwd(q, k, v, causal, flops, fused=True)}
            if head_dim <= 64:
                results["fused m64"] = bench_bwd(q, k, v, causal, flops, fused=True, tile=(64, 8, 2))
                results["fused m128"] = bench_bwd(q, k, v, causal, flops, fused=True, tile=(128, 8, 2))
            print(f"d{head_dim} s{seqlen} causal={causal}", {name: round(x, 1) for name, x in results.items()},
                  flush=True)
