"""The Hopper forward (kernels_cu/wgmma/flash_fwd_sm90.cu): tiles, what it runs, launch.

The kernel is compiled for sm_90a (wgmma and setmaxnreg exist only there) and takes one by-value
parameter struct holding four TMA tensor maps (q, k, v, and the output's for the TMA stores of
short calls) and the scalars. Calls it does not run go to the
next family (mma_sync).
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np

from ...problem.features import AttentionProblem
from ...problem.tensors import SHORT_DTYPE, SUPPORTED_DTYPES
from ...runtime import fast_div, launcher, tensor_maps
from ...runtime.device import sm_count
from ...runtime.switches import switch_on, switch_setting

SOURCE = "wgmma/flash_fwd_sm90.cu"
ARCH = 90  # compute capability the sm_90a code runs on (9.0 exactly)
GROUP_ROWS = 64  # query rows per consumer warpgroup
BARRIER_BYTES = 192  # the mbarriers and the tile slot at the end of shared memory (FwdBarriers)
MAX_HEAD_DIM = 256
SMEM_LIMIT = 227 * 1024
#: CUFLASH2_HANG_CHECK=1 runs the debug build, whose barrier waits trap after 4 s instead of hanging.
HANG_CHECK_VARIABLE = "CUFLASH2_HANG_CHECK"
#: CUFLASH2_SPLIT_TAIL=1 splits the tail of every non-causal launch that can be split, 0 none (see
#: split_tail); unset, the launches that leave SMs idle for long enough.
SPLIT_TAIL_VARIABLE = "CUFLASH2_SPLIT_TAIL"
#: CUFLASH2_KV_CLUSTERS=1 runs every non-causal call that can run in CTA pairs that way (see
#: paired), 0 none; unset, the calls where the pairs measured faster.
KV_CLUSTERS_VARIABLE = "CUFLASH2_KV_CLUSTERS"
#: FwdParams (flash_fwd_sm90.cu), field by field in the kernel's order: name and struct code. Every
#: field sits at its natural alignment; the struct ends padded to its tensor maps' 64 bytes (the
#: kernel pins the size).
_DIVISORS = ("m_blocks", "heads", "section_tiles", "section_pairs", "last_pairs")
_FIELDS = ([(f"{t}_map", "128s") for t in ("q", "k", "v", "o")]
           + [(name, "Q") for name in ("o", "lse", "tile_counter", "partials", "partial_ready")]
           + [(name, "q") for name in ("o_batch_stride", "o_row_stride", "o_head_stride", "lse_batch_stride",
                                       "lse_head_stride")]
           + [(name, "i") for name in ("seqlen_q", "seqlen_k", "head_dim", "kv_group", "batch", "tiles",
                                       "whole_rounds", "split_units")]
           + [("scale_log2", "f")]
           + [(f"{name}.{part}", code) for name in _DIVISORS
              for part, code in zip(("mul", "shift", "d"), fast_div.LAYOUT.format.lstrip("<"))])
FIELD_NAMES = tuple(name for name, _ in _FIELDS)
_UNPADDED = struct.calcsize("<" + "".join(code for _, code in _FIELDS))
PARAMS = struct.Struct("<" + "".join(code for _, code in _FIELDS) + f"{-_UNPADDED % 64}x")
L2_SECTION_BYTES = 32 << 20  # causal tile order: K and V of one section of heads fit in L2


@dataclasses.dataclass(frozen=True)
class WgmmaFwdConfig:
    """One instantiation of flash_fwd_sm90 (the interface compiler.get_kernel and
    compiler.compile_offline expect of a kernel config)."""

    head_dim: int  # the head dim the kernel is built for: the call's, rounded up to 16
    block_n: int  # key rows per block
    groups: int  # consumer warpgroups, 64 query rows each
    causal: bool
    dtype: str
    hang_check: bool = False  # debug build: mbarrier waits trap after a bounded spin
    staged_output: bool = False  # the epilogue through shared memory and TMA stores (short calls, d > 64)
    cluster_kv: bool = False  # CTA pairs on neighbouring query blocks share each K/V block (multicast TMA)

    source_file = SOURCE

    @property
    def block_m(self) -> int:
        return GROUP_ROWS * self.groups

    @property
    def threads(self) -> int:
        return 128 * (self.groups + 1)  # + the producer warpgroup

    @property
    def panels(self) -> int:
        return -(-self.head_dim // 64)

    @property
    def q_stages(self) -> int:
        """Q tiles in shared memory (FwdTile::kQStages): two up to head dim 64."""
        return 2 if self.panels == 1 else 1

    @property
    def stages(self) -> int:
        """K and V blocks in flight (FwdTile::kStages): four up to head dim 64, else two."""
        return 4 if self.panels == 1 else 2

    @property
    def output_over_v(self) -> bool:
        """Whether the output tile is staged over the V stages (FwdTile::kOOverV): no room beside them."""
        return (self.staged_output
                and self._bytes_before_output() + self._output_bytes() + BARRIER_BYTES + 1024 > SMEM_LIMIT)

    @property
    def smem_bytes(self) -> int:
        """Q tiles + `stages` K and V blocks (128-byte rows per 64 columns) + the output tile unless
        it lies over V + barriers + alignment slack."""
        output = 0 if self.output_over_v else self._output_bytes()
        return self._bytes_before_output() + output + BARRIER_BYTES + 1024

    def _bytes_before_output(self) -> int:
        return (self.q_stages * self.block_m + 2 * self.stages * self.block_n) * 128 * self.panels

    def _output_bytes(self) -> int:
        """The output tile the epilogue stages for its TMA stores (none when the output goes from
        registers to global memory)."""
        return self.block_m * 128 * self.panels if self.staged_output else 0

    def template_name(self) -> str:
        return (f"flash_fwd_sm90<{self.head_dim}, {self.block_n}, {self.groups}, {cpp_bool(self.causal)}, "
                f"{cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.staged_output)}>")

    def short_id(self) -> str:
        return (f"wgmma_fwd_d{self.head_dim}_m{self.block_m}_n{self.block_n}_{'causal' if self.causal else 'full'}_"
                f"{SHORT_DTYPE[self.dtype]}{'_staged' if self.staged_output else ''}"
                f"{'_cluster' if self.cluster_kv else ''}{'_hangcheck' if self.hang_check else ''}")

    def compile_options(self) -> tuple[str, ...]:
        return sm90a_options(self.hang_check) + (("-DCF_CLUSTER_KV",) if self.cluster_kv else ())

    @property
    def kv_box_rows(self) -> int:
        """Rows of a K/V TMA box: a block, or half of one where a CTA pair shares it."""
        return self.block_n // 2 if self.cluster_kv else self.block_n


def cpp_bool(x: bool) -> str:
    """A template argument's spelling of a flag."""
    return "true" if x else "false"


