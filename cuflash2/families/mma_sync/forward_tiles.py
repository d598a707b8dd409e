"""Forward tiles of the mma.sync kernels per architecture, and the forward tile choice (pure)."""

from __future__ import annotations

import functools

from .kernel_config import (FWD, MAX_GRID_YZ, KernelConfig, check_dtype, head_dim_bucket, large_smem,
                            smem_limit)

# (block_m, block_n, warps, stages) per head-dim bucket. With 4 warps each warp owns 32 query rows
# (two MMA row tiles share every K/V fragment read from shared memory, halving that traffic); the
# fp32 output accumulator then costs head_dim registers, so large head dims go to 8 warps. Head dim
# 128 keeps 4 warps x 32 rows with 64-key blocks (FA2's tile) through FwdTraits::kTightRegisters:
# shared-memory row sums, cursors rebuilt per key block and a separate masked loop make it
# spill-free at 255 registers (docs/design-notes.md, 'Forward tiles').
_FWD_TILES_LARGE_SMEM = {
    32: (128, 128, 4, 2),
    64: (128, 64, 4, 3),
    96: (128, 64, 4, 2),
    128: (128, 64, 4, 2),
    160: (128, 64, 8, 2),
    192: (128, 64, 8, 2),
    224: (128, 64, 8, 2),
    256: (128, 64, 8, 2),
}
# Variant kernels (window / softcap / ALiBi / varlen / dropout) keep more values live per element:
# the 64-key tiles of head dims 224 and 256 spill there, 32-key blocks do not (and at head dim 96
# the 4-warp 64-key tile); head dims 64 and 128 need 8 warps (16 rows each), 64 once the dropout
# draws are in, and head dim 32 too on sm_80/sm_86.
_FWD_VARIANT_TILES_LARGE_SMEM = {32: (128, 64, 8, 2), 64: (128, 64, 8, 3), 96: (128, 32, 4, 2), 128: (128, 128, 8, 2),
                                 224: (128, 32, 8, 2), 256: (128, 32, 8, 2)}
# 99 KB parts. ptxas for sm_86 allocates differently from sm_80/sm_90: head dims 128 and 256 spill
# with the large-smem shapes, hence 8 warps for 128 and 32-key blocks for 256.
_FWD_TILES_SMALL_SMEM = {
    32: (128, 128, 4, 2),
    64: (128, 64, 4, 2),
    96: (128, 32, 4, 2),
    128: (128, 64, 8, 2),
    160: (64, 64, 4, 2),
    192: (64, 64, 4, 2),
    224: (64, 64, 4, 2),
    256: (64, 32, 4, 2),
}
_FWD_VARIANT_TILES_SMALL_SMEM = {32: (128, 64, 8, 2), 64: (128, 64, 8, 2),
                                 224: (64, 32, 4, 2)}  # as above; 64x64 spills on sm_86
