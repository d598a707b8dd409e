"""The Hopper backward (kernels_cu/wgmma/flash_bwd_sm90.cu): what it runs, its parameter struct,
the launches.

Three launches: flash_bwd_rows_sm90 (LSE in log2 units and D = rowsum(dO * O), padded to whole
query blocks), flash_bwd_sm90 (one CTA per 128 keys, 64 at head dim 256, or a persistent grid
walking those tiles: dK, dV, and dQ added to a zeroed fp32 accumulator by bulk reductions; with
deterministic=True in a fixed order of turns, counted in a zeroed int32 counter per query block),
and flash_bwd_dq_sm90 (dQ scaled and converted out of the accumulator's fragment order); with GQA,
the mma.sync family's conversion sums dK and dV over each group of query heads.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np

from ...problem.features import AttentionProblem
from ...problem.tensors import SHORT_DTYPE, SUPPORTED_DTYPES
from ...runtime import launcher, tensor_maps
from ...runtime.device import sm_count
from ...runtime.switches import switch_on
from ..mma_sync import convert_accumulator
from .forward import ARCH, HANG_CHECK_VARIABLE, cpp_bool, hang_check, sm90a_options

SOURCE = "wgmma/flash_bwd_sm90.cu"
#: Query rows per step for each head dim the kernel is built for (BwdTile): at 128 the two consumer
#: groups split dQ's columns, at 64 they split its 128 rows, at 256 the head dim of dK, dV and dQ.
BLOCK_M = {64: 128, 128: 64, 256: 64}
#: Keys per CTA (BwdTile::kBlockN).
BLOCK_N = {64: 128, 128: 128, 256: 64}
#: Kernel head dims whose consumer groups split the head dim (BwdTile::kSplitColumns).
SPLIT_HEAD_DIMS = (256,)
HEAD_DIMS = tuple(BLOCK_M)  # the kernel's
#: Call head dims it runs: multiples of 8 in these ranges, each on the smallest kernel head dim that
#: holds it, the columns past its own loaded as zeros. Below 32 most of a 64-column tile would be
#: padding; from 136 to 184 the d256 kernel's wasted columns cost more than the mma.sync backward
#: loses (at d192 it measured 1.1-1.4x that backward, 0.93x only causal at 1k).
HEAD_DIM_RANGES = ((32, 128), (192, 256))
THREADS = 384
# BwdParams (flash_bwd_sm90.cu): 6 maps, 6 pointers, 6 i64 strides, 6 ints, 2 floats, the head dim,
# the persistent walk's units per (head, batch) and in all, the dK/dV store flag, padding to 960.
PARAMS = struct.Struct("<128s128s128s128s128s128sQQQQQQqqqqqqiiiiiiffiiii48x")
#: Rows of dK and dV per TMA store box (one consumer group's keys); a box's columns are 128 bytes.
KEY_GRADIENT_BOX_ROWS = 64
#: CUFLASH2_ZERO_TMA_SCRATCH=1 zero-fills the scratch that the kernel writes by TMA stores (GQA's fp32
#: dK/dV sums per query head) before the launch. For compute-sanitizer's initcheck, which does not count
#: TMA stores as writes and would report the conversion's reads of them; nothing else needs it.
ZERO_TMA_SCRATCH_VARIABLE = "CUFLASH2_ZERO_TMA_SCRATCH"
_NO_MAP = bytes(tensor_maps.MAP_BYTES)


def runs_head_dim(head_dim: int) -> bool:
    """Whether a call's head dim runs here (see HEAD_DIM_RANGES)."""
    return head_dim % 8 == 0 and any(lo <= head_dim <= hi for lo, hi in HEAD_DIM_RANGES)


def kernel_head_dim(head_dim: int) -> int:
    """The kernel head dim a call's runs on (its tiles' columns past the call's load as zeros)."""
    return next(d for d in HEAD_DIMS if head_dim <= d)


