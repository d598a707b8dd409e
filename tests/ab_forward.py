"""A/B of the forward kernels against an older copy of kernels_cu/, same process, interleaved.

Usage: python tests/ab_forward.py OLD_KERNELS_DIR [--head-dims 64,128,256] [--seqlen 4096] [--rounds 3]
Each default tile is compiled from both source trees and timed alternately (new, old, new, ...),
so clock drift hits both sides alike; prints kernel-only TFLOP/s and the new / old ratio.
"""

import argparse
import math
import pathlib
import re
import statistics

import cupy as cp
import numpy as np

from cuflash2 import bench, compiler, launch
from cuflash2.config import forward_config
from cuflash2.interop import describe
from cuflash2.validate import AttentionShape

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def source_from(folder: pathlib.Path, name: str) -> str:
    seen = set()

    def expand(n):
        if n in seen:
            return ""
        seen.add(n)
        return _INCLUDE.sub(lambda m: expand(m.group(1)), (folder / n).read_text())
    return expand(name)


def kernel_from(folder, config):
    module = cp.RawModule(code=source_from(folder, config.source_file), options=compiler._NVRTC_OPTIONS,
                          name_expressions=[config.template_name()])
    kernel = module.get_function(config.template_name())
    kernel.max_dynamic_shared_size_bytes = config.smem_bytes
    return kernel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old_dir")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = cp.cuda.Device().id
    s = args.seqlen
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=np.float32).astype(np.float16) for _ in range(3))
            shape = AttentionShape(b, s, s, h, h, d, "float16", 1 / math.sqrt(d))
            out, lse = cp.empty_like(q), cp.empty((b, h, s), dtype=np.float32)
            infos = [describe("x", x) for x in (q, k, v, out, lse)]
            fp16 = forward_config(d, "fp16", causal, launch.device_arch(device))
            kernels = {"new": compiler.get_kernel(fp16, device), "old": kernel_from(pathlib.Path(args.old_dir), fp16)}
            flops = bench.attention_flops(b, s, s, h, d, causal)
            results = {"new": [], "old": []}
            for _ in range(args.rounds):
                for name in ("new", "old"):
                    compiler._loaded[(device, fp16)] = kernels[name]
                    stream = cp.cuda.get_current_stream()
                    ms = bench.time_cuda_ms(lambda i=infos, sh=shape, c=causal, st=stream, cf=fp16:
                                            launch.forward(*i, sh, c, device, st, cf))
                    results[name].append(flops / ms / 1e9)
            compiler._loaded[(device, fp16)] = kernels["new"]
            new, old = statistics.median(results["new"]), statistics.median(results["old"])
            print(f"{fp16.short_id():40s} new {new:6.1f} old {old:6.1f} new/old {new / old:.3f}  "
                  f"rounds new {[round(x) for x in results['new']]} old {[round(x) for x in results['old']]}",
                  flush=True)


if __name__ == "__main__":
    main()
