"""Forward/backward benchmark (+ forward tile sweep) on the GPU, next to torch SDPA (flash, cuDNN)
in the same run, each point timed in rounds that rotate the order of the implementations (medians).
Usage: python benchmarks/bench_kernels.py [--sweep] [--seqlens 4096] [--modes fwd,bwd] [--rounds 3]
"""

import argparse
import json
import math
import statistics

import cupy as cp
import numpy as np

import cuflash2
from cuflash2 import bench
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.frameworks.arrays import describe
from cuflash2.families.mma_sync import FUSED_BWD_HEAD_DIMS, FWD, KernelConfig, forward_config
from cuflash2.problem.tensors import AttentionShape


def torch_sdpa(backend_name):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return run


def torch_sdpa_bwd(backend_name, q, k, v, causal):
    import torch

    qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
    out = torch_sdpa(backend_name)(qt, kt, vt, causal)
    grad = torch.randn_like(out)

    def run():
        torch.autograd.grad(out, (qt, kt, vt), grad, retain_graph=True)
    return run


def bwd_kernel_call(q, k, v, causal, split=None, atomic_dq=None, tile=None, fused=None):
    """One backward pass at launch level (no per-call Python validation), as a callable."""
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    out, lse = cuflash2.flash_attn_forward(qc, kc, vc, causal=causal)
    dout = cp.from_dlpack(q.clone().normal_())
    b, s, h, d = qc.shape
    shape = AttentionShape(b, s, s, h, h, d, np.dtype(qc.dtype).name, 1 / math.sqrt(d))
    grads = [cp.empty_like(x) for x in (qc, kc, vc)]
    infos = [describe("x", x) for x in (dout, qc, kc, vc, out, lse, *grads)]
    stream = cp.cuda.get_current_stream()
    return lambda: launch.backward(*infos, shape, causal, False, 0, stream, atomic_dq, split, tile=tile, fused=fused)


def bench_bwd(q, k, v, causal, flops, split=None, atomic_dq=None, tile=None, fused=None):
    """Backward kernels alone, TFLOP/s."""
    return flops / bench.time_cuda_ms(bwd_kernel_call(q, k, v, causal, split, atomic_dq, tile, fused)) / 1e9


# (block_m, warps, stages) of the main backward kernel when it accumulates dQ itself.
BWD_ATOMIC_SWEEP = {64: [(64, 4, 2), (64, 8, 2), (32, 8, 2)], 128: [(32, 4, 1), (32, 8, 1), (32, 8, 2)],
                    256: [(32, 4, 1), (32, 2, 1)]}


def bwd_api_call(q, k, v, causal):
    """torch autograd through cuflash2's custom op (what a torch user gets), backward only."""
    import torch

    qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
    out = cuflash2.flash_attn_func(qt, kt, vt, causal=causal)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), grad, retain_graph=True)


def median_tflops(calls, flops, rounds):
    """TFLOP/s of each named call: medians over `rounds` rounds that time every call in turn, in
    bench.round_order (rotating, cuDNN last: the kernel timed right after cuDNN measures slower)."""
    names = list(calls)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in bench.round_order(names, r):
            try:
                samples[name].append(flops / bench.time_cuda_ms(calls[name], 3, 10) / 1e9)
            except Exception:  # backend unavailable for this shape
                samples[name].append(float("nan"))
    return {name: _median_or_nan(values) for name, values in samples.items()}


