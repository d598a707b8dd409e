"""A/B of the Hopper backward (the wgmma family, head dims 64 and 128) beside torch SDPA's cuDNN and flash
backends, kernel level: the family's backward entry on described tensors, in one process with the
same inputs, so that a kernel change is judged against the code before it. Needs an sm_90 GPU and
torch. Example (the previous kernel saved under kernels_cu/ first):

    git show HEAD~1:kernels_cu/wgmma/flash_bwd_sm90.cu > kernels_cu/wgmma/flash_bwd_sm90_base.cu
    python benchmarks/ab_wgmma_bwd.py --baseline wgmma/flash_bwd_sm90_base.cu --seqlen 2048,8192 --causal

A kernel source from before the persistent grid takes five template parameters: add a sixth,
`bool = false`, to its flash_bwd_sm90 template before timing it (the launch names six). A source
from before the TMA stores of dK and dV has a 704-byte BwdParams: add `TensorMap dk_map, dv_map;`
after do_map and `int dkv_by_tma;` at the end (and the static_assert's 960) before timing it, since
the host packs the 960-byte struct.

FLOPs follow FA2's convention (2.5x the forward's).
"""

import argparse
import contextlib
import dataclasses
import math

import cupy as cp
import torch
import torch.nn.functional as F
from ab_wgmma import info, timed_in_turn, with_source  # the forward's A/B helpers (run from benchmarks/)
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash2
from cuflash2.families.wgmma import backward as wgmma_bwd
from cuflash2.problem.features import AttentionProblem
from cuflash2.problem.tensors import AttentionShape


@contextlib.contextmanager
def registers_only():
    """The host decides that dK and dV are stored from registers. A plain attribute swap: mock.patch
    cost enough host time per call to slow the timed loop by up to 5%."""
    decide = wgmma_bwd.stores_key_gradients_by_tma
    wgmma_bwd.stores_key_gradients_by_tma = lambda *args: False
    try:
        yield
    finally:
        wgmma_bwd.stores_key_gradients_by_tma = decide


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", default="2048,8192", help="comma list; batch = 16384 // seqlen, 2048 // d heads")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, choices=wgmma_bwd.HEAD_DIMS, default=128)
    parser.add_argument("--heads-kv", type=int, default=0, help="default: as many as query heads")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--deterministic", action="store_true", help="also time deterministic=True's kernel")
    parser.add_argument("--baseline", default="",
                        help="comma list of kernel sources (relative to kernels_cu/) to compare with")
    parser.add_argument("--rounds", type=int, default=1, help="times every variant once per round, in turn")
    parser.add_argument("--both-grids", action="store_true",
                        help="time each kernel with one CTA per tile and with the persistent grid")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="each turn a sustained run of this many seconds (power-limited clocks), with "
                             "the mean SM clock and board power (NVML); steadier than the short turns")
    parser.add_argument("--register-stores", action="store_true",
                        help="also time each kernel with dK and dV stored from registers (not by TMA)")
    args = parser.parse_args()
    d, dtype = args.head_dim, getattr(torch, args.dtype)
    h = 2048 // d  # FA2's grid: model dim 2048
    hk = args.heads_kv or h
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for s in map(int, args.seqlen.split(",")):
        b = max(1, 16384 // s)
        q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        out, lse = cuflash2.flash_attn_forward(q, k, v, causal=args.causal)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        shape = AttentionShape(b, s, s, h, hk, d, args.dtype, 1 / math.sqrt(d))
        problem = AttentionProblem(shape, args.causal)
        infos = [info(x) for x in (dout, q, k, v, out, lse, *grads)]
        flops = 2.5 * 4 * b * h * s * s * d / (2 if args.causal else 1)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def sdpa(backend):
            with sdpa_kernel(backend):
                result = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=args.causal,
                                                        enable_gqa=hk != h).transpose(1, 2)
            return lambda: torch.autograd.grad(result, leaves, dout, retain_graph=True)

        runs = [("cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION)), ("FA2", sdpa(SDPBackend.FLASH_ATTENTION))]
        config = wgmma_bwd.WgmmaBwdConfig(d, args.causal, args.dtype, hk != h,
                                          persistent=wgmma_bwd.persistent_grid(d, args.causal, False, s))
        sources = [("", config)] + [(f"{source.rsplit('/', 1)[-1].removesuffix('.cu')} ", with_source(config, source))
                                    for source in filter(None, args.baseline.split(","))]
        variants = list(sources)
        if args.both_grids:  # each source's kernel on both grids
            variants = [(label + ("persistent " if persistent else "per-tile "),
                         dataclasses.replace(variant, persistent=persistent))
                        for label, variant in sources for persistent in (False, True)]
        if args.deterministic:  # each source's deterministic=True kernel too (always one CTA per tile)
            variants += [(label + "deterministic ", dataclasses.replace(variant, deterministic=True, persistent=False))
                         for label, variant in sources]
        stores = [("", contextlib.nullcontext)]
        if args.register_stores:
            stores.append(("registers ", registers_only))
        for label, variant in variants:
            for store_label, store in stores:
                def run(variant=variant, store=store):
                    with stream, store():  # its scratch (CuPy's pool) on the same stream
                        wgmma_bwd.backward(problem, *infos, 0, stream, config=variant)
                runs.append((f"{label}{store_label}wgmma", run))
        print(f"d{d} {'causal' if args.causal else 'full'} s{s:6d}: {timed_in_turn(runs, flops, args.rounds, args.seconds)} TFLOP/s",
              flush=True)


if __name__ == "__main__":
    main()
