"""Where the Hopper forward's softmax lands in the SASS: before or after the wait for the P V in flight.

ptxas moves a wgmma wait (WARPGROUP.DEPBAR) to the top of its basic block, so the order written in
the kernel is not the order that runs (docs/design-notes.md, "The softmax beside its own P V"). For
each forward instantiation this compiles the kernel with NVRTC, disassembles the cubin with
nvdisasm (CUDA toolkit; not needed by the package) and, at each key-loop wait for the Q K^T
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`), counts the exp2 (MUFU.EX2) issued before and after the next
wait for everything (`gsb0, 0x0`):

    python scripts/softmax_overlap.py [--head-dim 64,128,256] [--nvdisasm PATH]

"before" is the softmax running beside the P V; "after" is the softmax running once it completed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile

from cuflash2.families.wgmma import forward
from cuflash2.runtime import compiler


def sass(config, nvdisasm: str) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiler.compile_cubin(config, "sm_90a"))
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in text.splitlines()]


def softmax_sides(lines: list[str]) -> list[tuple[int, int]]:
    """(exp2 before, exp2 after) the wait for everything, per key-loop wait for the Q K^T."""
    sides = []
    for i, line in enumerate(lines):
        if "DEPBAR.LE gsb0, 0x1" not in line:
            continue
        before = after = 0
        waited = False
        for later in lines[i + 1:]:
            if "HGMMA" in later or "BAR.SYNC" in later or (waited and "DEPBAR.LE gsb0, 0x0" in later):
                break
            if "DEPBAR.LE gsb0, 0x0" in later:
                waited = True
            elif "MUFU.EX2" in later:
                after += waited
                before += not waited
        sides.append((before, after))
    return sides


def forward_configs(head_dims) -> list:
    """The bf16 forward instantiations a call at these head dims can pick (causal or not, each
    length class): forward.all_configs() at the kernel head dims they round up to."""
    kernel_dims = {-(-d // 16) * 16 for d in head_dims}
    return [c for c in forward.all_configs() if c.head_dim in kernel_dims and c.dtype == "bfloat16"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", default="64,128,256")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = parser.parse_args()
    for config in forward_configs(map(int, args.head_dim.split(","))):
        sides = softmax_sides(sass(config, args.nvdisasm))
        print(f"{config.short_id()}: " + ", ".join(f"{b} before / {a} after" for b, a in sides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
