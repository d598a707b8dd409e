"""A/B of Hopper forward tiles (the wgmma family) beside torch SDPA's cuDNN backend, kernel level.

Times the family's forward entry with a chosen tile (key block rows, consumer warpgroups) on FA2's
grid points, in one process with the same inputs, so a tile change can be judged before it goes
into forward_config. Needs an sm_90 GPU and torch. Example:

    python benchmarks/ab_wgmma.py --head-dim 128 --causal --seqlen 2048,16384 --tiles 128x2,176x2

--baseline FILE[,FILE...] also times each tile built from other versions of the kernel source
(copies placed under kernels_cu/, e.g. kernels_cu/wgmma/flash_fwd_sm90_base.cu from `git show`),
so that a kernel change is judged against the code before it in the same process (--rounds N
times every variant N times in turn: the clocks drift by several percent over a run). Each
variant is labelled with its file name; they must share the host's parameter layout:

    git show HEAD~1:kernels_cu/wgmma/flash_fwd_sm90.cu > kernels_cu/wgmma/flash_fwd_sm90_base.cu
    python benchmarks/ab_wgmma.py --baseline wgmma/flash_fwd_sm90_base.cu --head-dim 64,128,256

A tile may end in 's' (the output staged through shared memory and TMA stores) or 'r' (stored
from registers), and in 'p' (CTA pairs sharing K and V by multicast) or 'u' (unpaired):
--tiles 160x2r,160x2s compares the two epilogues of one tile, --tiles 160x2u,160x2p the pairs.

--split-tail times each variant with the last, partly filled round of non-causal tiles split
across the SMs ("split") and without ("whole"), wherever a split is possible.

Each turn times about 2 ms of calls, at the clock the GPU has then. --seconds S makes each turn a
sustained run of S seconds instead, as a training loop runs: the large points then reach the
board's power limit and a lower clock, where what counts is energy per FLOP (the mean SM clock
and power are printed beside each figure).
"""

import argparse
import dataclasses
import math
import statistics

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuflash2 import bench
from cuflash2.families.wgmma import forward as wgmma
from cuflash2.problem.features import AttentionProblem
from cuflash2.problem.tensors import AttentionShape
from cuflash2.runtime.tensors import TensorInfo


def info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""), "cuda:0",
                      t.data_ptr(), t.element_size())


def tflops(fn, flops: float, rounds: int = 5) -> float:
    """Median over rounds of back-to-back calls between CUDA events (enough calls for ~2 ms)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = max(3, min(30, int(2e12 / flops)))
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return flops / statistics.median(times) / 1e9


def sustained(fn, flops: float, seconds: float) -> tuple[float, float | None, float | None]:
    """TFLOP/s of back-to-back calls for `seconds` (power-limited clocks at the large points), and
    the board's mean SM clock and power (None without NVML; bench.sustained_run)."""
    ms, clock, watts = bench.sustained_run(fn, seconds, cp.cuda.Device().pci_bus_id)
    return flops / ms / 1e9, clock, watts


def timed_in_turn(runs, flops: float, rounds: int, seconds: float = 0.0) -> str:
    """Each (label, fn) of `runs` timed once per round, in turn, the order rotated by one each round
    (the clock follows the previous turn's power draw with some lag, so a fixed order would always
    time a variant right after the same one; with as many rounds as runs each takes every place
    once): the median round per label, and the range when rounds > 1. With `seconds`, each turn is
    a sustained run of that length, with its mean SM clock and power."""
    results = {label: [] for label, _ in runs}
    boards = {label: [] for label, _ in runs}
    for r in range(rounds):
        for label, fn in runs[r % len(runs):] + runs[:r % len(runs)]:
            if seconds > 0:
                rate, clock, watts = sustained(fn, flops, seconds)
                results[label].append(rate)
                boards[label].append((clock, watts))
            else:
                results[label].append(tflops(fn, flops))
    cells = []
    for label, values in results.items():
        spread = f" ({min(values):.0f}-{max(values):.0f})" if rounds > 1 else ""
        board = ""
        measured = [(c, w) for c, w in boards[label] if c is not None]
        if measured:
            board = (f" [{statistics.mean(c for c, _ in measured):.0f} MHz"
                     f" {statistics.mean(w for _, w in measured):.0f} W]")
        cells.append(f"{label} {statistics.median(values):6.1f}{spread}{board}")
    return " | ".join(cells)


