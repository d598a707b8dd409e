"""A/B of the forward kernels against an older copy of kernels_cu/, same process, interleaved.

Usage: python benchmarks/ab_forward.py OLD_KERNELS_DIR[,OTHER_DIR...] [--head-dims 64,128,256] [--seqlen 4096] [--rounds 3]
Each default tile is compiled from this tree and from every listed source tree and timed in turn
(new, old, other, new, ...), so clock drift hits every side alike; prints kernel-only TFLOP/s and
each tree's figure over the first old tree's. The old trees' kernels are launched by this tree's
host code, so they must keep its launch contract (since 1666d69: causal grids in the grouped
order, nheads as the last argument); to compare host changes too, use benchmarks/ab_trees.py.
"""

import argparse
import math
import pathlib
import re
import statistics

import cupy as cp
import numpy as np

from cuflash2 import bench
from cuflash2.runtime import compiler
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.families.mma_sync import forward_config
from cuflash2.frameworks.arrays import describe
from cuflash2.problem.tensors import AttentionShape

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


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("old_dir")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def problems(args, n_inputs):
    """FA2's grid point per head dim of args (batch x seqlen = 16k, model dim 2048), causal or not:
    (head_dim, causal, AttentionShape, n_inputs random fp16 arrays of shape (b, s, h, d))."""
    s = args.seqlen
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            arrays = [cp.random.standard_normal((b, s, h, d), dtype=np.float32).astype(np.float16)
                      for _ in range(n_inputs)]
            yield d, causal, AttentionShape(b, s, s, h, h, d, "float16", 1 / math.sqrt(d)), arrays


def compare(args, device, configs, run, flops, label_width=40):
    """Times `run` with the kernels of `configs` compiled from this tree ("new") and from each
    directory of args.old_dir (comma-separated; the first is "old"), in turn for args.rounds rounds;
    prints the median TFLOP/s of each and its ratio to the old tree's."""
    old_dirs = args.old_dir.split(",")
    names = ["new", "old"] + old_dirs[1:]  # the other trees go by their paths (unique, unlike base names)
    kernels = {"new": [compiler.get_kernel(c, device) for c in configs]}
    for name, folder in zip(names[1:], old_dirs):
        kernels[name] = [kernel_from(pathlib.Path(folder), c) for c in configs]
    results = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            for config, kernel in zip(configs, kernels[name]):
                compiler._loaded[(device, config)] = kernel
            results[name].append(flops / bench.time_cuda_ms(run) / 1e9)
    for config, kernel in zip(configs, kernels["new"]):
        compiler._loaded[(device, config)] = kernel
    medians = {name: statistics.median(results[name]) for name in names}
    parts = [f"{name} {medians[name]:6.1f}" for name in names]
    ratios = [f"{name}/old {medians[name] / medians['old']:.3f}" for name in names if name != "old"]
    print(f"{configs[-1].short_id():{label_width}s} {' '.join(parts)}  {' '.join(ratios)}  rounds "
          + " ".join(f"{name} {[round(x) for x in results[name]]}" for name in names), flush=True)


def main():
    args = parse_args()
    device = cp.cuda.Device().id
    stream = cp.cuda.get_current_stream()
    for d, causal, shape, (q, k, v) in problems(args, 3):
        b, s, h = shape.batch, shape.seqlen_q, shape.nheads
        out, lse = cp.empty_like(q), cp.empty((b, h, s), dtype=np.float32)
        infos = [describe("x", x) for x in (q, k, v, out, lse)]
        fp16 = forward_config(d, "fp16", causal, launch.device_arch(device), seqlen=s)
        compare(args, device, [fp16], lambda: launch.forward(*infos, shape, causal, device, stream, fp16),
                bench.attention_flops(b, s, s, h, d, causal))


if __name__ == "__main__":
    main()