def sm90a_options(hang_check: bool = False) -> tuple[str, ...]:
    """NVRTC options of the family's kernels (the debug build with bounded barrier waits if asked)."""
    return ("-arch=sm_90a",) + (("-DCF_HANG_CHECK",) if hang_check else ())


#: Calls with query and key lengths up to this many rows are short: causal ones take two consumer
#: warpgroups at head dims up to 64 too (a 192-row tile spends a larger part of a short causal row
#: on the masked diagonal and on rows past the end: d64 causal, 512: 208 -> 231 TFLOP/s, 1k: 273 ->
#: 304; three groups win again from 2k: 376 against 360), and above head dim 64 the output goes
#: through shared memory and TMA stores (d128 / d256 at 512: +10% / +14-16%, at 1k +5% / +4-11%;
#: from 2k the same or 3-5% slower than stores from registers).
SHORT_SEQLEN = 1024
#: Key block of long non-causal calls at head dim 128: fewer blocks per row, so less softmax
#: bookkeeping per key. Kernel A/B on an H200 (5 rounds in turn, against 128 keys): bf16 +1-4% at
#: 2k, +0-4% at 4k, +2% at 8k, +3% at 16k; fp16 +2-3%. Short calls (staged output) lost 6-15%, and
#: causal ones 0-3% at 2k (with fewer rows per diagonal, more keys per block are masked).
WIDE_BLOCK_N = 160
#: Key block of calls at head dim 128 from WIDEST_SEQLEN (the longer length) up, causal or not.
#: Kernel A/B on an H200 in sustained turns (3 rounds in turn of 0.4 s, bf16), 192 against 160 / 128
#: keys: non-causal 8k 635 against 607 / 617 TFLOP/s, 16k 642 against 628 / 623; causal 8k 579
#: against 569 / 580, 16k 620 against 597 / 597 (fp16 against 128: 8k 561 / 555, 16k 578 / 569).
#: At 2k-4k it trailed the best by 1-1.5%: the last block's padding is a larger share of a row
#: there (128 of 4224 keys at 4k), and a causal row's diagonal masks more keys per block.
WIDEST_BLOCK_N = 192
WIDEST_SEQLEN = 8192
#: One length of each class forward_config tells apart (None: a long call of unknown length).
SEQLEN_CLASSES = (None, SHORT_SEQLEN, WIDEST_SEQLEN)


