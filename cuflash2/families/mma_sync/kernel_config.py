"""The mma.sync kernels' configurations: pure data and pure functions, testable without a GPU.

A frozen :class:`KernelConfig` is at once the template arguments of one kernel instantiation, the
key of the compile cache and the id of its tests. Head dims are served by buckets (multiples of 32
up to 256): a head dim of 40 runs the 64-wide kernel with the columns past 40 zero-filled on load
and never stored, so 8 buckets cover every head dim from 1 to 256.

Global memory is accessed in pieces of a per-call vector width (vector_width: 16 bytes where the
call's pointers, strides and head dim allow it, else 8, 4 or 2), a compile-time constant of the
kernel (KernelConfig.vec): any head dim and any 2-byte aligned layout run without a padding copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ...problem.tensors import MAX_GRID_YZ, MAX_HEAD_DIM

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("bf16", "fp16")
#: Bytes per global access the kernels can be compiled for (KernelConfig.vec), widest first.
VECTOR_WIDTHS = (16, 8, 4, 2)

#: Largest dynamic shared memory one block may use, in bytes, per compute capability.
SMEM_LIMIT_BYTES = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
    121: 99 * 1024,
}

FWD, BWD, BWD_DQ, BWD_DOT, BWD_CONVERT = ("flash_fwd_kernel", "flash_bwd_kernel", "flash_bwd_dq_kernel",
                                          "flash_bwd_dot_do_o_kernel", "flash_bwd_convert_kernel")
FWD_KVCACHE, ROTARY_COPY, FWD_COMBINE = "flash_fwd_kvcache_kernel", "rotary_copy_kernel", "flash_fwd_combine_kernel"
FWD_DECODE = "flash_fwd_decode_kernel"
BWD_FUSED = "flash_bwd_fused_kernel"
SOURCE_FILE = {FWD: "flash_fwd.cu", BWD: "flash_bwd.cu", BWD_DQ: "flash_bwd_dq.cu",
               BWD_DOT: "flash_bwd_prepost.cu", BWD_CONVERT: "flash_bwd_prepost.cu", FWD_KVCACHE: "flash_fwd.cu",
               ROTARY_COPY: "kvcache.cu", FWD_COMBINE: "kvcache.cu", BWD_FUSED: "flash_bwd_fused.cu",
               FWD_DECODE: "flash_fwd.cu"}
_CPP_TYPE = {"bf16": "Bf16", "fp16": "Fp16"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel instantiation.

    `flags` holds the backward kernel's (dv, dk, dq, float_dkv) switches, or the fused backward
    kernel's (float_dkv,); unused fields are 0.
    `variant` selects the kernels with FA2's optional features (varlen, sliding window, softcap,
    ALiBi) as run-time parameters; plain calls use the kernels without them.
    """

    kernel: str
    dtype: str  # "bf16" | "fp16"
    head_dim: int = 0  # the bucket (the fused backward's width for buckets 160/224), not the user's head dim
    block_m: int = 0
    block_n: int = 0
    warps: int = 4
    stages: int = 0
    causal: bool = False
    flags: tuple[bool, ...] = ()
    variant: bool = False
    # Bytes per global load/store of the call's tensors (vector_width); below 16 the kernel is built
    # with narrower pieces (kVecBytes in kernels_cu/common/ptx.cuh, set by compile_options). Not a template
    # argument: the 16-byte kernels keep their names and code.
    vec: int = 16

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        d, m, n = self.head_dim, self.block_m, self.block_n
        if self.kernel in (FWD, FWD_KVCACHE):
            return m * d * 2 + self.stages * n * d * 2 + self.forward_row_sums_bytes
        if self.kernel == FWD_DECODE:  # Q; the K/V ring, reused by the merge of the warps (DecodeTraits)
            merge = self.warps * m * (d + 4 + 2) * 4
            return m * d * 2 + max(self.stages * n * d * 2, merge)
        if self.kernel == BWD:
            with_dq = self.flags[2]
            dq_bytes = n * m * 2 + 2 * m * d * 4 if with_dq else 0  # dS^T tile, 2 fp32 dQ staging buffers
            return 2 * n * d * 2 + self.stages * (2 * m * d * 2 + 2 * m * 4) + dq_bytes
        if self.kernel == BWD_DQ:
            return 2 * m * d * 2 + 2 * n * d * 2
        if self.kernel == BWD_FUSED:  # K, V; 2 stages of Q, dO, LSE, D; P^T, dS^T; fp32 dQ buffers
            pad = self.dq_row_pad_floats
            for buffers in (2, 1):  # FusedBwdTraits::kDqBuffers: as many as fit
                if self._fused_own_dq_bytes(buffers, pad) <= SMEM_LIMIT_BYTES[90]:
                    return self._fused_own_dq_bytes(buffers, pad)
            fixed, stage = self._fused_fixed_and_stage_bytes()  # kDqInStage: dQ over a consumed Q/dO stage
            return fixed + 2 * max(stage, m * (d + pad) * 4)
        return 0

    @property
    def forward_row_sums_bytes(self) -> int:
        """Shared memory of the forward's running row sums, kept there (not in registers) by tiles
        whose output accumulator and S take >= 160 registers per thread at head dims >= 96 with 32
        rows per warp (FwdTraits::kSumsInSmem in flash_fwd.cu)."""
        if self.kernel not in (FWD, FWD_KVCACHE):
            return 0
        m_tiles = self.block_m // (16 * self.warps)
        acc_registers = m_tiles * (self.head_dim // 8 + self.block_n // 8) * 4
        sums_in_smem = self.head_dim >= 96 and acc_registers >= 160 and m_tiles >= 2
        return self.threads * m_tiles * 2 * 4 if sums_in_smem else 0

    def template_name(self) -> str:
        """The C++ name expression NVRTC instantiates and CuPy looks up."""
        def cpp(*values):
            return ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)

        t, d, m, n, w, s, c, var = (_CPP_TYPE[self.dtype], self.head_dim, self.block_m, self.block_n, self.warps,
                                    self.stages, self.causal, self.variant)
        args = {FWD: cpp(t, d, m, n, w, s, c, var), BWD: cpp(t, d, m, n, w, s, c, var, *self.flags),
                BWD_DQ: cpp(t, d, m, n, w, c, var), BWD_DOT: cpp(t, d), BWD_CONVERT: cpp(t),
                FWD_KVCACHE: cpp(t, d, m, n, w, s, c), ROTARY_COPY: cpp(t), FWD_COMBINE: cpp(t),
                BWD_FUSED: cpp(t, d, m, n, w, c, *self.flags), FWD_DECODE: cpp(t, d, n, w, s, c)}[self.kernel]
        return f"{self.kernel}<{args}>"

    def short_id(self) -> str:
        name = {FWD: "fwd", BWD: "bwd", BWD_DQ: "bwd-dq", BWD_DOT: "bwd-dot", BWD_CONVERT: "bwd-convert",
                FWD_KVCACHE: "fwd-kvcache", ROTARY_COPY: "rotary-copy", FWD_COMBINE: "fwd-combine",
                BWD_FUSED: "bwd-fused", FWD_DECODE: "fwd-decode"}[self.kernel]
        parts = [name, self.dtype]
        if self.head_dim:
            parts.append(f"d{self.head_dim}")
        if self.block_m:
            parts.append("causal" if self.causal else "full")
            if self.variant:
                parts.append("var")
            parts.append(f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}")
        names = ("f32",) if self.kernel == BWD_FUSED else ("dv", "dk", "dq", "f32")
        if any(self.flags):
            parts.append("".join(name for name, on in zip(names, self.flags) if on))
        if self.vec != 16:
            parts.append(f"v{self.vec}")
        return "-".join(parts)

    def compile_options(self) -> tuple[str, ...]:
        """NVRTC options beyond the common ones: the vector width where it is not 16 bytes."""
        return () if self.vec == 16 else (f"-DCF_VEC_BYTES={self.vec}",)

    @property
    def accumulates_dq(self) -> bool:
        """A backward main kernel that adds its dQ partial sums to the fp32 accumulator."""
        return self.kernel == BWD_FUSED or (self.kernel == BWD and self.flags[2])

    def dq_column_swizzle(self, head_dim: int) -> int:
        """Column-permutation mask of the fp32 dQ accumulator this kernel fills through shared memory
        (dq_swizzled_col, kernels_cu/common/dq_layout.cuh), which the convert kernel undoes: pairs
        of columns move by 8 * (row % 4) so that the staging stores avoid bank conflicts. Only for
        head dims that are multiples of 32, and not in the fused kernel (it pads its rows instead:
        dq_row_pad_floats); 0 means no permutation."""
        swizzles = self.accumulates_dq and self.kernel != BWD_FUSED  # the fused kernel pads rows instead
        return 24 if swizzles and fp32_cols(head_dim) % 32 == 0 else 0

    @property
    def dq_row_pad_floats(self) -> int:
        """Floats of padding after each staged row of fp32 dQ: the fused kernel pads its rows instead
        of swizzling columns, so that its staging stores avoid bank conflicts without spending
        registers: 32 bytes, or 16 where 32 would cost it its own two dQ buffers, with its rows
        interleaved then (dq_row_interleave); conflict-free either way (FusedBwdTraits::kDqPadBytes,
        dq_staging.cuh)."""
        if self.kernel != BWD_FUSED:
            return 0
        def fits_two_buffers(pad_floats: int) -> bool:
            return self._fused_own_dq_bytes(2, pad_floats) <= SMEM_LIMIT_BYTES[90]
        return 4 if fits_two_buffers(4) and not fits_two_buffers(8) else 8

    @property
    def grouped_grid(self) -> bool:
        """Causal forward and fused backward kernels launch in the grouped order (BlockGrid,
        kernels_cu/common/block_mask.cuh): (G, blocks, chunks) over chunks of G (head, batch) groups, so
        that the longest blocks (the forward's last query blocks, the backward's first key blocks)
        of a whole chunk start before any shorter one. Grid y then holds the blocks: at most
        MAX_GRID_YZ."""
        return self.causal and self.kernel in (FWD, BWD_FUSED)

    def grid(self, blocks: int, nheads: int, batch: int, slots: int) -> tuple[int, int, int]:
        """Launch grid of a forward or backward main kernel over `blocks` query or key blocks per
        (head, batch) group; `slots`: how many of its thread blocks the GPU runs at once."""
        if not self.grouped_grid:
            return (blocks, nheads, batch)
        groups = nheads * batch
        size = groups_per_chunk(groups, blocks, slots)
        return (size, blocks, groups // size)

    @property
    def dq_row_interleave(self) -> bool:
        """Whether the fp32 dQ accumulator this kernel fills holds the rows of each group of 8
        interleaved (row r at 2 (r % 4) + r / 4; dq_staged_row, kernels_cu/common/dq_layout.cuh), which the
        convert kernel undoes: the fused kernel's 16-byte row padding alone leaves its staging stores
        2-way conflicted, the interleave spreads them over all banks (FusedBwdTraits::kDqRowInterleave)."""
        return self.kernel == BWD_FUSED and self.dq_row_pad_floats == 4

    def _fused_own_dq_bytes(self, dq_buffers: int, pad_floats: int) -> int:
        """The fused backward's shared memory with `dq_buffers` fp32 dQ buffers of its own, rows
        padded by `pad_floats` (FusedBwdTraits: kFixedBytes + 2 kPlainStageBytes + the buffers)."""
        fixed, stage = self._fused_fixed_and_stage_bytes()
        return fixed + 2 * stage + dq_buffers * self.block_m * (self.head_dim + pad_floats) * 4

    def _fused_fixed_and_stage_bytes(self) -> tuple[int, int]:
        """The fused backward's shared memory besides dQ staging (FusedBwdTraits::kFixedBytes: K, V,
        P^T, dS^T) and one Q/dO stage with its LSE and D rows (kPlainStageBytes)."""
        d, m, n = self.head_dim, self.block_m, self.block_n
        return 2 * n * d * 2 + 2 * n * m * 2, 2 * m * d * 2 + 2 * m * 4

    def dq_row_pitch(self, head_dim: int) -> int:
        """Floats per row of the fp32 dQ accumulator this kernel fills for a call with `head_dim`
        (rows are copied byte for byte from its shared-memory staging): padded rows span the
        kernel's width (a compile-time pitch), the others the call's head dim rounded up to 8
        (fp32_cols)."""
        return self.head_dim + self.dq_row_pad_floats if self.dq_row_pad_floats else fp32_cols(head_dim)

    @property
    def source_file(self) -> str:
        return SOURCE_FILE[self.kernel]


def fp32_cols(head_dim: int) -> int:
    """Columns per row of the kernels' fp32 scratch (dQ/dK/dV accumulators, split-KV partials): the
    head dim rounded up to a multiple of 8, so that scratch rows stay 16-byte aligned for any head
    dim (fp32_cols in kernels_cu/common/ptx.cuh; the same as the head dim where the vector width is 16)."""
    return -(-head_dim // 8) * 8


def vector_width(head_dim: int, itemsize: int = 2, byte_offsets=()) -> int:
    """Bytes per global access of a call: the largest of VECTOR_WIDTHS dividing head_dim * itemsize
    and every one of `byte_offsets` (the base pointer of each tensor the kernels read or write and
    each of its batch/row/head strides in bytes, leaving out those of size-1 dims, which are never
    applied). Dividing the row's bytes too, a piece is never split by the end of the head dim: it
    is copied whole or zero-filled whole. Zero offsets (broadcast or unused strides) allow any width."""
    common = head_dim * itemsize
    for offset in byte_offsets:
        common = math.gcd(common, int(offset))
    for width in VECTOR_WIDTHS:
        if common % width == 0:
            return width
    raise ValueError(f"data: expected pointers and strides aligned to {VECTOR_WIDTHS[-1]} bytes (whole 16-bit "
                     f"elements), got a common alignment of {common} bytes")


def with_vector_width(config: KernelConfig, vec: int) -> KernelConfig:
    """`config` built for vector width `vec` (the element-wise rotary/append copy takes no width).
    The narrow copies' extra addresses and predicates (and, at width 2, the registers a chunk is
    gathered in) cost registers that the 16-byte tiles do not have, so below 16 bytes some tiles
    shrink (each rule was found by compiling the sampled narrow configs for sm_80/86/90):
    - forward tiles with 32 query rows per warp at head dims >= 96 run twice the warps, 16 rows
      each (the same shared memory or less); at head dims >= 224 (>= 160 at width 2) also 32-key
      blocks;
    - KV-cache and decoding tiles at head dims >= 128 take 64-key blocks instead of 128 (the
      KV-cache tiles 32 at width 2);
    - the backward's dK/dV kernels at head dims >= 128 take half the query rows per step, and its
      dQ kernel, at width 2, half the keys.
    Some width-2 kernels still keep a stack frame (narrow_spill_expected)."""
    if vec == config.vec or config.kernel == ROTARY_COPY:
        return config
    if vec < 16 and config.kernel in (FWD, FWD_KVCACHE) and config.head_dim >= 96:
        if config.block_m // (16 * config.warps) >= 2:
            config = dataclasses.replace(config, warps=config.warps * 2)
        if (config.head_dim >= 224 or (vec == 2 and config.head_dim >= 160)) and config.block_n > 32:
            config = dataclasses.replace(config, block_n=32)
    if vec < 16 and config.kernel in (FWD_KVCACHE, FWD_DECODE) and config.head_dim >= 128:
        keys = 32 if vec == 2 and config.kernel == FWD_KVCACHE else 64
        if config.block_n > keys:
            config = dataclasses.replace(config, block_n=keys)
    if vec < 16 and config.kernel == BWD and config.head_dim >= 128 and config.block_m >= 64:
        config = dataclasses.replace(config, block_m=config.block_m // 2)
    if vec == 2 and config.kernel == BWD_DQ and config.head_dim >= 128 and config.block_n >= 32:
        config = dataclasses.replace(config, block_n=config.block_n // 2)
    return dataclasses.replace(config, vec=vec)


def narrow_spill_expected(config: KernelConfig) -> bool:
    """Width-2 kernels (odd head dims, or strides of an odd number of elements) above head dim 192,
    and the variant dK/dV kernels above 128: no tile found compiles them without a stack frame (a
    few to a hundred bytes). They are correct, and slower."""
    return config.vec == 2 and (config.head_dim > 192 or (config.head_dim > 128 and config.kernel == BWD
                                                         and config.variant))


def head_dim_bucket(head_dim: int) -> int:
    """Smallest bucket holding head_dim (the kernel's padded width)."""
    if head_dim < 1:
        raise ValueError(f"head_dim: expected a positive head dim, got {head_dim}")
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
    # A GPU without an entry: assume the smallest budget of the supported generations.
    return SMEM_LIMIT_BYTES[86]


def large_smem(arch: int) -> bool:
    return smem_limit(arch) >= SMEM_LIMIT_BYTES[80]


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")


@functools.lru_cache(maxsize=1024)
def groups_per_chunk(groups: int, blocks: int, slots: int) -> int:
    """G of the grouped grid order (KernelConfig.grouped_grid): the fewest groups whose blocks fill
    one wave of `slots`, so the last wave holds the short blocks of the last chunk (a list-scheduling
    model of the tail: benchmarks/schedule_model.py) while the blocks running at once touch few groups'
    data; taken among the divisors of `groups` (chunks alike: a smaller last chunk would start its
    long blocks late), and large enough for grid z to hold the chunks."""
    least = max(-(-slots // blocks), -(-groups // MAX_GRID_YZ), 1)
    best, i = groups, 1
    while i * i <= groups:
        if groups % i == 0:
            best = min([best] + [d for d in (i, groups // i) if d >= least])
        i += 1
    return best
