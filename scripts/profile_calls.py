"""Host-side cost of one call (what a decoding loop pays per token): wall time per call for
back-to-back calls with CuPy's launcher, with the packed-argument launch and (decoding) with the
fast path of a known call signature, and a cProfile (of the last) of where
the Python time goes. Usage: python scripts/profile_calls.py
[decode|decode-torch|forward|forward-torch|train-torch ...]"""

import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import cuflash2
from cuflash2 import kvcache
from cuflash2.runtime import launcher
from cuflash2.bench import time_cuda_ms


def decode_call():
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((1, 1, 32, 128)).astype(np.float16))
    k_cache = cp.asarray(rng.standard_normal((1, 2048, 8, 128)).astype(np.float16))
    seqlens = cp.full((1,), 2048, dtype=cp.int32)
    return lambda: cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens)


def decode_torch_call():
    import torch

    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(1, 2048, 8, 128, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.full((1,), 2048, dtype=torch.int32, device="cuda")
    return lambda: cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens)


def forward_call():
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((1, 128, 16, 128)).astype(np.float16))
    return lambda: cuflash2.flash_attn_func(q, q, q, causal=True)


def wall_us(fn, n=500):
    for _ in range(20):
        fn()
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - start) / n * 1e6


def profile(name, fn):
    # (label, packed launch, decoding-step fast path): CuPy's launcher, packed arguments, fast path
    for label, packed, fast in (("cupy launcher", False, False), ("packed launch", True, False),
                                ("fast step    ", True, True)):
        launcher.PACKED_LAUNCH, kvcache.FAST_STEPS = packed, fast
        wall = wall_us(fn)
        event = time_cuda_ms(fn) * 1e3
        print(f"{name} {label}: wall per call {wall:.1f} us, CUDA-event time per call {event:.1f} us")
    stats = cProfile.Profile()
    stats.enable()
    for _ in range(200):
        fn()
    stats.disable()
    cp.cuda.Device().synchronize()
    pstats.Stats(stats).sort_stats("tottime").print_stats(25)
    pstats.Stats(stats).sort_stats("cumulative").print_stats(30)


def forward_torch_call():
    """A forward on torch tensors at FA2's grid point seqlen 512, head dim 128, causal (no gradients)."""
    import torch

    q, k, v = (torch.randn(32, 512, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return lambda: cuflash2.flash_attn_func(q, k, v, causal=True)


def train_torch_call():
    """A training step (forward + backward through autograd) at the same point."""
    import torch

    q, k, v = (torch.randn(32, 512, 16, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def step():
        for x in (q, k, v):
            x.grad = None
        cuflash2.flash_attn_func(q, k, v, causal=True).backward(grad)

    return step


calls = {"decode": decode_call, "decode-torch": decode_torch_call, "forward": forward_call,
         "forward-torch": forward_torch_call, "train-torch": train_torch_call}
for mode in sys.argv[1:] or ["decode"]:
    profile(mode, calls[mode]())
