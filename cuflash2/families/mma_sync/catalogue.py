"""Every instantiation of the mma.sync kernels the library can launch on an architecture (what
`cuflash2 compile` and the compile tests build)."""

from __future__ import annotations

import functools

from .backward_plans import backward_plan, backward_plan_options, fused_backward_supported, narrow_backward_plan
from .forward_tiles import FWD_SEQLEN_CLASSES, forward_config
from .kernel_config import (DTYPES, HEAD_DIM_BUCKETS, VECTOR_WIDTHS, KernelConfig, head_dim_bucket, vector_width,
                            with_vector_width)
from .kvcache_tiles import (DECODE_ROWS, KVCACHE_SHORT_ROWS, kvcache_config, kvcache_configs_of, kvcache_helper_configs,
                            kvcache_query_rows)


# Narrow vector widths: which of them the enumerators below (and so the compile test) cover. Every
# bucket can meet every width its head dims allow (a head dim's own width, or narrower for views
# and odd offsets), but the widths change only the global <-> shared copies and the epilogue stores,
# not the MMA loops, so the full cross product (four times the instantiations, and the compile
# test's time) would mostly repeat itself. Covered instead: the (bucket, width) pairs of contiguous
# calls at representative head dims, fp16 only (bf16 differs in conversions only), every plan and
# tile of each: 2 bytes, the widest change (loads through registers), at the buckets of d=59 (4
# warps), d=111 (the register-tight 4-warp forward and the fused backward's 255 registers) and d=255
# (8 warps, the split backward); 4 bytes at d=90's bucket; 8 bytes at d=100's.
NARROW_SAMPLES = ((64, 2), (96, 4), (128, 8), (128, 2), (192, 2), (256, 2))  # (bucket, vector width)
NARROW_SAMPLE_DTYPE = "fp16"


def possible_vector_widths(head_dim: int) -> tuple[int, ...]:
    """The widths a call with this head dim can take (those dividing head_dim * 2), widest first."""
    return tuple(w for w in VECTOR_WIDTHS if head_dim * 2 % w == 0)


def _narrow_samples(configs_of) -> list[KernelConfig]:
    """configs_of(bucket, dtype) at the NARROW_SAMPLES widths."""
    return [with_vector_width(c, vec) for bucket, vec in NARROW_SAMPLES
            for c in configs_of(bucket, NARROW_SAMPLE_DTYPE)]


def _forward_configs_of(arch: int, bucket: int, dtype: str) -> list[KernelConfig]:
    return [forward_config(bucket, dtype, causal, arch, variant, seqlen)
            for variant in (False, True) for causal in (False, True) for seqlen in FWD_SEQLEN_CLASSES]


def all_forward_configs(arch: int) -> list[KernelConfig]:
    """Every forward instantiation the library can launch on `arch` at width 16 (narrow widths:
    all_narrow_configs)."""
    configs = [c for bucket in HEAD_DIM_BUCKETS for dtype in DTYPES for c in _forward_configs_of(arch, bucket, dtype)]
    return list(dict.fromkeys(configs))


def all_backward_configs(arch: int) -> list[KernelConfig]:
    """Every backward instantiation (all plans: deterministic or not, MHA or GQA, plain or variant;
    the variant kernels serve only the default dQ-kernel plan)."""
    configs = [c for bucket in HEAD_DIM_BUCKETS for dtype in DTYPES for c in _backward_configs_of(arch, bucket, dtype)]
    return list(dict.fromkeys(configs))


def _backward_configs_of(arch: int, bucket: int, dtype: str) -> list[KernelConfig]:
    configs: dict[KernelConfig, None] = {}
    for causal in (False, True):
        for options in backward_plan_options(arch):
            for gqa in (False, True):
                if options.get("fused") and not fused_backward_supported(bucket, arch, causal=causal, gqa=gqa):
                    continue
                for config in backward_plan(bucket, dtype, causal, arch, gqa=gqa, **options).kernels():
                    configs[config] = None
    return list(configs)


def tuning_backward_configs(arch: int) -> list[KernelConfig]:
    """The alternative (split) plans benchmarks compare against the defaults, head dims 96-128."""
    configs: dict[KernelConfig, None] = {}
    for bucket in (96, 128):
        for dtype in DTYPES:
            for causal in (False, True):
                for config in backward_plan(bucket, dtype, causal, arch, split=True).kernels():
                    configs[config] = None
    return list(configs)