# Causal head dim 256 with query and key lengths up to 2k (sm_90 only: measured there): FA2's 64x64
# 4-warp tile, two blocks per SM, measured 1.12x (seqlen 512), 1.11x (1k) and 1.06x (2k) the 128x64
# 8-warp tile's TFLOP/s (H200, kernels alone, rotating rounds; docs/design-notes.md, 'Forward
# tiles'), 1.01x at 4k and 0.95-0.97x at 8k-16k. Longer keys mean longer blocks, hence the key length
# counts too.
# Head dims 160 and 192 likewise (below).
_FWD_SHORT_CAUSAL_TILES_SM90 = {160: (64, 64, 4, 2), 192: (64, 64, 4, 2), 256: (64, 64, 4, 2)}
FWD_SHORT_SEQLEN = 2048
# Non-causal head dim 256 on sm_90 takes the same tile at every length: measured 1.035x (seqlen
# 512), 1.05x (2k), 1.02x (4k), 1.017x (8k) and 1.007x (16k) the 128x64 8-warp tile (H200, kernels
# alone, rotating rounds; docs/design-notes.md, 'Forward tiles'). Every key block is full there,
# so two 4-warp blocks per SM keep the tensor cores busier than one 8-warp block.
_FWD_FULL_TILES_SM90 = {256: (64, 64, 4, 2)}
# Head dims 160 and 192 on sm_90: 128x128 with 8 warps (spill-free since the 12-chunk registers
# threshold of flash_fwd.cu), except causal calls up to FWD_SHORT_SEQLEN, which keep FA2's 64x64
# 4-warp tile (above). Against the 64x64 tile, d192 measured 1.015x (seqlen 512), 1.04x (1k),
# 1.02x (2k), 1.085x (4k), 1.07x (8k) and 1.09x (16k) non-causal; causal 0.93x, 0.97x, 0.99x
# below 2k and 1.025x, 1.07x, 1.09x at 4k-16k. d160: 1.00x (1k), 1.04x (4k), 1.03x (16k)
# non-causal, causal 0.97x, 1.00x, 1.03x (H200, kernels alone; docs/design-notes.md,
# 'Forward tiles'). The 64x64 tile itself measured 1.03-1.14x the 128x64 8-warp tile.
_FWD_TILES_SM90 = {160: (128, 128, 8, 2), 192: (128, 128, 8, 2)}
# Causal grids hold a sequence's query blocks in grid y (at most MAX_GRID_YZ; launches.py raises past
# it): the longest causal call a 64-row tile could serve. On sm_90 only calls up to FWD_SHORT_SEQLEN
# get one, so causal calls keep the 8.4M-row limit of 128-row tiles (tests/test_config.py).
FWD_LONG_CAUSAL_SEQLEN = MAX_GRID_YZ * 64
# One length from each class forward_config tells apart (unknown, short): every forward tile the
# library can launch is forward_config(..., seqlen) for one of them.
FWD_SEQLEN_CLASSES = (None, FWD_SHORT_SEQLEN)


def forward_config(head_dim: int, dtype: str, causal: bool, arch: int, variant: bool = False,
                   seqlen: int | None = None) -> KernelConfig:
    """Tile shape for the forward kernel on compute capability `arch` (`variant`: the kernel with
    varlen / window / softcap / ALiBi support; `seqlen`, the longer of the call's query and key
    lengths when known, picks the short-sequence tile of causal calls)."""
    return _forward_config(head_dim, dtype, causal, arch, variant, seqlen is not None and seqlen <= FWD_SHORT_SEQLEN)


@functools.lru_cache(maxsize=4096)  # keyed on short, not the length: every length shares two entries
def _forward_config(head_dim: int, dtype: str, causal: bool, arch: int, variant: bool, short: bool) -> KernelConfig:
    check_dtype(dtype)
    bucket = head_dim_bucket(head_dim)
    plain_sm90 = not variant and arch == 90
    if plain_sm90 and short and causal and bucket in _FWD_SHORT_CAUSAL_TILES_SM90:
        tiles = _FWD_SHORT_CAUSAL_TILES_SM90[bucket]
    elif plain_sm90 and not causal and bucket in _FWD_FULL_TILES_SM90:
        tiles = _FWD_FULL_TILES_SM90[bucket]
    elif plain_sm90 and bucket in _FWD_TILES_SM90:
        tiles = _FWD_TILES_SM90[bucket]
    elif large_smem(arch):
        tiles = ((_FWD_VARIANT_TILES_LARGE_SMEM.get(bucket) if variant else None)
                 or _FWD_TILES_LARGE_SMEM[bucket])
    else:
        tiles = (_FWD_VARIANT_TILES_SMALL_SMEM.get(bucket) if variant else None) or _FWD_TILES_SMALL_SMEM[bucket]
    block_m, block_n, warps, stages = tiles
    config = KernelConfig(FWD, dtype, bucket, block_m, block_n, warps, stages, bool(causal), variant=bool(variant))
    assert config.smem_bytes <= smem_limit(arch), f"{config.short_id()} needs {config.smem_bytes} B"
    return config
