"""A few backward calls of one problem on the Hopper family (or SDPA's cuDNN backend), for a
profiler to attach to: FA2's grid (batch x seqlen = 16k, model dim 2048), bf16. Usage:
    python scripts/profile_hopper_bwd.py [head_dim] [causal|full] [seqlen] [cudnn]
e.g. ncu -k regex:flash_bwd_sm90 -s 1 -c 1 ... python scripts/profile_hopper_bwd.py 128 full 2048
(the cuDNN kernel: -k regex:bprop and the cudnn argument)."""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash2


def main():
    head_dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
    seqlen = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    use_cudnn = len(sys.argv) > 4 and sys.argv[4] == "cudnn"
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    if use_cudnn:
        leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        backward = lambda: torch.autograd.grad(out, leaves, dout.transpose(1, 2), retain_graph=True)  # noqa: E731
    else:
        out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
        backward = lambda: cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