def _median_or_nan(values):
    """The median, or NaN when any round failed (a backend that fails now and then has no figure)."""
    return float("nan") if any(math.isnan(v) for v in values) else statistics.median(values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="4096")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tiles", default=None,
                        help="forward tiles of the sweep as block_m,block_n,warps,stages;... (default: a fixed list)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per point (medians)")
    args = parser.parse_args()
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        for head_dim in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=tdtype) for _ in range(3))
                for mode in args.modes.split(","):
                    flops = bench.attention_flops(batch, seqlen, seqlen, heads, head_dim, causal, mode)
                    row = {"mode": mode, "seqlen": seqlen, "head_dim": head_dim, "causal": causal}
                    row.update(median_tflops(point_calls(mode, q, k, v, causal), flops, args.rounds))
                    if args.sweep and mode == "bwd":
                        row["dq_kernel"] = bench_bwd(q, k, v, causal, flops, atomic_dq=False)
                        row["atomic"] = bench_bwd(q, k, v, causal, flops, atomic_dq=True)
                        if head_dim in FUSED_BWD_HEAD_DIMS:
                            row["fused"] = bench_bwd(q, k, v, causal, flops, fused=True)
                        row["atomic_tiles"] = {
                            str(tile): round(bench_bwd(q, k, v, causal, flops, atomic_dq=True, tile=tile), 1)
                            for tile in BWD_ATOMIC_SWEEP.get(head_dim, ())}
                    if args.sweep and mode == "fwd":
                        tiles = ([tuple(map(int, t.split(","))) for t in args.tiles.split(";")] if args.tiles
                                 else SWEEP_TILES)
                        row["sweep"] = sweep(q, k, v, causal, args.dtype, flops, tiles, args.rounds)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'mode':>4} {'seqlen':>6} {'hdim':>4} {'causal':>6} {'cuflash2':>9} {'flash':>7} {'cudnn':>7} {'vs flash':>8}")
    for r in rows:
        print(f"{r['mode']:>4} {r['seqlen']:6d} {r['head_dim']:4d} {str(r['causal']):>6} {r['cuflash2']:9.1f} "
              f"{r['flash']:7.1f} {r['cudnn']:7.1f} {r['cuflash2'] / r['flash']:8.2f}"
              + f"  kernel-only {r['kernel']:.1f}")
    print_parity(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def print_parity(rows):
    """How many points reach FA2's speed, for the API and the kernels alone, and which do not."""
    for column in ("cuflash2", "kernel"):
        timed = [r for r in rows if column in r and not math.isnan(r[column]) and not math.isnan(r["flash"])]
        below = [r for r in timed if r[column] < r["flash"]]
        print(f"{column}: {len(timed) - len(below)} of {len(timed)} points at or above FA2"
              + "".join(f"; {r['mode']} {r['seqlen']} d{r['head_dim']}{' causal' if r['causal'] else ''} "
                        f"{r[column] / r['flash']:.3f}x" for r in below))


def fwd_kernel_call(q, k, v, causal, config=None):
    """One forward pass at launch level (no per-call Python validation), as a callable."""
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    b, s, h, d = qc.shape
    shape = AttentionShape(b, s, s, h, h, d, np.dtype(qc.dtype).name, 1 / math.sqrt(d))
    out, lse = cp.empty_like(qc), cp.empty((b, h, s), dtype=np.float32)
    infos = [describe("x", x) for x in (qc, kc, vc, out, lse)]
    stream = cp.cuda.get_current_stream()
    return lambda: launch.forward(*infos, shape, causal, 0, stream, config)


def bench_fwd_kernel(q, k, v, causal, flops, config=None):
    """Forward kernel alone, TFLOP/s."""
    return flops / bench.time_cuda_ms(fwd_kernel_call(q, k, v, causal, config), 3, 10) / 1e9


def point_calls(mode, q, k, v, causal):
    """The calls one grid point times: cuflash2's public API (torch tensors), its kernels alone,
    and torch SDPA's flash and cuDNN backends."""
    if mode == "fwd":
        calls = {"cuflash2": lambda: cuflash2.flash_attn_func(q, k, v, causal=causal),
                 "kernel": fwd_kernel_call(q, k, v, causal)}
    else:
        calls = {"cuflash2": bwd_api_call(q, k, v, causal), "kernel": bwd_kernel_call(q, k, v, causal)}
    for name in ("flash", "cudnn"):
        try:
            fn = torch_sdpa(name)
            calls[name] = (lambda fn=fn: fn(q, k, v, causal)) if mode == "fwd" else torch_sdpa_bwd(name, q, k, v, causal)
        except Exception:  # backend unavailable for this shape: timed as NaN
            calls[name] = _unavailable
    return calls


def _unavailable():
    raise RuntimeError("backend unavailable")


SWEEP_TILES = [(128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 4, 4), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2),
               (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2)]


def sweep(q, k, v, causal, dtype, flops, tiles=SWEEP_TILES, rounds=3):
    """TFLOP/s of alternative tile shapes (for tuning the config table), timed in rotating rounds."""
    d = q.shape[-1]
    calls = {}
    for block_m, block_n, warps, stages in tiles:
        config = KernelConfig(FWD, dtype, forward_config(d, dtype, causal, 90).head_dim, block_m, block_n, warps,
                              stages, causal)
        if config.smem_bytes <= 227 * 1024:
            calls[config.short_id()] = fwd_kernel_call(q, k, v, causal, config)
    return {name: round(value, 1) for name, value in median_tflops(calls, flops, rounds).items()}


if __name__ == "__main__":
    main()
