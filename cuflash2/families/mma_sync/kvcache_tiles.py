"""KV-cache and decoding tiles of the mma.sync kernels, and their choice (pure)."""

from __future__ import annotations

import dataclasses
import functools

from .kernel_config import (FWD_COMBINE, FWD_DECODE, FWD_KVCACHE, ROTARY_COPY, KernelConfig, check_dtype,
                            head_dim_bucket, large_smem, smem_limit)

# Decoding reads the cache once per step and is bound by memory bandwidth, not MMA throughput: 64
# query rows (4 warps x 16) waste little on short queries and leave room for 3 K/V stages in flight.
# Head dims 224 and 256 need 8 warps (a 4-warp tile spills with the page-table addressing). Bigger
# key blocks keep more bytes in flight per SM (head dim 128: 112 KB of K/V stages, 2 blocks per SM).
_KVCACHE_TILES = {32: (64, 128, 4, 3), 64: (64, 128, 4, 3), 96: (64, 64, 4, 3), 128: (64, 128, 4, 3),
                  160: (64, 32, 4, 3), 192: (64, 32, 4, 3), 224: (128, 32, 8, 2), 256: (128, 32, 8, 2)}


# One-token decoding puts a GQA group of query heads in the rows of one block. Groups of 17-32 rows
# take a 32-row block of 2 warps: fewer wasted tensor-core rows than 64, and 2 blocks per SM. At
# head dim 128 it measured 1.01-1.40x the 64-row tile's bandwidth (H200; docs/design-notes.md, 'Decoding').
_KVCACHE_SHORT_TILES = {128: (32, 128, 2, 3)}
KVCACHE_SHORT_ROWS = 32

# Up to 16 query rows (one-token decoding with GQA groups up to 16, or short chunks) go to the
# decoding kernel, whose warps split each K/V tile's keys instead of the rows (flash_fwd.cu,
# flash_fwd_decode_kernel): (block_n, warps, stages), 16 rows each. At head dim 128 it measured
# 1.02-1.12x the 32-row tile's bandwidth (H200; docs/design-notes.md, 'Decoding').
_DECODE_TILES = {64: (128, 4, 3), 128: (128, 4, 3), 256: (64, 4, 3)}
DECODE_ROWS = 16


@functools.lru_cache(maxsize=4096)
def kvcache_config(head_dim: int, dtype: str, causal: bool, arch: int, query_rows: int = 64) -> KernelConfig:
    """Tile shape of the KV-cache forward kernel (always with the optional features available);
    query_rows: rows of q per (sequence, kv head) block as the kernel sees them."""
    check_dtype(dtype)
    bucket = head_dim_bucket(head_dim)
    if query_rows <= DECODE_ROWS and bucket in _DECODE_TILES:
        block_n, warps, stages = _DECODE_TILES[bucket]
        config = KernelConfig(FWD_DECODE, dtype, bucket, DECODE_ROWS, block_n, warps, stages, bool(causal), variant=True)
        while config.smem_bytes > smem_limit(arch):  # 99 KB parts: fewer stages, then smaller key blocks
            if config.stages > 2:
                config = dataclasses.replace(config, stages=config.stages - 1)
            elif config.block_n // warps > 16:
                config = dataclasses.replace(config, block_n=config.block_n // 2)
            else:
                raise RuntimeError(f"{config.short_id()} needs {config.smem_bytes} B of shared memory, "
                                   f"more than sm_{arch} has")
        return config
    short = _KVCACHE_SHORT_TILES.get(bucket) if query_rows <= KVCACHE_SHORT_ROWS else None
    block_m, block_n, warps, stages = short or _KVCACHE_TILES[bucket]
    if bucket == 128 and not large_smem(arch):
        block_n = 64  # 3 stages of 128 keys need 112 KB
    config = KernelConfig(FWD_KVCACHE, dtype, bucket, block_m, block_n, warps, stages, bool(causal), variant=True)
    assert config.smem_bytes <= smem_limit(arch), f"{config.short_id()} needs {config.smem_bytes} B"
    return config


def paged_varlen_config(head_dim: int, dtype: str, causal: bool, arch: int, max_seqlen_q: int) -> KernelConfig:
    """The kernel of flash_attn_varlen_func with block_table: the KV-cache forward kernel (paged
    loads, per-sequence ranges from cu_seqlens), never the decoding kernel (its rows are a GQA
    group of one query, which needs every sequence to have the same length)."""
    return kvcache_config(head_dim, dtype, causal, arch, max(max_seqlen_q, DECODE_ROWS + 1))


def kvcache_helper_configs(dtype: str) -> tuple[KernelConfig, KernelConfig]:
    """(rotary/append copy, split-KV combine) for one dtype."""
    check_dtype(dtype)
    return KernelConfig(ROTARY_COPY, dtype, warps=8), KernelConfig(FWD_COMBINE, dtype, warps=8)


def kvcache_configs_of(arch: int, bucket: int, dtype: str) -> list[KernelConfig]:
    return [kvcache_config(bucket, dtype, causal, arch, r) for causal in (False, True)
            for r in kvcache_query_rows(bucket)] + list(kvcache_helper_configs(dtype))


def kvcache_query_rows(bucket: int) -> tuple[int, ...]:
    """The query-row classes kvcache_config tells apart for a bucket."""
    return (64,) + ((KVCACHE_SHORT_ROWS,) if bucket in _KVCACHE_SHORT_TILES else ()) + \
        ((DECODE_ROWS,) if bucket in _DECODE_TILES else ())
