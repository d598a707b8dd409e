"""A/B of the backward main kernels against an older copy of kernels_cu/, same process, interleaved.

Usage: python benchmarks/ab_backward.py OLD_KERNELS_DIR[,OTHER_DIR...] [--head-dims 64,128,256] [--seqlen 4096] [--rounds 3]
The default plan's main kernels (fused or not) are compiled from both source trees and the whole
backward pass is timed alternately (new, old, new, ...); the old tree must keep the host contract
(shared memory, accumulator layout). Prints kernel-level TFLOP/s and the new / old ratio.
"""

import cupy as cp
import numpy as np
from ab_forward import compare, parse_args, problems

from cuflash2 import bench
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.families.mma_sync import backward_plan
from cuflash2.frameworks.arrays import describe


def main():
    args = parse_args()
    device = cp.cuda.Device().id
    arch = launch.device_arch(device)
    stream = cp.cuda.get_current_stream()
    for d, causal, shape, (q, k, v, dout) in problems(args, 4):
        b, s, h = shape.batch, shape.seqlen_q, shape.nheads
        out, lse = cp.empty_like(q), cp.empty((b, h, s), dtype=np.float32)
        launch.forward(*[describe("x", x) for x in (q, k, v, out, lse)], shape, causal, device, stream)
        grads = [cp.empty_like(x) for x in (q, k, v)]
        infos = [describe("x", x) for x in (dout, q, k, v, out, lse, *grads)]
        compare(args, device, backward_plan(d, "fp16", causal, arch).main,
                lambda: launch.backward(*infos, shape, causal, False, device, stream),
                bench.attention_flops(b, s, s, h, d, causal, "bwd"), label_width=44)


if __name__ == "__main__":
    main()