def smem_bytes(head_dim: int) -> int:
    """BwdTile::kSmemBytes: K and V, two stages of Q and dO, the dS^T tiles (two; one at head dim
    256, with the fp32 P^T it is formed from), the warps' dQ parts (at head dim 256 staged over a
    stage instead), two stages of LSE and D rows, the barriers, the alignment slack."""
    block_m, block_n = BLOCK_M[head_dim], BLOCK_N[head_dim]
    kv, q, ds = block_n * 2 * head_dim, block_m * 2 * head_dim, block_n * 2 * block_m
    if head_dim in SPLIT_HEAD_DIMS:
        tiles = ds + block_n * block_m * 4
    else:
        tiles = 2 * ds + block_m * head_dim * 4
    return 2 * kv + 4 * q + tiles + 4 * block_m * 4 + 128 + 1024


@dataclasses.dataclass(frozen=True)
class WgmmaBwdConfig:
    """One instantiation of flash_bwd_sm90 (the kernel-config interface of the compiler)."""

    head_dim: int
    causal: bool
    dtype: str
    gqa: bool  # dK, dV per query head in fp32 (summed over each group afterwards)
    deterministic: bool = False  # dQ reductions in a fixed order of turns (dq_turn)
    hang_check: bool = False
    persistent: bool = False  # one CTA per SM walking the tiles (PersistentWalk); not with deterministic

    def __post_init__(self):
        if self.persistent and self.deterministic:
            raise ValueError("WgmmaBwdConfig: deterministic mode runs one CTA per tile (persistent=False)")

    source_file = SOURCE
    threads = THREADS

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.head_dim)

    def template_name(self) -> str:
        return (f"flash_bwd_sm90<{self.head_dim}, {cpp_bool(self.causal)}, {cpp_bool(self.dtype == 'bfloat16')}, "
                f"{cpp_bool(self.gqa)}, {cpp_bool(self.deterministic)}, {cpp_bool(self.persistent)}>")

    def short_id(self) -> str:
        return (f"wgmma_bwd_d{self.head_dim}_{'causal' if self.causal else 'full'}_{SHORT_DTYPE[self.dtype]}"
                f"{'_gqa' if self.gqa else ''}{'_det' if self.deterministic else ''}"
                f"{'_persistent' if self.persistent else ''}"
                f"{'_hangcheck' if self.hang_check else ''}")

    def compile_options(self) -> tuple[str, ...]:
        return sm90a_options(self.hang_check)


@dataclasses.dataclass(frozen=True)
class WgmmaBwdPassConfig:
    """A pass around flash_bwd_sm90: "rows" (flash_bwd_rows_sm90, the padded per-row inputs) or "dq"
    (flash_bwd_dq_sm90, dQ out of its accumulator)."""

    kernel: str
    head_dim: int
    dtype: str

    source_file = SOURCE
    threads = 256
    smem_bytes = 0

    def template_name(self) -> str:
        return f"flash_bwd_{self.kernel}_sm90<{self.head_dim}, {cpp_bool(self.dtype == 'bfloat16')}>"

    def short_id(self) -> str:
        return f"wgmma_bwd_{self.kernel}_d{self.head_dim}_{SHORT_DTYPE[self.dtype]}"

    def compile_options(self) -> tuple[str, ...]:
        return sm90a_options()


def all_configs() -> list:
    """Every instantiation a call can pick (the compile check builds them all)."""
    def grids(d: int, causal: bool, deterministic: bool) -> tuple[bool, ...]:  # persistent or not
        return (False, True) if (d, causal) in PERSISTENT_ABOVE and not deterministic else (False,)

    return [WgmmaBwdConfig(d, causal, dtype, gqa, deterministic, persistent=persistent)
            for d in HEAD_DIMS for dtype in SUPPORTED_DTYPES for causal in (False, True) for gqa in (False, True)
            for deterministic in (False, True) for persistent in grids(d, causal, deterministic)] + [
        WgmmaBwdPassConfig(kernel, d, dtype) for kernel in ("rows", "dq") for d in HEAD_DIMS for dtype in SUPPORTED_DTYPES]


