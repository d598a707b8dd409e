"""A/B of two whole checkouts (host code and kernels), for changes the kernel-only A/B tools cannot
compare because the launch itself differs (grid shape, plan choice).

Usage: python benchmarks/ab_trees.py TREE_A TREE_B [--seqlens 512,...,16384] [--head-dims 64,128,256]
                                [--causal both|yes|no] [--modes fwd,bwd] [--rounds 3]
Each TREE holds a `cuflash2/` package and its `kernels_cu/`. Every round runs one process per tree,
alternately (A, B, A, B, ...), so drift hits both alike; each process times the default forward
and backward plans at launch level (no per-call validation) on FA2's grid points (batch x seqlen
= 16k, model dim 2048, fp16). Both trees are compiled first, in parallel, untimed. Prints the
median kernel TFLOP/s of each tree and B / A per point.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("tree_a")
    parser.add_argument("tree_b", nargs="?", help="required unless --worker")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--modes", default="fwd,bwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help="time tree_a in this process (JSON lines)")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.worker and args.tree_b is None:
        parser.error("tree_b: expected a second checkout to compare with")
    return args


def points(args):
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for s in map(int, args.seqlens.split(",")):
        for d in map(int, args.head_dims.split(",")):
            for causal in causal_values:
                for mode in args.modes.split(","):
                    yield s, d, causal, mode


def worker(args):
    """Times every point with the cuflash2 found on sys.path (the tree the driver chose)."""
    import math

    import cupy as cp
    import numpy as np

    from cuflash2 import bench
    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.frameworks.arrays import describe
    from cuflash2.problem.tensors import AttentionShape

    device = cp.cuda.Device().id
    stream = cp.cuda.get_current_stream()
    for s, d, causal, mode in points(args):
        b, h = 16384 // s, 2048 // d
        shape = AttentionShape(b, s, s, h, h, d, "float16", 1 / math.sqrt(d))
        q, k, v, dout = (cp.random.standard_normal((b, s, h, d), dtype=np.float32).astype(np.float16)
                         for _ in range(4))
        out, lse = cp.empty_like(q), cp.empty((b, h, s), dtype=np.float32)
        forward = [describe("x", x) for x in (q, k, v, out, lse)]
        launch.forward(*forward, shape, causal, device, stream)
        run = timed_call(launch, mode, forward, (dout, q, k, v, out, lse), shape, causal, device, stream)
        if args.compile_only:
            run()
            continue
        ms = bench.time_cuda_ms(run)
        flops = bench.attention_flops(b, s, s, h, d, causal, mode)
        print(json.dumps({"seqlen": s, "head_dim": d, "causal": causal, "mode": mode,
                          "tflops": flops / ms / 1e9}), flush=True)
    stream.synchronize()


def timed_call(launch, mode, forward_infos, backward_arrays, shape, causal, device, stream):
    """The launch-level call one point times: the forward, or the whole backward plan."""
    if mode == "fwd":
        return lambda: launch.forward(*forward_infos, shape, causal, device, stream)
    import cupy as cp

    from cuflash2.frameworks.arrays import describe

    grads = [cp.empty_like(x) for x in backward_arrays[1:4]]
    infos = [describe("x", x) for x in (*backward_arrays, *grads)]
    return lambda: launch.backward(*infos, shape, causal, False, device, stream)


def run_tree(tree, argv, extra=()):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), tree, *argv, "--worker", *extra]
    return subprocess.Popen(cmd, env=env, cwd=os.path.abspath(tree), stdout=subprocess.PIPE, text=True)


def driver(args, argv):
    trees = {"A": args.tree_a, "B": args.tree_b}
    argv = [a for a in argv if a not in (args.tree_a, args.tree_b)]
    compiles = [run_tree(tree, argv, ["--compile-only"]) for tree in trees.values()]
    for proc in compiles:
        proc.communicate()
        if proc.returncode:
            sys.exit(f"compiling a tree failed (exit {proc.returncode})")
    results = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            proc = run_tree(tree, argv)
            stdout, _ = proc.communicate()
            if proc.returncode:
                sys.exit(f"tree {name} ({tree}) failed (exit {proc.returncode})")
            for line in stdout.splitlines():
                row = json.loads(line)
                key = (row["mode"], row["seqlen"], row["head_dim"], row["causal"])
                results[name].setdefault(key, []).append(row["tflops"])
    print(f"A = {trees['A']}, B = {trees['B']}; median kernel TFLOP/s of {args.rounds} rounds (fp16)")
    print(f"{'mode':>4} {'seqlen':>6} {'hdim':>4} {'causal':>6} {'A':>7} {'B':>7} {'B/A':>6}  rounds A | B")
    for key, a_values in results["A"].items():
        b_values = results["B"][key]
        a, b = statistics.median(a_values), statistics.median(b_values)
        print(f"{key[0]:>4} {key[1]:6d} {key[2]:4d} {key[3]!s:>6} {a:7.1f} {b:7.1f} {b / a:6.3f}  "
              f"{[round(x) for x in a_values]} | {[round(x) for x in b_values]}")


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        worker(parsed)
    else:
        driver(parsed, sys.argv[1:])
