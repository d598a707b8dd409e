"""`cuflash2 bench --decode`: one-token decoding against a KV cache, in GB/s of K+V read.

Problem (the issue's decode benchmark, Llama-style GQA): seqlen_q = 1, 32 query heads, 8 kv heads,
head dim 128, bf16; kv length and batch swept. cuflash2 runs flash_attn_with_kvcache (automatic
split-KV); torch SDPA backends get the same q, k, v (as torch views of the same memory, enable_gqa).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from cuflash2 import bench

DEFAULT_KV_LENS = (2048, 8192, 32768, 65536)
DEFAULT_BATCHES = (1, 16, 64)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    batch: int
    kv_len: int
    dtype: str = "bf16"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.kv_len * KV_HEADS * HEAD_DIM * 2  # K and V, 2-byte elements


def decode_grid(batches, kv_lens, dtype="bf16") -> list[DecodeProblem]:
    return [DecodeProblem(b, n, dtype) for b in batches for n in kv_lens]


def _runners(cp, p: DecodeProblem, compare):
    import cuflash2
    from .bench_run import random_array

    q = random_array(cp, (p.batch, 1, HEADS, HEAD_DIM), p.dtype)
    k_cache = random_array(cp, (p.batch, p.kv_len, KV_HEADS, HEAD_DIM), p.dtype)
    v_cache = random_array(cp, (p.batch, p.kv_len, KV_HEADS, HEAD_DIM), p.dtype)
    seqlens = cp.full((p.batch,), p.kv_len, dtype=cp.int32)
    runners = {"cuflash2": lambda: cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)}
    if compare:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt = torch.from_dlpack(q).transpose(1, 2)  # (b, heads, 1, d)
        kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (k_cache, v_cache))
        for name in compare:
            backend = getattr(SDPBackend, {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                                           "torch-efficient": "EFFICIENT_ATTENTION"}[name])

            def run(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            runners[name] = run
    return runners


ROUNDS = 3


def _time_in_rounds(runners: dict, warmup: int, repeats: int) -> dict:
    """{name: ms or the exception it raised}. The implementations are timed in turn, ROUNDS times
    over, and each keeps the median of its rounds: a clock or memory state that drifts during the
    run then weighs on all of them alike instead of on whichever ran first."""
    samples: dict = {name: [] for name in runners}
    for _ in range(ROUNDS):
        for name, fn in runners.items():
            if isinstance(samples[name], Exception):
                continue
            try:
                samples[name].append(bench.time_cuda_ms(fn, warmup, repeats))
            except Exception as exc:  # a backend that rejects the shape: report it, keep going
                samples[name] = exc
    return {name: s if isinstance(s, Exception) else statistics.median(s) for name, s in samples.items()}


def run_decode(cp, problems, compare, warmup: int, repeats: int, on_row=None) -> list[dict]:
    """One row per (problem, implementation): ms, GB/s of K+V and the ratio cuflash2 / x."""
    rows = []
    for p in problems:
        results = {}
        for name, ms in _time_in_rounds(_runners(cp, p, compare), warmup, repeats).items():
            if isinstance(ms, Exception):
                results[name] = {"ms": math.nan, "gbps": math.nan, "error": f"{type(ms).__name__}: {ms}"[:80]}
            else:
                results[name] = {"ms": ms, "gbps": p.kv_bytes / ms / 1e6}
        ours = results["cuflash2"]["gbps"]
        for name, r in results.items():
            row = {"impl": name, "batch": p.batch, "kv_len": p.kv_len, "dtype": p.dtype, **r,
                   "speedup": ours / r["gbps"] if r["gbps"] and not math.isnan(r["gbps"]) else math.nan}
            rows.append(row)
            if on_row:
                on_row(row)
        cp.get_default_memory_pool().free_all_blocks()
    return rows