def unsupported_reason(arch: int, problem: AttentionProblem, deterministic: bool, tensors=()) -> str:
    """Why the Hopper backward does not run a call ("" when it does)."""
    shape = problem.shape
    if arch != ARCH:
        return f"needs compute capability 9.0 (sm_90a), got {arch // 10}.{arch % 10}"
    if shape.dtype not in SUPPORTED_DTYPES:
        return f"needs float16 or bfloat16 inputs, got {shape.dtype}"
    if not runs_head_dim(shape.head_dim):
        ranges = " and ".join(f"{lo}-{hi}" for lo, hi in HEAD_DIM_RANGES)
        return f"runs head dims that are multiples of 8 in {ranges}, got {shape.head_dim}"
    if not problem.plain or problem.features.varlen:
        return "runs plain and causal attention only (no window, softcap, ALiBi, dropout or varlen)"
    # TMA maps (q, k, v, dout), 16-byte loads (out), 8-byte stores (the conversion of dk and dv with
    # GQA); dq, and without GQA dk and dv, are stored in 4-byte pairs (dk and dv by TMA stores
    # instead where their strides fit a map: stores_key_gradients_by_tma).
    paired = ("dq",) if shape.kv_group > 1 else ("dq", "dk", "dv")
    for name, t in tensors:
        if name == "softmax_lse" or name in paired:  # softmax_lse: contiguous, as check_lse requires
            continue
        if not tensor_maps.describes(t):
            return (f"needs {name} with a 16-byte aligned base and strides that are multiples of 8 elements, "
                    f"got strides {tuple(t.strides)} at 0x{t.data_ptr:x}")
    for name, t in tensors:
        if name in paired and (t.strides[-1] != 1 or t.data_ptr % 4 or any(s % 2 for s in t.strides[:-1])):
            return f"needs {name} with 4-byte aligned column pairs, got strides {tuple(t.strides)}"
    return ""


