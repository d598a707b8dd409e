"""Kernel configurations: pure data and pure functions, testable without a GPU.

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

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
MAX_HEAD_DIM = 256
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
    # with narrower pieces (kVecBytes in kernels_cu/ptx.cuh, set by compile_options). Not a template
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
        (DqStaging::swizzled_col, kernels_cu/dq_staging.cuh), which the convert kernel undoes: pairs
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
        kernels_cu/block_mask.cuh): (G, blocks, chunks) over chunks of G (head, batch) groups, so
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
        interleaved (row r at 2 (r % 4) + r / 4; dq_staged_row, kernels_cu/dq_staging.cuh), which the
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
    dim (fp32_cols in kernels_cu/ptx.cuh; the same as the head dim where the vector width is 16)."""
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


def narrow_backward_plan(head_dim: int, dtype: str, causal: bool, arch: int, gqa: bool, variant: bool,
                         vec: int) -> BackwardPlan:
    """The backward plan of a call whose tensors take `vec`-byte accesses (vec < 16): the two-kernel
    dK/dV plan with its own dQ kernel (the one-pass fused and atomic-dQ kernels hold too many
    registers for narrow copies), each kernel built for the width."""
    plan = backward_plan(head_dim, dtype, causal, arch, deterministic=True, gqa=gqa, variant=variant, fused=False)
    return BackwardPlan(with_vector_width(plan.dot, vec), tuple(with_vector_width(c, vec) for c in plan.main),
                        plan.dq and with_vector_width(plan.dq, vec), with_vector_width(plan.convert, vec))


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


def _large_smem(arch: int) -> bool:
    return smem_limit(arch) >= SMEM_LIMIT_BYTES[80]


def _check_dtype(dtype: str) -> None:
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


# ---- forward ------------------------------------------------------------------------------------
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
# Causal grids hold a sequence's query blocks in grid y (at most MAX_GRID_YZ; launch.py raises past
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
    _check_dtype(dtype)
    bucket = head_dim_bucket(head_dim)
    plain_sm90 = not variant and arch == 90
    if plain_sm90 and short and causal and bucket in _FWD_SHORT_CAUSAL_TILES_SM90:
        tiles = _FWD_SHORT_CAUSAL_TILES_SM90[bucket]
    elif plain_sm90 and not causal and bucket in _FWD_FULL_TILES_SM90:
        tiles = _FWD_FULL_TILES_SM90[bucket]
    elif plain_sm90 and bucket in _FWD_TILES_SM90:
        tiles = _FWD_TILES_SM90[bucket]
    elif _large_smem(arch):
        tiles = ((_FWD_VARIANT_TILES_LARGE_SMEM.get(bucket) if variant else None)
                 or _FWD_TILES_LARGE_SMEM[bucket])
    else:
        tiles = (_FWD_VARIANT_TILES_SMALL_SMEM.get(bucket) if variant else None) or _FWD_TILES_SMALL_SMEM[bucket]
    block_m, block_n, warps, stages = tiles
    config = KernelConfig(FWD, dtype, bucket, block_m, block_n, warps, stages, bool(causal), variant=bool(variant))
    assert config.smem_bytes <= smem_limit(arch), f"{config.short_id()} needs {config.smem_bytes} B"
    return config


# ---- KV cache (flash_attn_with_kvcache) -----------------------------------------------------------
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
    _check_dtype(dtype)
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
    if bucket == 128 and not _large_smem(arch):
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
    _check_dtype(dtype)
    return KernelConfig(ROTARY_COPY, dtype, warps=8), KernelConfig(FWD_COMBINE, dtype, warps=8)


def _kvcache_configs_of(arch: int, bucket: int, dtype: str) -> list[KernelConfig]:
    return [kvcache_config(bucket, dtype, causal, arch, r) for causal in (False, True)
            for r in _kvcache_configs_of_rows(bucket)] + list(kvcache_helper_configs(dtype))


def all_kvcache_configs(arch: int) -> list[KernelConfig]:
    """Every KV-cache instantiation at width 16 (narrow widths: all_narrow_configs), the paged
    varlen forward's among them (paged_varlen_config takes the 32- and 64-row tiles listed here)."""
    configs = [kvcache_config(bucket, dtype, causal, arch, rows)
               for bucket in HEAD_DIM_BUCKETS for dtype in DTYPES for causal in (False, True)
               for rows in _kvcache_configs_of_rows(bucket)]
    configs += [c for dtype in DTYPES for c in kvcache_helper_configs(dtype)]
    return list(dict.fromkeys(configs))


def all_narrow_configs(arch: int) -> list[KernelConfig]:
    """The narrow vector widths' instantiations the compile test covers (NARROW_SAMPLES): forward,
    backward and KV-cache kernels of the sampled buckets and widths."""
    configs = []
    for configs_of in (_forward_configs_of, _kvcache_configs_of):
        configs += _narrow_samples(functools.partial(configs_of, arch))
    configs += [c for bucket, vec in NARROW_SAMPLES for c in _narrow_backward_configs_of(arch, bucket, vec)]
    return list(dict.fromkeys(configs))


def _narrow_backward_configs_of(arch: int, bucket: int, vec: int) -> list[KernelConfig]:
    """Every kernel of the narrow backward plans (narrow_backward_plan) of a bucket and width."""
    return list(dict.fromkeys(c for causal in (False, True) for gqa in (False, True) for variant in (False, True)
                              for c in narrow_backward_plan(bucket, NARROW_SAMPLE_DTYPE, causal, arch, gqa, variant,
                                                            vec).kernels()))


def _kvcache_configs_of_rows(bucket: int) -> tuple[int, ...]:
    return (64,) + ((KVCACHE_SHORT_ROWS,) if bucket in _KVCACHE_SHORT_TILES else ()) + \
        ((DECODE_ROWS,) if bucket in _DECODE_TILES else ())


# ---- backward -----------------------------------------------------------------------------------
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
    _check_dtype(dtype)
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


# ---- everything ---------------------------------------------------------------------------------

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
