"""One forward pass each of cuflash2 (default tile) and torch's FA2 on the same inputs, for a profiler
to attach to (seqlen 4k or $SEQLEN with batch x seqlen = 16k, bf16, 2048 model dim):
    ncu --clock-control none -k regex:flash_fwd --section SpeedOfLight --section WarpStateStats \\
        python scripts/profile_fwd.py [head_dim] [causal]
"""

import os
import sys

import cupy as cp
import torch

import cuflash2


def main():
    head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
    seqlen = int(os.environ.get("SEQLEN", 4096))
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    out, _ = cuflash2.flash_attn_forward(qc, kc, vc, causal=causal)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                               is_causal=causal)
    torch.cuda.synchronize()
    diff = (torch.from_dlpack(out).float() - ref.transpose(1, 2).float()).abs().max().item()
    print(f"ok, max |cuflash2 - FA2| = {diff:.2e}")


if __name__ == "__main__":
    main()
