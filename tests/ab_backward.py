"""A/B of the backward main kernels against an older copy of kernels_cu/, same process, interleaved.

Usage: python tests/ab_backward.py OLD_KERNELS_DIR [--head-dims 64,128,256] [--seqlen 4096] [--rounds 3]
The default plan's main kernels (fused or not) are compiled from both source trees and the whole
backward pass is timed alternately (new, old, new, ...); the old tree must keep the host contract
(shared memory, accumulator layout). Prints kernel-level TFLOP/s and the new / old ratio.
"""

import argparse
import math
import pathlib
import statistics

import cupy as cp
import numpy as np
from ab_forward import kernel_from

from cuflash2 import bench, compiler, launch
from cuflash2.config import backward_plan
from cuflash2.interop import describe
from cuflash2.validate import AttentionShape


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old_dir")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = cp.cuda.Device().id
    arch = launch.device_arch(device)
    s = args.seqlen
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v, dout = (cp.random.standard_normal((b, s, h, d), dtype=np.float32).astype(np.float16)
                             for _ in range(4))
            shape = AttentionShape(b, s, s, h, h, d, "float16", 1 / math.sqrt(d))
            out, lse = cp.empty_like(q), cp.empty((b, h, s), dtype=np.float32)
            stream = cp.cuda.get_current_stream()
            fwd_infos = [describe("x", x) for x in (q, k, v, out, lse)]
            launch.forward(*fwd_infos, shape, causal, device, stream)
            grads = [cp.empty_like(x) for x in (q, k, v)]
            infos = [describe("x", x) for x in (dout, q, k, v, out, lse, *grads)]
            mains = backward_plan(d, "fp16", causal, arch).main
            kernels = {"new": [compiler.get_kernel(c, device) for c in mains],
                       "old": [kernel_from(pathlib.Path(args.old_dir), c) for c in mains]}
            flops = bench.attention_flops(b, s, s, h, d, causal, "bwd")
            results = {"new": [], "old": []}
            for _ in range(args.rounds):
                for name in ("new", "old"):
                    for config, kernel in zip(mains, kernels[name]):
                        compiler._loaded[(device, config)] = kernel
                    ms = bench.time_cuda_ms(lambda: launch.backward(*infos, shape, causal, False, device, stream))
                    results[name].append(flops / ms / 1e9)
            for config, kernel in zip(mains, kernels["new"]):
                compiler._loaded[(device, config)] = kernel
            new, old = statistics.median(results["new"]), statistics.median(results["old"])
            print(f"{mains[-1].short_id():44s} new {new:6.1f} old {old:6.1f} new/old {new / old:.3f}  "
                  f"rounds new {[round(x) for x in results['new']]} old {[round(x) for x in results['old']]}",
                  flush=True)


if __name__ == "__main__":
    main()