def with_source(config, source_file: str):
    """`config` built from another kernel source file (a subclass: its kernels are cached apart)."""

    @dataclasses.dataclass(frozen=True)
    class Baseline(type(config)):
        pass

    Baseline.source_file = source_file
    return Baseline(**dataclasses.asdict(config))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", default="128", help="comma list")
    parser.add_argument("--baseline", default="",
                        help="comma list of kernel sources (relative to kernels_cu/) to compare with")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", default="512,2048,16384", help="comma list; batch = 16384 // seqlen")
    parser.add_argument("--tiles", default="",
                        help="comma list of BLOCKNxGROUPS[s|r][p|u]: output staged or from registers, CTA pairs "
                             "or not (default: forward_config's, as a call of that length runs it)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--split-tail", action="store_true",
                        help="time each variant with and without a split tail (non-causal)")
    parser.add_argument("--rounds", type=int, default=1, help="times every variant once per round, in turn")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="each turn a sustained run of this many seconds (power-limited clocks), with "
                             "the mean SM clock and board power (NVML)")
    args = parser.parse_args()
    for d in map(int, args.head_dim.split(",")):
        compare(d, args)


def parse_tile(text: str, default) -> tuple[int, int, bool, bool, bool]:
    """(key block rows, consumer groups, staged output, CTA pairs, pairs asked for) from
    BLOCKNxGROUPS[s|r][p|u]; `default`'s where a letter is left out."""
    flags = text[len(text.rstrip("srpu")):]
    staged = "s" in flags or ("r" not in flags and default.staged_output)
    pairs = "p" in flags or ("u" not in flags and default.cluster_kv)
    block_n, groups = map(int, text.rstrip("srpu").split("x"))
    return block_n, groups, staged, pairs, "p" in flags


def compare(d: int, args) -> None:
    dtype = getattr(torch, args.dtype)
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    for s in map(int, args.seqlen.split(",")):
        b, h = max(1, 16384 // s), 2048 // d
        problem = AttentionProblem(AttentionShape(b, s, s, h, h, d, args.dtype, 1 / math.sqrt(d)), args.causal)
        # What a call of this length runs.
        default = wgmma.paired(wgmma.forward_config(d, args.dtype, args.causal, seqlen=s), problem)
        tiles = [parse_tile(t, default) for t in args.tiles.split(",") if t] or [
            (default.block_n, default.groups, default.staged_output, default.cluster_kv, False)]
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        infos = [info(x) for x in (q, k, v, out, lse)]
        flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

        runs = [("cuDNN", cudnn)]
        for block_n, groups, staged, pairs, pairs_asked in tiles:
            config = dataclasses.replace(default, block_n=block_n, groups=groups, staged_output=staged,
                                         cluster_kv=pairs)
            # A baseline source from before the pairs would ignore CF_CLUSTER_KV and wait forever
            # for the half of each block its pair never loads: unpaired unless 'p' asks for them.
            baseline = dataclasses.replace(config, cluster_kv=pairs and pairs_asked)
            variants = [("", config)] + [(f"{source.rsplit('/', 1)[-1].removesuffix('.cu')} ", with_source(baseline, source))
                                         for source in filter(None, args.baseline.split(","))]
            splits = [("split ", True), ("whole ", False)] if args.split_tail and not pairs else [("", None)]
            for label, variant in variants:
                for split_label, split in splits:
                    runs.append((f"{split_label}{label}n{block_n} g{groups}{' staged' if staged else ''}"
                                 f"{' pairs' if pairs else ''}",
                                 lambda variant=variant, split=split: wgmma.forward(problem, *infos, 0, stream,
                                                                                    config=variant, split_setting=split)))
        timings = timed_in_turn(runs, flops, args.rounds, args.seconds)
        print(f"d{d} {'causal' if args.causal else 'full'} s{s:6d}: {timings} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