def all_configs(arch: int) -> list[KernelConfig]:
    return all_forward_configs(arch) + all_backward_configs(arch) + all_kvcache_configs(arch) + all_narrow_configs(arch)


def all_kvcache_configs(arch: int) -> list[KernelConfig]:
    """Every KV-cache instantiation at width 16 (narrow widths: all_narrow_configs), the paged
    varlen forward's among them (paged_varlen_config takes the 32- and 64-row tiles listed here)."""
    configs = [kvcache_config(bucket, dtype, causal, arch, rows)
               for bucket in HEAD_DIM_BUCKETS for dtype in DTYPES for causal in (False, True)
               for rows in kvcache_query_rows(bucket)]
    configs += [c for dtype in DTYPES for c in kvcache_helper_configs(dtype)]
    return list(dict.fromkeys(configs))


def all_narrow_configs(arch: int) -> list[KernelConfig]:
    """The narrow vector widths' instantiations the compile test covers (NARROW_SAMPLES): forward,
    backward and KV-cache kernels of the sampled buckets and widths."""
    configs = []
    for configs_of in (_forward_configs_of, kvcache_configs_of):
        configs += _narrow_samples(functools.partial(configs_of, arch))
    configs += [c for bucket, vec in NARROW_SAMPLES for c in _narrow_backward_configs_of(arch, bucket, vec)]
    return list(dict.fromkeys(configs))


def _narrow_backward_configs_of(arch: int, bucket: int, vec: int) -> list[KernelConfig]:
    """Every kernel of the narrow backward plans (narrow_backward_plan) of a bucket and width."""
    return list(dict.fromkeys(c for causal in (False, True) for gqa in (False, True) for variant in (False, True)
                              for c in narrow_backward_plan(bucket, NARROW_SAMPLE_DTYPE, causal, arch, gqa, variant,
                                                            vec).kernels()))

def compile_configs(arch: int, dims: list[int], dtypes: list[str], kinds: tuple[str, ...] = ("fwd", "bwd")
                    ) -> list[KernelConfig]:
    """Every instantiation a call can launch on `arch` for these head dims and dtypes ("bf16",
    "fp16"), at the vector width of contiguous tensors of each head dim (vector_width): what
    `cuflash2 compile` builds."""
    unique: dict = {}
    for dim in dims:
        vec = vector_width(dim)
        unique.update(dict.fromkeys(with_vector_width(c, vec) for c in _configs_of_dim(arch, dim, dtypes, kinds, vec)))
    return list(unique)


def _configs_of_dim(arch: int, dim: int, dtypes: list[str], kinds: tuple[str, ...], vec: int = 16
                    ) -> list[KernelConfig]:
    unique: dict[KernelConfig, None] = {}
    if vec < 16 and "bwd" in kinds:  # narrow calls run one backward plan (config.narrow_backward_plan)
        unique.update(dict.fromkeys(c for dtype in dtypes for causal in (False, True) for gqa in (False, True)
                                    for variant in (False, True)
                                    for c in narrow_backward_plan(dim, dtype, causal, arch, gqa, variant,
                                                                      vec).kernels()))
        kinds = tuple(k for k in kinds if k != "bwd")
    for dtype in dtypes:
        for causal in (False, True):
            for variant in (False, True):
                if "fwd" in kinds:
                    for seqlen in FWD_SEQLEN_CLASSES:  # the tiles chosen by length too
                        unique[forward_config(dim, dtype, causal, arch, variant, seqlen)] = None
                    for rows in (64, KVCACHE_SHORT_ROWS, DECODE_ROWS):
                        unique[kvcache_config(dim, dtype, causal, arch, rows)] = None
                    unique.update(dict.fromkeys(kvcache_helper_configs(dtype)))
            if "bwd" in kinds:
                for options in backward_plan_options(arch):
                    for gqa in (False, True):
                        if options.get("fused") and not fused_backward_supported(
                                head_dim_bucket(dim), arch, causal=causal, gqa=gqa):
                            continue
                        plan = backward_plan(dim, dtype, causal, arch, gqa=gqa, **options)
                        unique.update(dict.fromkeys(plan.kernels()))
    return list(unique)
