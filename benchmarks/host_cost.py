"""Host (Python) cost per call of each layer of cuflash2's forward and backward, next to torch SDPA's
flash backend, on a problem so small that the GPU work (a few microseconds) hides nothing: the wall
time per call of back-to-back calls is then the host's. Usage: python benchmarks/host_cost.py [--calls N]
"""

import argparse
import math
import time

import cupy as cp
import numpy as np
import torch

import cuflash2
from cuflash2.core import replay
from cuflash2.families.mma_sync import launches as launch
from cuflash2.frameworks import adapter_for
from cuflash2.frameworks.arrays import describe
from cuflash2.problem.options import AttentionOptions
from cuflash2.problem.tensors import AttentionShape, validate_qkv


def host_and_wall_us(fn, calls):
    """(host, wall) microseconds per call of back-to-back calls: host stops the clock when the last
    call returns, wall once the GPU has finished too. Calls are run in batches of at most 200 (a
    few hundred launches fit in the launch queue, so host time is not held up by a full queue); wall
    above host means the GPU, not Python, set the pace."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    host = wall = 0.0
    done = 0
    while done < calls:
        batch = min(200, calls - done)
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        host += returned - start
        wall += time.perf_counter() - start
        done += batch
    return host / calls * 1e6, wall / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--shape", default="1,64,2,64")
    parser.add_argument("--full-path", action="store_true", help="no replays (cuflash2.core.replay.FAST_CALLS off)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", default="", help="cProfile the rows whose name contains this text")
    args = parser.parse_args()
    replay.FAST_CALLS = not args.full_path
    b, s, h, d = map(int, args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    qc, kc, vc = (cp.from_dlpack(x.detach()) for x in (q, k, v))
    out_c, lse_c = cuflash2.flash_attn_forward(qc, kc, vc, causal=True)
    dout_c = cp.from_dlpack(grad)
    shape = AttentionShape(b, s, s, h, h, d, "bfloat16", 1 / math.sqrt(d))
    out_t, lse_t = torch.empty_like(q), torch.empty((b, h, s), dtype=torch.float32, device="cuda")
    grads_c = [cp.empty_like(x) for x in (qc, kc, vc)]
    infos_f = [describe("x", x) for x in (qc, kc, vc, out_c, lse_c)]
    infos_b = [describe("x", x) for x in (dout_c, qc, kc, vc, out_c, lse_c, *grads_c)]
    stream = cp.cuda.get_current_stream()
    qd, kd, vd = (x.detach() for x in (q, k, v))

    def sdpa(x, y, z):
        return torch.nn.functional.scaled_dot_product_attention(x.transpose(1, 2), y.transpose(1, 2),
                                                                z.transpose(1, 2), is_causal=True).transpose(1, 2)

    def train(fn):
        def step():
            for x in (q, k, v):
                x.grad = None
            fn(q, k, v).backward(grad)
        return step

    def backward_only(fn):
        out = fn(q, k, v)

        def step():
            for x in (q, k, v):
                x.grad = None
            out.backward(grad, retain_graph=True)
        return step

    def with_call(body):
        def run():
            with adapter_for(qc).call(qc) as call:
                body(call)
        return run

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_cudnn(x, y, z):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(x, y, z)

    rows = {
        "torch SDPA flash forward (no grad)": lambda: sdpa(qd, kd, vd),
        "torch SDPA cuDNN forward (no grad)": lambda: sdpa_cudnn(qd, kd, vd),
        "torch SDPA flash forward (requires grad)": lambda: sdpa(q, k, v),
        "cuflash2 torch forward (no grad)": lambda: cuflash2.flash_attn_func(qd, kd, vd, causal=True),
        "cuflash2 torch forward (requires grad)": lambda: cuflash2.flash_attn_func(q, k, v, causal=True),
        "  adapter forward_into (torch, given out/lse)": lambda: adapter_for(qd).forward_into(
            qd, kd, vd, out_t, lse_t, None, AttentionOptions(causal=True)),
        "cuflash2 cupy flash_attn_forward": lambda: cuflash2.flash_attn_forward(qc, kc, vc, causal=True),
        "  launch.forward (launch level)": lambda: launch.forward(*infos_f, shape, True, 0, stream),
        "  gpu_call context only (cupy)": with_call(lambda call: None),
        "  gpu_call + 3 x call.tensor (cupy)": with_call(lambda call: [call.tensor(n, x) for n, x in
                                                                      (("q", qc), ("k", kc), ("v", vc))]),
        "  validate_qkv": lambda: validate_qkv(*infos_f[:3]),
        "  cp.empty x2": lambda: (cp.empty(qc.shape, qc.dtype), cp.empty((b, h, s), np.float32)),
        "  cupy runtime.getDevice": cp.cuda.runtime.getDevice,
        "  memsetAsync 4 bytes": lambda: cp.cuda.runtime.memsetAsync(lse_t.data_ptr(), 0, 4, stream.ptr),
        "  torch.zeros(1, int32)": lambda: torch.zeros(1, dtype=torch.int32, device=q.device),
        "  torch.empty x2": lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                     torch.empty((b, h, s), dtype=torch.float32, device=q.device)),
        "torch SDPA flash backward (retain_graph)": backward_only(sdpa),
        "cuflash2 torch backward (retain_graph)": backward_only(
            lambda x, y, z: cuflash2.flash_attn_func(x, y, z, causal=True)),
        "torch SDPA flash train step": train(sdpa),
        "torch SDPA cuDNN train step": train(sdpa_cudnn),
        "cuflash2 torch train step": train(lambda x, y, z: cuflash2.flash_attn_func(x, y, z, causal=True)),
        "cuflash2 cupy flash_attn_backward": lambda: cuflash2.flash_attn_backward(dout_c, qc, kc, vc, out_c, lse_c,
                                                                                  causal=True),
        "  launch.backward (launch level)": lambda: launch.backward(*infos_b, shape, True, False, 0, stream),
    }
    print(f"shape (b, s, h, d) = {(b, s, h, d)}, bf16, causal; {args.calls} back-to-back calls each; "
          f"replays {'off' if args.full_path else 'on'}")
    print(f"{'':45s} {'host':>8s} {'wall':>8s}  (us/call; the better of {args.rounds} rounds)")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        # Rounds over all rows, keeping each row's best: the first calls after start-up run slower
        # (clocks, caches), whichever row comes first.
        best = {}
        for _ in range(args.rounds):
            for name, fn in rows.items():
                host, wall = host_and_wall_us(fn, args.calls)
                best[name] = min(best.get(name, (host, wall)), (host, wall))
        for name, (host, wall) in best.items():
            print(f"{name:45s} {host:8.1f} {wall:8.1f}")
        for name, fn in rows.items():
            if args.profile and args.profile in name:
                profile(name, fn, args.calls)


def profile(name, fn, calls):
    """The functions that take the host time of `fn`, by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fn() for _ in range(calls)])
    torch.cuda.synchronize()
    print(f"\n---- profile: {name} ({calls} calls)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_callees(r"replay.py.*\(__call__\)")


if __name__ == "__main__":
    main()
