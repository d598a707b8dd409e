"""The mma.sync kernel family (sm_80 and newer): FlashAttention-2's forward, backward and KV-cache
kernels on warp-level tensor-core MMAs, cp.async copies and ldmatrix loads (kernels_cu/).

Modules: kernel_config (KernelConfig, the kernels' names and sources, vector widths),
forward_tiles, backward_plans and kvcache_tiles (the tile tables and their choice), catalogue
(every instantiation per arch), launches and kvcache_launches (the launches with their argument
lists). This package's namespace gathers the names the tools and tests use.
"""

from __future__ import annotations

from ...problem.features import AttentionProblem
from . import kvcache_launches, launches
from .backward_plans import (FUSED_BWD_DEFAULT_BUCKETS, FUSED_BWD_HEAD_DIMS, BackwardPlan, atomic_dq_supported,
                             backward_plan, backward_plan_options, fused_backward_config, fused_backward_supported,
                             narrow_backward_plan)
from .catalogue import (NARROW_SAMPLE_DTYPE, NARROW_SAMPLES, all_backward_configs, all_configs, all_forward_configs,
                        all_kvcache_configs, all_narrow_configs, compile_configs, possible_vector_widths,
                        tuning_backward_configs)
from .forward_tiles import FWD_LONG_CAUSAL_SEQLEN, FWD_SEQLEN_CLASSES, FWD_SHORT_SEQLEN, forward_config
from .kernel_config import (BWD, BWD_CONVERT, BWD_DOT, BWD_DQ, BWD_FUSED, DTYPES, FWD, FWD_COMBINE, FWD_DECODE,
                            FWD_KVCACHE, HEAD_DIM_BUCKETS, MAX_GRID_YZ, MAX_HEAD_DIM, ROTARY_COPY, SMEM_LIMIT_BYTES,
                            SOURCE_FILE, VECTOR_WIDTHS, KernelConfig, fp32_cols, groups_per_chunk, head_dim_bucket,
                            narrow_spill_expected, smem_limit, vector_width, with_vector_width)
from .launches import convert_accumulator
from .kvcache_tiles import (DECODE_ROWS, KVCACHE_SHORT_ROWS, kvcache_config, kvcache_helper_configs,
                            paged_varlen_config)


class MmaSyncFamily:
    """Runs every call on compute capability 8.0 and newer."""

    name = "mma_sync"

    @staticmethod
    def unsupported_reason(arch: int, problem: AttentionProblem, direction: str, tensors=(),
                           deterministic: bool = False) -> str:
        return "" if arch >= 80 else f"needs compute capability 8.0 or newer, got {arch // 10}.{arch % 10}"

    @staticmethod
    def supports(arch: int, problem: AttentionProblem, direction: str, tensors=(), deterministic: bool = False) -> bool:
        return not MmaSyncFamily.unsupported_reason(arch, problem, direction, tensors, deterministic)

    @staticmethod
    def describe(problem: AttentionProblem, direction: str, sm_count: int) -> str:
        """Nothing beyond the family's name: its tiles follow from the head dim (forward_tiles,
        backward_plans, kvcache_tiles)."""
        return ""

    @staticmethod
    def forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream) -> None:
        launches.forward(q, k, v, out, lse, problem.shape, problem.causal, device_id, stream,
                         features=problem.features)

    @staticmethod
    def backward(problem: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, device_id: int, stream,
                 deterministic: bool = False) -> None:
        launches.backward(dout, q, k, v, out, lse, dq, dk, dv, problem.shape, problem.causal, deterministic,
                          device_id, stream, features=problem.features)

    @staticmethod
    def kvcache(cache, tensors: dict, causal: bool, features, interleaved: bool, num_splits: int,
                aligns: tuple[int, int, int], device_id: int, stream) -> None:
        kvcache_launches.kvcache(cache, tensors, causal, features, interleaved, num_splits, aligns, device_id, stream)

    @staticmethod
    def paged_forward(problem: AttentionProblem, q, k_cache, v_cache, out, lse, block_table, page_size: int,
                      device_id: int, stream) -> None:
        kvcache_launches.paged_varlen_forward(device_id, stream, q, k_cache, v_cache, out, lse, block_table,
                                              problem.shape, page_size, problem.causal, problem.features)

    all_configs = staticmethod(all_configs)
    compile_configs = staticmethod(compile_configs)


FAMILY = MmaSyncFamily()

__all__ = ["BWD", "BWD_CONVERT", "BWD_DOT", "BWD_DQ", "BWD_FUSED", "DECODE_ROWS", "DTYPES", "FAMILY",
           "FUSED_BWD_DEFAULT_BUCKETS", "FUSED_BWD_HEAD_DIMS", "FWD", "FWD_COMBINE", "FWD_DECODE", "FWD_KVCACHE",
           "FWD_LONG_CAUSAL_SEQLEN", "FWD_SEQLEN_CLASSES", "FWD_SHORT_SEQLEN", "HEAD_DIM_BUCKETS", "KVCACHE_SHORT_ROWS",
           "MAX_GRID_YZ", "MAX_HEAD_DIM", "NARROW_SAMPLES", "NARROW_SAMPLE_DTYPE", "ROTARY_COPY", "SMEM_LIMIT_BYTES",
           "SOURCE_FILE", "VECTOR_WIDTHS", "BackwardPlan", "KernelConfig", "MmaSyncFamily", "all_backward_configs",
           "all_configs", "all_forward_configs", "all_kvcache_configs", "all_narrow_configs", "atomic_dq_supported",
           "compile_configs", "convert_accumulator",
           "backward_plan", "backward_plan_options", "forward_config", "fp32_cols", "fused_backward_config",
           "fused_backward_supported", "groups_per_chunk", "head_dim_bucket", "kvcache_config",
           "kvcache_helper_configs", "narrow_backward_plan", "narrow_spill_expected", "paged_varlen_config",
           "possible_vector_widths", "smem_limit", "tuning_backward_configs", "vector_width", "with_vector_width"]
