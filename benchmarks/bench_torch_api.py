"""What a torch user gets: time per call of cuflash2.flash_attn_func on torch tensors, forward alone
(no gradients) and a training step (forward + backward through autograd), by the eager path (the
torch.autograd.Function that eager calls take) and by the custom ops (what torch.compile sees),
next to torch SDPA's flash backend (FA2) on the same tensors. FA2's grid: batch * seqlen = 16k,
model dim 2048. Usage: python benchmarks/bench_torch_api.py [--seqlens 512,1024] [--head-dims 64,128,256]
[--json FILE]"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuflash2  # noqa: E402
from cuflash2 import bench
from cuflash2.frameworks import torch_adapter as torch_ops  # noqa: E402

PATHS = ("eager", "op", "flash")
original_compiling = torch_ops._compiling  # "op" replaces it: calls then take the custom ops


def make_call(path, mode, q, k, v, grad, causal):
    leaves = [x.detach().requires_grad_(mode == "train") for x in (q, k, v)]

    def attention():
        if path == "flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                qt, kt, vt = (x.transpose(1, 2) for x in leaves)
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        torch_ops._compiling = (lambda: True) if path == "op" else original_compiling
        return cuflash2.flash_attn_func(*leaves, causal=causal)

    def train():
        for x in leaves:
            x.grad = None
        attention().backward(grad)

    return train if mode == "train" else attention


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="512,1024,2048,4096")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v, grad = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
                                 for _ in range(4))
                for mode in ("fwd", "train"):
                    flops = bench.attention_flops(batch, seqlen, seqlen, heads, head_dim, causal,
                                                  "fwd" if mode == "fwd" else "fwd+bwd")
                    samples = {path: [] for path in PATHS}
                    for r in range(args.rounds):  # rotating order: no path always follows the same one
                        for path in PATHS[r % 3:] + PATHS[:r % 3]:
                            call = make_call(path, mode, q, k, v, grad, causal)
                            samples[path].append(bench.time_cuda_ms(call, 3, 10))
                    torch_ops._compiling = original_compiling
                    ms = {path: statistics.median(values) for path, values in samples.items()}
                    row = {"mode": mode, "seqlen": seqlen, "head_dim": head_dim, "causal": causal,
                           **{f"{p}_ms": round(t, 4) for p, t in ms.items()},
                           **{f"{p}_tflops": round(flops / t / 1e9, 1) for p, t in ms.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'mode':>5} {'seqlen':>6} {'hdim':>4} {'causal':>6} {'eager ms':>9} {'op ms':>8} {'FA2 ms':>8} "
          f"{'eager/FA2':>9} {'op/FA2':>7}")
    for r in rows:
        print(f"{r['mode']:>5} {r['seqlen']:6d} {r['head_dim']:4d} {str(r['causal']):>6} {r['eager_ms']:9.3f} "
              f"{r['op_ms']:8.3f} {r['flash_ms']:8.3f} {r['flash_ms'] / r['eager_ms']:9.2f} "
              f"{r['flash_ms'] / r['op_ms']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