def _map(t, address: int, rows: int, batch: int, seqlen: int, heads: int) -> bytes:
    """A (head_dim, seqlen, heads, batch) map of `t` in boxes of 128-byte rows (64 16-bit or 32 fp32
    columns) by `rows`."""
    size = t.itemsize
    return tensor_maps.encode_tiled(t.dtype, address, (t.shape[-1], seqlen, heads, batch),
                                    (t.strides[1] * size, t.strides[2] * size, t.strides[0] * size),
                                    (128 // size, rows, 1, 1))


def stores_key_gradients_by_tma(dk, dv) -> bool:
    """Whether the kernel stores dK and dV through shared memory and the TMA (store_key_gradients_by_tma
    in flash_bwd_sm90.cu): when both tensors it writes (the outputs, or with GQA the fp32 sums per
    query head) fit a map; otherwise it stores them from registers."""
    return tensor_maps.describes(dk) and tensor_maps.describes(dv)


def _i64(x):
    return np.int64(x)


def _i32(x):
    return np.int32(x)


def _ptr(x):
    return np.uint64(x)


#: The kernel head dims and masks whose calls run the persistent grid once the longer of seqlen_q
#: and seqlen_k exceeds the given length. Kernel A/B on an H200 (3 rounds in turn of 0.4 s sustained
#: runs, at the board's power limit from 4k: what a training loop sees), persistent against one CTA
#: per tile at d128: with the walk read warp-uniform (the current kernel), causal -0.2% at 512,
#: +3.7% at 4k and 16k; with the kernel before it, causal -0.7% at 512, +1.4% at 1k, +2.4% at 2k,
#: +0.7-1.7% at 4k, +1.1% at 8k, +3.6% at 16k (fp16 +2.8% / +2.4% at 2k / 4k), non-causal -2% at
#: 1k, -3% at 2k, -3.6% at 4k (fp16 -3.3% at 2k). Short turns (2 ms, boost clocks) had measured
#: non-causal even to +4% at 1k-2k, within their spread of several percent; on the persistent grid
#: d64 lost 3-16% and d256 2-6% (both masks, 1k-16k, short turns). Causal tiles gain from the
#: walk's pairs of key blocks j and n_blocks - 1 - j, which even out their uneven step counts where
#: one-tile CTAs end in a ragged last round, and from loading the next tile's K and V while the
#: previous one's dK and dV are stored.
PERSISTENT_ABOVE = {(128, True): 512}


#: The persistent walk keeps a thread's place in one 32-bit word (tile index << 3, flash_bwd_sm90.cu's
#: for_each_tile): calls with this many units or more run one CTA per tile.
MAX_PERSISTENT_UNITS = 1 << 27


def persistent_grid(head_dim: int, causal: bool, deterministic: bool, seqlen: int | None) -> bool:
    """Whether a call runs the persistent grid (one CTA per SM walking units of key blocks, the next
    tile's K and V loaded as soon as the previous tile's dK and dV no longer need them; PersistentWalk in
    flash_bwd_sm90.cu): at the kernel head dims and masks that gain from it, calls longer than
    PERSISTENT_ABOVE gives (`seqlen`, the longer length; None: long or unknown), not in
    deterministic mode (whose turns follow the order one-tile CTAs start in)."""
    shortest = PERSISTENT_ABOVE.get((head_dim, causal))
    if deterministic or shortest is None:
        return False
    return seqlen is None or seqlen > shortest


def main_grid(config: WgmmaBwdConfig, n_blocks: int, units: int, h: int, b: int,
              device_id: int) -> tuple[int, int, int]:
    """One CTA per (key block, head, batch) tile, or a persistent grid of one CTA per SM (at most
    one per unit of key blocks j and n_blocks - 1 - j; `units` of them in all)."""
    if config.persistent:
        return (min(units, sm_count(device_id)), 1, 1)
    return (n_blocks, h, b)


def backward(problem: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, device_id: int, stream,
             deterministic: bool = False, config: WgmmaBwdConfig | None = None) -> None:
    """dq, dk, dv <- the gradients (TensorInfos, (batch, seqlen, heads, head_dim); lse (batch, heads,
    seqlen_q) fp32 contiguous), queued on `stream`; `deterministic`: the same bits on every run."""
    shape = problem.shape
    b, sq, sk, h, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.head_dim
    gqa = shape.kv_group > 1
    kd = kernel_head_dim(d)
    causal = bool(problem.causal)
    config = config or WgmmaBwdConfig(kd, causal, shape.dtype, gqa, deterministic, hang_check(),
                                      persistent_grid(kd, causal, deterministic, max(sq, sk)))
    block_m, block_n = BLOCK_M[kd], BLOCK_N[kd]
    m_blocks = math.ceil(sq / block_m)
    padded = m_blocks * block_m
    lse_log2, lse_log2_i = launcher.scratch((b, h, padded))
    delta, delta_i = launcher.scratch((b, h, padded))
    rows = WgmmaBwdPassConfig("rows", kd, shape.dtype)
    launcher.launch_kernel(rows, device_id, stream, (math.ceil(padded / 32), h, b),
                           (_ptr(dout.data_ptr), _ptr(out.data_ptr), _ptr(lse.data_ptr), _ptr(lse_log2_i.data_ptr),
                            _ptr(delta_i.data_ptr), *map(_i64, dout.strides[:3]), *map(_i64, out.strides[:3]),
                            _i32(sq), _i32(h), _i32(m_blocks), _i32(d)))
    dq_acc, dq_acc_i = launcher.scratch((b, h, m_blocks, block_m * kd), zero=True)  # DqFragments order
    if config.deterministic:  # a turn counter per query block (keep_dq) and a ticket per head
        turns, turns_i = launcher.scratch((b, h, m_blocks + 1), np.int32, zero=True)  # + the head's ticket
    else:
        turns, turns_i = None, None
    if gqa:  # per query head, summed over each group by the conversion
        zero = switch_on(ZERO_TMA_SCRATCH_VARIABLE)
        (dk_acc, dk_t), (dv_acc, dv_t) = (launcher.scratch((b, sk, h, d), zero=zero) for _ in range(2))
    else:
        dk_acc = dv_acc = None
        dk_t, dv_t = dk, dv
    scale = shape.softmax_scale
    n_blocks = math.ceil(sk / block_n)
    # Deterministic non-causal calls walk cyclically when a head's CTAs (one per SM) all fit at once.
    cyclic = config.deterministic and not config.causal and n_blocks <= sm_count(device_id)
    units_per_head = -(-n_blocks // 2)  # the persistent walk's: key blocks j and n_blocks - 1 - j
    dkv_by_tma = stores_key_gradients_by_tma(dk_t, dv_t)
    units = units_per_head * h * b
    if config.persistent and units >= MAX_PERSISTENT_UNITS:
        config = dataclasses.replace(config, persistent=False)

    def build(addresses) -> tuple:
        q_at, k_at, v_at, do_at, lse_at, delta_at, dq_at, turns_at, dk_at, dv_at = addresses
        loads = (_map(q, q_at, block_m, b, sq, h), _map(k, k_at, block_n, b, sk, hk),
                 _map(v, v_at, block_n, b, sk, hk), _map(dout, do_at, block_m, b, sq, h))
        stores = (tuple(_map(t, at, KEY_GRADIENT_BOX_ROWS, b, sk, t.shape[2])  # with GQA: per query head
                        for t, at in ((dk_t, dk_at), (dv_t, dv_at))) if dkv_by_tma else (_NO_MAP, _NO_MAP))
        return (*loads, *stores, lse_at, delta_at, dq_at, turns_at or 0, dk_at, dv_at,
                dk_t.strides[0], dk_t.strides[1], dk_t.strides[2], dv_t.strides[0], dv_t.strides[1], dv_t.strides[2],
                sq, sk, h, shape.kv_group, m_blocks, int(cyclic), scale * math.log2(math.e), scale, d,
                units_per_head, units, int(dkv_by_tma))

    arguments = launcher.StructArguments(PARAMS, (q, k, v, dout, lse_log2_i, delta_i, dq_acc_i, turns_i, dk_t, dv_t), build)
    grid = main_grid(config, n_blocks, units, h, b, device_id)
    launcher.launch_struct_kernel(config, device_id, stream, grid, arguments)
    launcher.launch_kernel(WgmmaBwdPassConfig("dq", kd, shape.dtype), device_id, stream, (m_blocks, h, b),
                           (_ptr(dq_acc_i.data_ptr), _ptr(dq.data_ptr), *map(_i64, dq.strides[:3]), _i32(sq), _i32(h),
                            _i32(m_blocks), np.float32(scale), _i32(d)))
    if gqa:
        for acc, grad in ((dk_t, dk), (dv_t, dv)):
            convert_accumulator(shape.dtype, device_id, stream, acc, grad, b, sk, hk, d, shape.kv_group, 1.0)
    del lse_log2, delta, dq_acc, turns, dk_acc, dv_acc  # stream-ordered: reused only by work queued after this point


__all__ = ["HANG_CHECK_VARIABLE", "HEAD_DIM_RANGES", "PARAMS", "ZERO_TMA_SCRATCH_VARIABLE", "WgmmaBwdConfig",
           "WgmmaBwdPassConfig", "all_configs",
           "backward", "kernel_head_dim", "runs_head_dim", "unsupported_reason"]
