"""One backward pass each of cuflash2 (default plan, the atomic-dQ plan, the fused plan) and torch's FA2, for a
profiler to attach to (d128, seqlen 4k or $SEQLEN with batch x seqlen = 16k, bf16 unless told otherwise):
    ncu --clock-control none -k regex:'flash_bwd|dq_dk_dv' \\
        --section SpeedOfLight --section WarpStateStats python scripts/profile_bwd.py [head_dim] [causal|full] [fused-only]
"""

import math
import os
import sys

import cupy as cp
import numpy as np
import torch

import cuflash2
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.families.mma_sync import fused_backward_supported, head_dim_bucket
from cuflash2.frameworks.arrays import describe
from cuflash2.problem.tensors import AttentionShape


def main():
    head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
    seqlen = int(os.environ.get("SEQLEN", 4096))  # FA2's grid: batch x seqlen = 16k, model dim 2048
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qc, kc, vc, doc = (cp.from_dlpack(x) for x in (q, k, v, dout))
    out, lse = cuflash2.flash_attn_forward(qc, kc, vc, causal=causal)
    shape = AttentionShape(batch, seqlen, seqlen, heads, heads, head_dim, "bfloat16", 1 / math.sqrt(head_dim))
    grads = [cp.empty_like(x) for x in (qc, kc, vc)]
    infos = [describe("x", x) for x in (doc, qc, kc, vc, out, lse, *grads)]
    stream = cp.cuda.get_current_stream()
    for atomic_dq in (False, True) if len(sys.argv) <= 3 or sys.argv[3] != "fused-only" else ():
        launch.backward(*infos, shape, causal, False, 0, stream, atomic_dq)
    if fused_backward_supported(head_dim_bucket(head_dim), 90, causal=causal):  # the one-pass plan too
        launch.backward(*infos, shape, causal, False, 0, stream, fused=True)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    o.backward(dout.transpose(1, 2))
    torch.cuda.synchronize()
    print("ok", np.asarray(cp.asnumpy(grads[0][0, 0, 0, :4])))


if __name__ == "__main__":
    main()
