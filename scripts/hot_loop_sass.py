"""The hot loops of the Hopper kernels in SASS: length and what runs off the uniform datapath.

A wgmma takes its shared-memory descriptors from uniform registers. When ptxas cannot prove that the
addresses behind them are the same in every lane of a warp (an index from threadIdx.x, a value read
from shared memory, a branch on the consumer group), it builds each descriptor in vector registers
and copies it over with R2UR before every wgmma, whose latency then sits between the wgmma issues
(docs/design-notes.md: "The group index, warp-uniform", "Branches around barriers cost the uniform
datapath"). For each instantiation this compiles the kernel with NVRTC, disassembles the cubin
with nvdisasm (CUDA toolkit; not needed by the package) and prints, for the innermost loop that
issues wgmmas (the forward's key loop, the backward's step loop), its SASS instructions, its
HGMMAs, and its R2UR copies:

    python scripts/hot_loop_sass.py [--family fwd,bwd] [--head-dim 64,128,256] [--nvdisasm PATH]

A kernel change that lengthens a loop or brings R2UR back into it is worth a kernel A/B before it
lands.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from softmax_overlap import forward_configs, sass

from cuflash2.families.wgmma import backward


def loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of each loop: a branch back to a label defined above it."""
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if line.startswith(".L") and line.endswith(":")}
    found = []
    for i, line in enumerate(lines):
        if "BRA" in line and "`(" in line:
            target = line.split("`(")[1].split(")")[0]
            if labels.get(target, i) < i:
                found.append((labels[target], i))
    return found


def hot_loop(lines: list[str]) -> list[str]:
    """The instructions of the shortest loop that issues a wgmma (labels left out)."""
    with_mma = [(a, b) for a, b in loops(lines) if any("HGMMA" in line for line in lines[a:b + 1])]
    if not with_mma:
        return []
    a, b = min(with_mma, key=lambda ab: ab[1] - ab[0])
    return [line for line in lines[a:b + 1] if line and not line.startswith(".L")]


def configs(families: list[str], head_dims: list[int]) -> list:
    chosen = []
    if "fwd" in families:
        chosen += forward_configs(head_dims)
    if "bwd" in families:
        chosen += [c for c in backward.all_configs() if isinstance(c, backward.WgmmaBwdConfig)
                   and c.head_dim in head_dims and c.dtype == "bfloat16" and not c.gqa and not c.deterministic]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="fwd,bwd", help="comma list of fwd, bwd")
    parser.add_argument("--head-dim", default="64,128,256")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = parser.parse_args()
    for config in configs(args.family.split(","), [int(d) for d in args.head_dim.split(",")]):
        body = hot_loop(sass(config, args.nvdisasm))
        count = lambda op: sum(op in line.split(" ;")[0] for line in body)  # noqa: E731
        print(f"{config.short_id():48s} {len(body):5d} instructions, {count('HGMMA'):3d} HGMMA, "
              f"{count('R2UR'):3d} R2UR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
