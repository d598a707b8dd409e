"""Backward plans of the mma.sync kernels: which kernels, tiles and dQ strategy one backward pass
runs (pure)."""

from __future__ import annotations

import dataclasses
import functools

from .kernel_config import (BWD, BWD_CONVERT, BWD_DOT, BWD_DQ, BWD_FUSED, KernelConfig, check_dtype,
                            head_dim_bucket, smem_limit, with_vector_width)

# Each warp of the main backward kernel owns 16 keys and keeps their dK and dV accumulators in
# registers (head_dim / 2 registers each). Up to head dim 128 one launch produces dV, dK and dQ; above
# that the register file cannot hold both accumulators, so dV and (dK, dQ) come from two launches
# that each recompute P (one extra Q K^T product out of five GEMMs).


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The launches of one backward pass, in order."""

    dot: KernelConfig  # D = rowsum(dO * O)
    main: tuple[KernelConfig, ...]  # dK/dV (and dQ when the plan accumulates it there)
    dq: KernelConfig | None  # deterministic dQ kernel, or None when the main kernel accumulates dQ
    convert: KernelConfig  # fp32 accumulators -> output dtype

    def kernels(self) -> tuple[KernelConfig, ...]:
        return (self.dot, *self.main, *((self.dq,) if self.dq else ()), self.convert)


def _dq_split_ok(block_m: int, warps: int, head_dim: int) -> bool:
    """Whether the main kernel's dQ = dS K product splits evenly over its warps: 16-row tiles times
    column groups, each group a multiple of 16 columns (the kernel's static_assert)."""
    row_tiles = block_m // 16
    if warps % row_tiles:
        return False
    col_groups = warps // row_tiles
    return head_dim % col_groups == 0 and (head_dim // col_groups) % 16 == 0


def atomic_dq_supported(arch: int) -> bool:
    """dQ accumulated inside the main kernel needs sm_90's bulk shared -> global reductions."""
    return arch >= 90


def _bwd_main(dtype, bucket, block_m, causal, variant, flags, arch, max_stages=2, warps=4) -> KernelConfig:
    """The preferred tile, shrunk (fewer Q/dO stages, then 32 query rows, then fewer warps = fewer
    keys per block) until it fits the shared memory of `arch`."""
    for w in dict.fromkeys((warps, 4, 2)):
        for rows in dict.fromkeys((block_m, 32)):
            if flags[2] and not _dq_split_ok(rows, w, bucket):
                continue
            for stages in range(max_stages, 0, -1):
                config = KernelConfig(BWD, dtype, bucket, rows, 16 * w, w, stages, causal, flags, variant)
                if config.smem_bytes <= smem_limit(arch):
                    return config
    raise AssertionError(f"no backward tile fits {smem_limit(arch)} B for head dim {bucket}")


# Main-kernel tiles (block_m, warps, max Q/dO stages) when dQ is accumulated by the main kernel
# (fp32 partial sums staged in shared memory, added to global memory by one bulk reduction per query
# block). Eight warps = 128 keys per block halve the dQ traffic per MMA against four warps; head
# dims 64 and 128 are the best of the H200 sweep (docs/design-notes.md, 'Backward plans and dQ';
# d128: 207 TFLOP/s with two Q/dO stages, 185 with one, 191 with 4 warps; seqlen 4k).
_BWD_ATOMIC_TILES = {32: (64, 8, 2), 64: (64, 8, 2), 96: (32, 4, 1), 128: (32, 8, 2)}
_BWD_ATOMIC_SPLIT_DK_TILE = (64, 8, 1)


# Buckets the fused kernel serves: its layout needs an even number of 8-column tiles per column
# group, so buckets 160 and 224 run the 192 and 256 instantiations on zero-padded columns.
FUSED_BWD_HEAD_DIMS = (64, 96, 128, 160, 192, 224, 256)
_FUSED_BWD_WIDTH = {160: 192, 224: 256}
# Buckets where the fused kernel is the default (H200, docs/design-notes.md, 'Backward plans and
# dQ'): at 128 it measured 1.03-1.32x the two-kernel plan (seqlen 1k-4k), 1.08-1.38x at head dim 120
# (padded columns); at 64 1.07-1.09x (0.98x causal at seqlen 1k); at 160-256 1.06-1.45x the plan
# that splits dV from dK; at 96 (16-row dQ warps) 1.15-1.50x the dQ-kernel plan, seqlen 512-16k.
FUSED_BWD_DEFAULT_BUCKETS = FUSED_BWD_HEAD_DIMS


def fused_backward_supported(bucket: int, arch: int, variant: bool = False, deterministic: bool = False,
                             causal: bool = False, gqa: bool = False) -> bool:
    """Whether the one-pass backward kernel (flash_bwd_fused.cu: FA2's warp layout, dQ by bulk
    reductions) serves this call: sm_90 or newer with the shared memory of an H100 (not the 99 KB
    parts), plain attention, head-dim buckets 64 to 256."""
    return (atomic_dq_supported(arch) and not variant and not deterministic and bucket in FUSED_BWD_HEAD_DIMS
            and fused_backward_config(bucket, "bf16", causal, gqa).smem_bytes <= smem_limit(arch))


def fused_backward_config(bucket: int, dtype: str, causal: bool, gqa: bool, block_m: int | None = None) -> KernelConfig:
    # 32 keys per warp: 4 key groups x 2 column halves of a 128-key block up to head dim 128; above,
    # the dK/dV accumulators of half the columns would not fit in registers, so 2 key groups x 4
    # column quarters of a 64-key block. Query blocks of 128 rows at head dim 64 (FA2's tile: half
    # the iterations, each S^T fragment feeding more columns) measured 1.01-1.04x 64 rows on the H200.
    width = _FUSED_BWD_WIDTH.get(bucket, bucket)
    block_n = 128 if width <= 128 else 64
    block_m = block_m or (128 if width == 64 else 64)
    return KernelConfig(BWD_FUSED, dtype, width, block_m, block_n, 8, 2, causal, (gqa,))


def backward_plan_options(arch: int) -> list[dict]:
    """Keyword sets of backward_plan covering every plan the library can run on `arch`."""
    options = [{"variant": False}, {"variant": True}, {"deterministic": True}]
    if atomic_dq_supported(arch):
        options += [{"atomic_dq": True}, {"fused": True}]
    return options


@functools.lru_cache(maxsize=4096)
def backward_plan(head_dim: int, dtype: str, causal: bool, arch: int, deterministic: bool = False,
                  gqa: bool = False, split: bool | None = None, atomic_dq: bool | None = None,
                  variant: bool = False, tile: tuple[int, int, int] | None = None,
                  fused: bool | None = None) -> BackwardPlan:
    """Kernels (and tile shapes) of one backward pass.

    gqa: dK/dV are accumulated per query head in fp32 and summed over each group afterwards.
    split: produce dV and (dK, dQ) in two launches (default: only above head dim 128).
    atomic_dq: accumulate dQ inside the main kernel (fp32 bulk reductions into a global accumulator,
    sm_90 only) instead of running the dQ kernel, which recomputes S and dP but is deterministic.
    Off by default: on the H200 both plans measure within about +-6% of each other (docs/design-notes.md,
    'Backward plans and dQ').
    variant: the kernels with varlen / window / softcap / ALiBi support.
    tile: (block_m, warps, stages) of the main kernel producing dK (tuning only; the fused kernel
    takes block_m only).
    fused: one kernel for dK, dV and dQ in FA2's warp layout (where fused_backward_supported).
    """
    check_dtype(dtype)
    bucket = head_dim_bucket(head_dim)
    causal, variant = bool(causal), bool(variant)
    supported = fused_backward_supported(bucket, arch, variant, deterministic, causal, bool(gqa))
    if fused is None:  # the default: where measured faster, unless the caller chose a plan
        fused = (supported and bucket in FUSED_BWD_DEFAULT_BUCKETS and atomic_dq is None and split is None
                 and tile is None)
    if fused and not supported:
        raise ValueError(f"fused: the one-pass backward needs sm_90 with 227 KB of shared memory per block, plain "
                         f"attention, non-deterministic mode and a head dim in buckets {FUSED_BWD_HEAD_DIMS}; got "
                         f"head dim {head_dim}, arch {arch}, variant={variant}, deterministic={deterministic}, "
                         f"causal={causal}, gqa={bool(gqa)}")
    if fused and tile:
        config = fused_backward_config(bucket, dtype, causal, bool(gqa), tile[0])
        if config.smem_bytes > smem_limit(arch):
            raise ValueError(f"tile: the fused backward with {tile[0]}-row query blocks needs {config.smem_bytes} B "
                             f"of shared memory at head dim {head_dim}, more than the {smem_limit(arch)} B of arch "
                             f"{arch}")
    if fused:
        return BackwardPlan(KernelConfig(BWD_DOT, dtype, bucket, warps=8),
                            (fused_backward_config(bucket, dtype, causal, bool(gqa), tile[0] if tile else None),), None,
                            KernelConfig(BWD_CONVERT, dtype, warps=8))
    if deterministic and atomic_dq:
        raise ValueError("atomic_dq: fp32 atomics cannot be deterministic")
    if atomic_dq and not atomic_dq_supported(arch):
        raise ValueError(f"atomic_dq: needs compute capability 9.0 or newer, got {arch // 10}.{arch % 10}")
    atomic_dq = bool(atomic_dq)
    if split is None:  # the variant kernels' extra state (dropout, softcap) overflows at head dim 128
        split = bucket > 128 or (variant and bucket == 128)
    if not split:
        # 64 query rows per step up to head dim 64; above, 32 rows and a single Q/dO stage keep the
        # dK, dV and dQ accumulators within 255 registers without spilling.
        block_m, warps, stages = (64, 4, 2) if bucket <= 64 else (32, 4, 1)
        if atomic_dq:
            block_m, warps, stages = _BWD_ATOMIC_TILES[bucket]
        block_m, warps, stages = tile or (block_m, warps, stages)
        main = (_bwd_main(dtype, bucket, block_m, causal, variant, (True, True, atomic_dq, gqa), arch, stages,
                          warps),)
    else:
        dk_block_m, dk_warps, dk_stages = (64, 4, 2) if bucket <= 128 else (32, 4, 1)
        if atomic_dq:
            dk_block_m, dk_warps, dk_stages = _BWD_ATOMIC_SPLIT_DK_TILE
        dk_block_m, dk_warps, dk_stages = tile or (dk_block_m, dk_warps, dk_stages)
        dv_block_m = 32 if variant and bucket > 192 else 64  # the variant dV kernel spills at 64 rows
        main = (_bwd_main(dtype, bucket, dv_block_m, causal, variant, (True, False, False, gqa), arch),
                _bwd_main(dtype, bucket, dk_block_m, causal, variant, (False, True, atomic_dq, gqa), arch, dk_stages,
                          dk_warps))
    dq = None
    if not atomic_dq:
        block_n = 64 if bucket <= 128 else (16 if variant and bucket > 224 else 32)  # variant d256: dropout draws
        dq = KernelConfig(BWD_DQ, dtype, bucket, 64, block_n, 4, 0, causal, variant=variant)
        assert dq.smem_bytes <= smem_limit(arch)
    return BackwardPlan(KernelConfig(BWD_DOT, dtype, bucket, warps=8), main, dq,
                        KernelConfig(BWD_CONVERT, dtype, warps=8))



def narrow_backward_plan(head_dim: int, dtype: str, causal: bool, arch: int, gqa: bool, variant: bool,
                         vec: int) -> BackwardPlan:
    """The backward plan of a call whose tensors take `vec`-byte accesses (vec < 16): the two-kernel
    dK/dV plan with its own dQ kernel (the one-pass fused and atomic-dQ kernels hold too many
    registers for narrow copies), each kernel built for the width."""
    plan = backward_plan(head_dim, dtype, causal, arch, deterministic=True, gqa=gqa, variant=variant, fused=False)
    return BackwardPlan(with_vector_width(plan.dot, vec), tuple(with_vector_width(c, vec) for c in plan.main),
                        plan.dq and with_vector_width(plan.dq, vec), with_vector_width(plan.convert, vec))