def forward_config(head_dim: int, dtype: str, causal: bool, hang_check: bool = False,
                   seqlen: int | None = None) -> WgmmaFwdConfig:
    """The tile for a call: three consumer warpgroups (192 query rows) up to head dim 64, where their
    160 registers each hold S, P and O, except on short causal calls (`seqlen`: the longer of the
    query and key lengths, see SHORT_SEQLEN); two (128 rows, 240 registers) above. Key blocks
    as wide as shared memory (Q tile + two stages of K and V) and registers allow and measured
    fastest: 128 keys up to head dim 128 (at 128: 160 on long non-causal calls, WIDE_BLOCK_N, and
    192 on all calls from 8k, WIDEST_BLOCK_N), 96 up to 192, 80 above. Short calls above head dim
    64 stage the output for TMA stores."""
    padded = -(-head_dim // 16) * 16
    short = seqlen is not None and seqlen <= SHORT_SEQLEN
    groups = 3 if padded <= 64 and not (causal and short) else 2
    if padded == 128 and seqlen is not None and seqlen >= WIDEST_SEQLEN:
        block_n = WIDEST_BLOCK_N
    elif padded == 128 and not causal and not short:
        block_n = WIDE_BLOCK_N
    else:
        block_n = 128 if padded <= 128 else 96 if padded <= 192 else 80
    return WgmmaFwdConfig(padded, block_n, groups, causal, dtype, hang_check, staged_output=short and padded > 64)


#: Key block of the calls that run in CTA pairs by default (head dim 128, non-causal, 1k-8k keys).
#: Each CTA of a pair loads half of every K and V block into both with a multicast TMA, which halves
#: the K/V traffic from L2 into the SMs (1 MiB per 128-row tile at 2k keys, some 4.5 TB/s): energy,
#: which sets the clock at the board's power limit. H200, kernel A/B in sustained turns (1 s, 4
#: rounds in rotating order) against the kernel as is: bf16 2k / 4k 568 / 596 -> 575 / 603 TFLOP/s, fp16
#: 544 / 574 -> 551 / 583 (cuDNN 563 / 582 and 537 / 560); in short samples, where the clock is
#: not held by the power limit, 1.4-2.6% slower (the pair waits for its slower CTA).
PAIRED_BLOCK_N = WIDE_BLOCK_N


def pair_build_exists(config: WgmmaFwdConfig) -> bool:
    """Whether the instantiation has a CTA-pair build: non-causal (the pair's tiles need the same
    key blocks), the output not staged over the V stages (which the pair shares)."""
    return not config.causal and not config.output_over_v


def pairs_possible(config: WgmmaFwdConfig, causal: bool, seqlen_q: int) -> bool:
    """Whether a call can run in CTA pairs: a non-causal call on an instantiation with a pair build,
    and a positive, even number of query blocks per head (a pair's tiles share a head)."""
    blocks = -(-seqlen_q // config.block_m)
    return not causal and pair_build_exists(config) and blocks > 0 and blocks % 2 == 0


def paired(config: WgmmaFwdConfig, problem: AttentionProblem) -> WgmmaFwdConfig:
    """`config` in CTA pairs where the call can run that way and KV_CLUSTERS_VARIABLE, else
    PAIRED_BLOCK_N at head dim 128, asks for it."""
    setting = switch_setting(KV_CLUSTERS_VARIABLE)
    wanted = setting if setting is not None else (config.head_dim == 128 and config.block_n == PAIRED_BLOCK_N)
    if wanted and pairs_possible(config, problem.causal, problem.shape.seqlen_q):
        return dataclasses.replace(config, cluster_kv=True)
    return config


def with_pairs(configs: list[WgmmaFwdConfig]) -> list[WgmmaFwdConfig]:
    """The configs and their CTA-pair builds, where a call may run one (KV_CLUSTERS_VARIABLE)."""
    return configs + [dataclasses.replace(c, cluster_kv=True) for c in configs if pair_build_exists(c)]


def all_configs() -> list[WgmmaFwdConfig]:
    """Every instantiation a call can pick (the compile check builds them all)."""
    return with_pairs(list(dict.fromkeys(
        forward_config(d, dtype, causal, seqlen=seqlen) for d in range(16, MAX_HEAD_DIM + 1, 16)
        for dtype in SUPPORTED_DTYPES for causal in (False, True) for seqlen in SEQLEN_CLASSES)))


def unsupported_reason(arch: int, problem: AttentionProblem, tensors=()) -> str:
    """Why the wgmma forward does not run a call ("" when it does): compute capability 9.0, 16-bit
    inputs, a head dim that is a multiple of 8 up to 256, plain or causal attention (no window,
    score modifier, dropout, varlen or KV cache), and tensors a TMA map can describe (16-byte
    aligned base and strides, contiguous last dim)."""
    shape = problem.shape
    if arch != ARCH:
        return f"needs compute capability 9.0 (sm_90a), got {arch // 10}.{arch % 10}"
    if shape.dtype not in SUPPORTED_DTYPES:
        return f"needs float16 or bfloat16 inputs, got {shape.dtype}"
    if shape.head_dim % 8 or shape.head_dim > MAX_HEAD_DIM:
        return f"needs a head dim that is a multiple of 8 up to {MAX_HEAD_DIM}, got {shape.head_dim}"
    if not problem.plain or problem.features.varlen:
        return "runs plain and causal attention only (no window, softcap, ALiBi, dropout, varlen or KV cache)"
    for name, t in tensors:
        if not tensor_maps.describes(t):
            return (f"needs {name} with a 16-byte aligned base and strides that are multiples of 8 elements, "
                    f"got strides {tuple(t.strides)} at 0x{t.data_ptr:x}")
    return ""


def _map(t, address: int, rows: int, batch: int, seqlen: int, heads: int, head_dim: int) -> bytes:
    """Map of a (batch, seqlen, heads, head_dim) tensor laid out as `t`, at `address`, with boxes of
    {64 columns, rows}."""
    return tensor_maps.encode_tiled(t.dtype, address, (head_dim, seqlen, heads, batch),
                                    (t.strides[1] * 2, t.strides[2] * 2, t.strides[0] * 2), (64, rows, 1, 1))


def section_pairs(shape) -> int:
    """(batch, head) pairs per L2 section of the causal tile order."""
    kv_bytes = shape.seqlen_k * shape.head_dim * 2 * 2
    return max(1, min(shape.nheads * shape.batch, L2_SECTION_BYTES // max(1, kv_bytes)))


def tile_count(shape, config: WgmmaFwdConfig) -> int:
    return math.ceil(shape.seqlen_q / config.block_m) * shape.nheads * shape.batch


#: Idle time, in tiles per CTA, that a partly filled last round must leave before its tail is
#: split: a tile cut between two CTAs costs one CTA a write and the other a read of its rows in
#: fp32 (at head dim 128, 64 KB each way, a few percent of a 4k tile).
MIN_IDLE_TILES = 0.1


#: Above head dim 192, non-causal calls split their tail only from this many keys. A cut tile hands
#: 64 KB per consumer group over in fp32 (twice head dim 128's), and its two halves are a few of the
#: tile's 80-key blocks each: H200, kernel A/B at 2k / 4k keys, whole tiles against a split tail,
#: sustained bf16 645 / 684 against 628 / 672 TFLOP/s, fp16 624 / 654 against 606 / 644, short
#: samples +3% / 0% (bf16) and +3% / +4% (fp16); at 8k-16k the two even sustained and the split
#: ahead in short samples. Head dims 64 and 128 gain from the split at every length measured.
WIDE_HEAD_SPLIT_SEQLEN = 8192


@dataclasses.dataclass(frozen=True)
class TailSplit:
    """The non-causal walk of `ctas` CTAs (span_at in the kernel): `whole_rounds` rounds of whole
    tiles, then `units` key blocks of the remaining tiles shared out evenly (none: 0)."""

    whole_rounds: int
    units: int = 0


def split_tail(tiles: int, ctas: int, key_blocks: int, setting: bool | None = None) -> TailSplit:
    """How a non-causal launch of `tiles` tiles with `key_blocks` key blocks each walks on `ctas`
    CTAs. Without a split, ceil(tiles / ctas) rounds of whole tiles, the last one partly filled.
    With one, a round fewer than the full ones, then the remaining tiles (more than `ctas`, fewer
    than twice as many) cut into key blocks and shared out evenly, so that every CTA's share is a
    tile or more and a tile is cut at most once. `setting`: True splits wherever that is possible,
    False nowhere, None where the last round leaves CTAs idle for at least MIN_IDLE_TILES."""
    rounds = -(-tiles // ctas)
    whole = tiles // ctas - 1
    units = (tiles - whole * ctas) * key_blocks
    possible = tiles > ctas and tiles % ctas != 0 and key_blocks >= 2 and units * ctas < 2 ** 31
    wanted = setting if setting is not None else rounds - tiles / ctas >= MIN_IDLE_TILES
    return TailSplit(whole, units) if possible and wanted else TailSplit(rounds)


def partial_floats(config: WgmmaFwdConfig, ctas: int) -> int:
    """fp32 values of the rows a split tail hands over: per CTA and consumer group, each thread's O
    accumulators and four row statistics."""
    return ctas * config.groups * 128 * (config.panels * 32 + 4)


def struct_builder(q, k, v, out, lse, shape, config: WgmmaFwdConfig, split: TailSplit):
    """build(addresses) -> the FwdParams fields, in PARAMS order, of a call on tensors laid out as
    the described q, k, v, out, lse placed at `addresses` (theirs, then the tile counter's: a zeroed
    int32 for causal calls and split tails, else None; then those of a split tail's partial rows and
    zeroed flags, else None). Everything but the addresses is worked out once here."""
    b, sq, sk, h, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.head_dim
    m_blocks = math.ceil(sq / config.block_m)
    pairs = section_pairs(shape)
    last_pairs = (h * b - 1) % pairs + 1  # in the last section of the causal order
    divisors = (m_blocks, h, pairs * m_blocks, pairs, last_pairs)  # in _DIVISORS' order
    scalars = (out.strides[0], out.strides[1], out.strides[2], lse.strides[0], lse.strides[1],
               sq, sk, d, shape.kv_group, b, tile_count(shape, config),
               split.whole_rounds, split.units, shape.softmax_scale * math.log2(math.e))
    # (m_blocks is 0 only for an empty query, which launches nothing.)
    scalars += sum((fast_div.fast_divisor(max(1, x)) for x in divisors), ())
    block_m, kv_rows = config.block_m, config.kv_box_rows

    def build(addresses) -> tuple:
        q_at, k_at, v_at, out_at, lse_at, counter_at, partials_at, flags_at = addresses
        # The output's map only where the kernel stores through it (a replay re-encodes each map
        # whose address moved).
        out_map = _map(out, out_at, GROUP_ROWS, b, sq, h, d) if config.staged_output else bytes(tensor_maps.MAP_BYTES)
        return (_map(q, q_at, block_m, b, sq, h, d), _map(k, k_at, kv_rows, b, sk, hk, d),
                _map(v, v_at, kv_rows, b, sk, hk, d), out_map, out_at, lse_at, counter_at or 0, partials_at or 0,
                flags_at or 0) + scalars

    return build


def hang_check() -> bool:
    return switch_on(HANG_CHECK_VARIABLE)


def launch_plan(problem: AttentionProblem, config: WgmmaFwdConfig, ctas: int,
                split_setting: bool | None = None) -> tuple[int, TailSplit]:
    """(CTAs launched, how they walk the tiles) of a call on a GPU with `ctas` SMs: one CTA per SM,
    at most one per tile; long non-causal calls may split their tail (split_tail; `split_setting`,
    else SPLIT_TAIL_VARIABLE, forces it on or off, short ones included)."""
    shape = problem.shape
    tiles = tile_count(shape, config)
    grid = min(tiles, ctas)
    if config.cluster_kv:
        # A pair walks neighbouring query blocks of one head in step (tile c and c + 1 of each round,
        # c even), whole tiles only: an even grid and an even number of query blocks per head.
        if not pairs_possible(config, problem.causal, shape.seqlen_q):
            raise ValueError(f"CTA pairs (cluster_kv) need a non-causal call with an even number of query "
                             f"blocks per head, got causal={problem.causal}, seqlen_q={shape.seqlen_q}")
        grid -= grid % 2
    if problem.causal or config.cluster_kv or grid == 0:
        return grid, TailSplit(-(-tiles // max(grid, 1)))
    if split_setting is None:
        split_setting = switch_setting(SPLIT_TAIL_VARIABLE)
    if split_setting is None and (config.staged_output or
                                  (config.head_dim > 192 and shape.seqlen_k < WIDE_HEAD_SPLIT_SEQLEN)):
        # Short calls keep whole tiles: a tile is a few key blocks there, and the two extra spans
        # of a split (each a Q load and a pipeline start) cost what the idle SMs did (H200, kernel
        # A/B: d128 / d256 at 512 -4% / -9%, at 1k -0.3% / -3.5%). So do head dims above 192 below
        # WIDE_HEAD_SPLIT_SEQLEN keys.
        split_setting = False
    return grid, split_tail(tiles, grid, -(-shape.seqlen_k // config.block_n), split_setting)


def call_config(problem: AttentionProblem) -> WgmmaFwdConfig:
    """The instantiation a call runs: its tile (forward_config), in CTA pairs where they are wanted
    and possible (paired)."""
    shape = problem.shape
    return paired(forward_config(shape.head_dim, shape.dtype, problem.causal, hang_check(),
                                 max(shape.seqlen_q, shape.seqlen_k)), problem)


def describe_plan(problem: AttentionProblem, ctas: int) -> str:
    """The tile and the walk of a call on a GPU with `ctas` SMs, in words (`cuflash2 info`). CTA
    pairs as if the device holds them (forward runs unpaired where it holds none)."""
    config = call_config(problem)
    grid, split = launch_plan(problem, config, ctas)
    parts = [f"{config.block_m} query rows ({config.groups} consumer warpgroups) by {config.block_n}-key blocks",
             "output staged for TMA stores" if config.staged_output else "output stored from registers"]
    if config.cluster_kv:
        parts.append("CTA pairs sharing each K and V block")
    walk = ("longest tiles first" if problem.causal else
            "the last round split across the SMs" if split.units else "whole tiles")
    parts.append(f"{tile_count(problem.shape, config)} tiles on {grid} CTAs, {walk}")
    return ", ".join(parts)


def forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream,
            config: WgmmaFwdConfig | None = None, split_setting: bool | None = None) -> None:
    """out, lse <- attention(q, k, v) (TensorInfo of (batch, seqlen, heads, head_dim) tensors and of
    the (batch, heads, seqlen_q) fp32 LSE), queued on `stream` as one persistent launch: one CTA
    per SM, at most one per tile. `config` and `split_setting` (see launch_plan) override the
    choices of a call, for kernel A/Bs."""
    shape = problem.shape
    config = config or call_config(problem)
    ctas = sm_count(device_id)
    if config.cluster_kv:
        # Pairs need two SMs of one GPC: the grid is as many pairs as the device holds at once (a
        # persistent walk must not leave a pair waiting for a second wave); none, unpaired.
        pairs = launcher.max_active_clusters(config, device_id, 2)
        if pairs:
            ctas = min(ctas, 2 * pairs)
        else:
            config = dataclasses.replace(config, cluster_kv=False)
    grid, split = launch_plan(problem, config, ctas, split_setting)
    if grid == 0:
        return
    # Causal: the tiles taken after the first round. Split tail: the CTAs' places in the walk, in
    # the order they started (a CTA waits for the one before it).
    counter, counter_info = (launcher.scratch((1,), np.int32, zero=True) if problem.causal or split.units
                             else (None, None))
    partials, partials_info = launcher.scratch((partial_floats(config, grid),)) if split.units else (None, None)
    flags, flags_info = (launcher.scratch((grid * config.groups,), np.int32, zero=True) if split.units
                         else (None, None))

    # The maps embed the addresses: replays rebuild the struct for theirs.
    arguments = launcher.StructArguments(PARAMS, (q, k, v, out, lse, counter_info, partials_info, flags_info),
                                         struct_builder(q, k, v, out, lse, shape, config, split))
    launcher.launch_struct_kernel(config, device_id, stream, (grid,), arguments)
    del counter, partials, flags  # stream-ordered: reused only by work queued after this point
