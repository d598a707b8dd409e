"""How a short timing sample depends on what the GPU ran just before it: per-sample rate and SM clock.

A short sample (a few milliseconds of calls, as `cuflash2 bench` takes by default) falls inside the
board's power controller's response: after an idle second an H200 runs at its top clock for about
the first 50-100 ms of calls, then settles at the clock that its power limit allows for that
kernel; right after another kernel's load it starts from that kernel's clock. This times one
implementation in samples of 5 back-to-back calls right after a 0.3 s load of another (or of
itself, or after an idle second), and prints the rate and the SM clock (NVML) per group of 10
samples, so that the transient is visible. Needs CuPy, torch and an sm_90 GPU:

    python benchmarks/clock_transient.py [--dtype fp16,bf16] [--seqlen 2048,4096] [--head-dim 128]
"""

import argparse
import statistics
import sys
import time

import cupy as cp

from cuflash2 import bench
from cuflash2.cli import bench_run  # the CLI's problems and runners: the calls `cuflash2 bench` times

IMPLS = ("cuflash2", "torch-cudnn", "torch-flash")
#: (what ran before: an implementation, or None for an idle second; what is timed)
ORDERS = (("torch-cudnn", "cuflash2"), ("cuflash2", "torch-cudnn"), (None, "cuflash2"), (None, "torch-cudnn"),
          ("torch-flash", "torch-cudnn"), ("cuflash2", "cuflash2"), ("torch-cudnn", "torch-cudnn"))


def samples(fn, monitor, count: int, calls: int = 5) -> list[tuple[float, float]]:
    """(ms per call, SM clock in MHz read right after) of `count` samples of `calls` calls each."""
    clocks = []

    def read_clock():
        reading = monitor.read_now()
        clocks.append(reading[0] if reading else float("nan"))

    return list(zip(bench.sample_times_ms(fn, count, calls, after_sample=read_clock), clocks))


def groups(flops: float, series, size: int = 10) -> str:
    """TFLOP/s (median sample) @ mean MHz, per group of `size` samples."""
    cells = []
    for i in range(0, len(series), size):
        chunk = series[i:i + size]
        ms = statistics.median(c[0] for c in chunk)
        cells.append(f"{flops / ms / 1e9:4.0f}@{statistics.fmean(c[1] for c in chunk):4.0f}")
    return " ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp16,bf16")
    parser.add_argument("--seqlen", default="2048,4096", help="comma list; batch = 16384 // seqlen")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--samples", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    monitor = bench.board_monitor(cp.cuda.Device().pci_bus_id)
    if not monitor.available:
        sys.exit("NVML cannot be read: no SM clock to show")
    for dtype in args.dtype.split(","):
        for seqlen in map(int, args.seqlen.split(",")):
            problem = bench_run.Problem("fwd", dtype, max(1, 16384 // seqlen), seqlen, 2048 // args.head_dim,
                                        args.head_dim, False)
            inputs = bench_run.make_inputs(cp, problem)
            runs = {impl: bench_run.make_runner(impl, problem, inputs) for impl in IMPLS}
            for fn in runs.values():  # compiled and loaded before anything is timed
                fn()
            cp.cuda.Device().synchronize()
            print(f"{dtype} d{args.head_dim} non-causal {seqlen}: TFLOP/s@MHz per 10 samples of 5 calls")
            for _ in range(args.repeats):
                for before, timed in ORDERS:
                    if before is None:
                        time.sleep(1.0)
                    else:
                        bench.time_sustained_ms(runs[before], 0.3, warmup=0)  # its load, not its time
                    series = samples(runs[timed], monitor, args.samples)
                    print(f"  {timed:12s} after {before or 'idle 1 s':12s} {groups(problem.flops, series)}", flush=True)
            del inputs, runs


if __name__ == "__main__":
    main()
