"""Kernel configurations: pure data and pure functions, testable without a GPU.

A frozen :class:`KernelConfig` is at once the template arguments of one kernel instantiation, the
key of the compile cache and the id of its tests. Head dims are served by buckets (multiples of 32
up to 256): a head dim of 40 runs the 64-wide kernel with the columns past 40 zero-filled on load
and never stored, so 8 buckets x 2 dtypes x 2 mask flags cover every supported head dim.
"""

from __future__ import annotations

import dataclasses

MAX_HEAD_DIM = 256
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("bf16", "fp16")

#: Largest dynamic shared memory one block may use, in bytes, per compute capability.
SMEM_LIMIT_BYTES = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
}
SUPPORTED_ARCHS = (80, 90)  # archs with a tuned tile table; others fall back to the closest below


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One forward-kernel instantiation (template arguments in template order)."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int  # the bucket, not the user's head dim
    block_m: int
    block_n: int
    warps: int
    stages: int
    causal: bool
    kernel: str = "flash_fwd_kernel"

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        q_tile = self.block_m * self.head_dim * 2
        kv_slot = self.block_n * self.head_dim * 2
        return q_tile + self.stages * kv_slot

    def template_name(self) -> str:
        """The C++ name expression NVRTC instantiates and CuPy looks up."""
        cpp_type = {"bf16": "Bf16", "fp16": "Fp16"}[self.dtype]
        causal = "true" if self.causal else "false"
        return (f"{self.kernel}<{cpp_type}, {self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.warps}, {self.stages}, {causal}>")

    def short_id(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"fwd-{self.dtype}-d{self.head_dim}-{mask}-m{self.block_m}n{self.block_n}"
                f"w{self.warps}s{self.stages}")


def head_dim_bucket(head_dim: int) -> int:
    """Smallest bucket holding head_dim (the kernel's padded width)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim: expected at most {MAX_HEAD_DIM}, got {head_dim}")


def smem_limit(arch: int) -> int:
    """Shared-memory limit per block for compute capability `arch` (e.g. 80, 86, 90)."""
    if arch in SMEM_LIMIT_BYTES:
        return SMEM_LIMIT_BYTES[arch]
    if arch < 80:
        raise ValueError(f"arch: expected compute capability >= 8.0, got {arch // 10}.{arch % 10}")
    # Newer GPUs without an entry (sm_100, sm_120, ...): assume the small consumer-class budget.
    return SMEM_LIMIT_BYTES[86] if arch % 10 != 0 else SMEM_LIMIT_BYTES[80]


# (block_m, block_n, warps, stages) per head-dim bucket, for GPUs with large shared memory
# (A100/H100 class) and for the 99 KB consumer parts. Each warp owns 16 * block_m / (16 * warps)
# query rows; keeping the fp32 output accumulator under ~128 registers per thread avoids spills.
_FWD_TILES_LARGE_SMEM = {
    32: (128, 128, 4, 2),
    64: (128, 64, 4, 2),
    96: (128, 64, 8, 2),
    128: (128, 64, 8, 2),
    160: (128, 64, 8, 2),
    192: (128, 64, 8, 2),
    224: (128, 64, 8, 2),
    256: (128, 64, 8, 2),
}
_FWD_TILES_SMALL_SMEM = {
    32: (128, 128, 4, 2),
    64: (128, 64, 4, 2),
    96: (128, 64, 8, 2),
    128: (128, 64, 8, 2),
    160: (64, 64, 4, 2),
    192: (64, 64, 4, 2),
    224: (64, 64, 4, 2),
    256: (64, 64, 4, 2),
}


def forward_config(head_dim: int, dtype: str, causal: bool, arch: int) -> KernelConfig:
    """Tile shape for the forward kernel on compute capability `arch`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    bucket = head_dim_bucket(head_dim)
    limit = smem_limit(arch)
    table = _FWD_TILES_LARGE_SMEM if limit >= SMEM_LIMIT_BYTES[80] else _FWD_TILES_SMALL_SMEM
    block_m, block_n, warps, stages = table[bucket]
    config = KernelConfig(dtype, bucket, block_m, block_n, warps, stages, bool(causal))
    assert config.smem_bytes <= limit, f"{config.short_id()} needs {config.smem_bytes} B of shared memory"
    return config


def all_forward_configs(arch: int) -> list[KernelConfig]:
    """Every forward instantiation the library can launch on `arch` (for precompilation)."""
    return [forward_config(bucket, dtype, causal, arch)
            for bucket in HEAD_DIM_BUCKETS for dtype in DTYPES for causal in (False, True)]
