"""The Hopper (wgmma) forward without a GPU: tile choice, what it accepts, tensor-map checks, and
the NVRTC compile of every sm_90a instantiation with ptxas' slowdown warnings treated as failures."""

import dataclasses
import re

import numpy as np
import pytest

from cuflash2.families.wgmma import backward as wgmma_bwd
from cuflash2.families.wgmma import forward as wgmma_fwd
from cuflash2.problem.features import AttentionProblem
from cuflash2.runtime import compiler, fast_div, tensor_maps
from cuflash2.runtime.tensors import TensorInfo
from cuflash2.problem.tensors import AttentionShape, contiguous_info


def test_tiles_fit_shared_memory_and_cover_every_head_dim():
    for d in range(8, 257, 8):
        for causal in (False, True):
            config = wgmma_fwd.forward_config(d, "bfloat16", causal)
            assert config.head_dim % 16 == 0 and d <= config.head_dim < d + 16
            assert config.block_n % 16 == 0
            assert config.smem_bytes <= wgmma_fwd.SMEM_LIMIT, config
            assert config in wgmma_fwd.all_configs()


def test_short_calls_above_head_dim_64_stage_the_output_beside_v_up_to_128_and_over_it_above(monkeypatch):
    """Short calls above head dim 64 send the output through shared memory and TMA stores: a tile
    of its own where Q, K and V leave room for it (up to head dim 128), else over the V stages
    (which must then hold it). Long or unknown lengths and head dims up to 64 store from registers
    and take no shared memory for it; both kinds are compiled by the gate."""
    short, long = wgmma_fwd.SHORT_SEQLEN, wgmma_fwd.SHORT_SEQLEN + 1
    for d in range(16, 257, 16):
        for causal in (False, True):
            for seqlen in (short, long, None):
                config = wgmma_fwd.forward_config(d, "bfloat16", causal, seqlen=seqlen)
                assert config.staged_output == (d > 64 and seqlen == short), config
                assert config in wgmma_fwd.all_configs()
                output = config.block_m * 128 * config.panels if config.staged_output else 0
                kv = 2 * config.stages * config.block_n * 128 * config.panels
                q = config.q_stages * config.block_m * 128 * config.panels
                assert config.output_over_v == (config.staged_output and d > 128), config
                output_here = 0 if config.output_over_v else output
                assert config.smem_bytes == q + kv + output_here + wgmma_fwd.BARRIER_BYTES + 1024
                assert not config.output_over_v or output <= kv // 2, config
    chosen = []
    monkeypatch.setattr(wgmma_fwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: chosen.append(config))
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(wgmma_fwd.launcher, "max_active_clusters", lambda config, device_id, ctas: 66)
    for seqlen_q, seqlen_k, staged in ((512, 512, True), (1024, 300, True), (512, 4096, False), (2048, 512, False)):
        problem = AttentionProblem(AttentionShape(1, seqlen_q, seqlen_k, 4, 4, 128, "bfloat16", 0.1), False)
        q, kv = (contiguous_info((1, s, 4, 128), "bfloat16", 2, "cuda:0", 1 << 20) for s in (seqlen_q, seqlen_k))
        lse = contiguous_info((1, 4, seqlen_q), "float32", 4, "cuda:0", 1 << 20)
        monkeypatch.setattr(wgmma_fwd.tensor_maps, "encode_tiled", lambda *args, **kwargs: bytes(128))
        wgmma_fwd.forward(problem, q, kv, kv, q, lse, 0, None)
        assert chosen[-1].staged_output == staged, (seqlen_q, seqlen_k)


def test_long_calls_at_head_dim_128_take_wider_key_blocks():
    """Head dims 113-128: non-causal calls longer than SHORT_SEQLEN or of unknown length take
    160-key blocks, and every call from WIDEST_SEQLEN, causal or not, 192 (measured faster there);
    shorter causal calls, short calls and other head dims keep their blocks."""
    long, short = wgmma_fwd.SHORT_SEQLEN + 1, wgmma_fwd.SHORT_SEQLEN
    for d in (120, 128):
        for seqlen in (long, wgmma_fwd.WIDEST_SEQLEN - 1, None):
            config = wgmma_fwd.forward_config(d, "float16", False, seqlen=seqlen)
            assert config.block_n == wgmma_fwd.WIDE_BLOCK_N == 160 and config.groups == 2, config
            assert not config.staged_output and config in wgmma_fwd.all_configs()
        for seqlen in (wgmma_fwd.WIDEST_SEQLEN, 1 << 20):
            for causal in (False, True):
                config = wgmma_fwd.forward_config(d, "bfloat16", causal, seqlen=seqlen)
                assert config.block_n == wgmma_fwd.WIDEST_BLOCK_N == 192 and config.groups == 2, config
                assert config.smem_bytes <= wgmma_fwd.SMEM_LIMIT and config in wgmma_fwd.all_configs()
        assert wgmma_fwd.forward_config(d, "bfloat16", True, seqlen=wgmma_fwd.WIDEST_SEQLEN - 1).block_n == 128
        assert wgmma_fwd.forward_config(d, "bfloat16", True, seqlen=None).block_n == 128
        assert wgmma_fwd.forward_config(d, "bfloat16", False, seqlen=short).block_n == 128
        assert wgmma_fwd.forward_config(d, "bfloat16", True, seqlen=long).block_n == 128
    assert wgmma_fwd.forward_config(96, "bfloat16", False, seqlen=long).block_n == 128
    assert wgmma_fwd.forward_config(64, "bfloat16", False, seqlen=long).block_n == 128


def test_short_causal_calls_at_small_head_dims_take_two_warpgroups(monkeypatch):
    """Up to head dim 64 the forward runs three consumer warpgroups (192 query rows), except on
    causal calls whose query and key lengths are both short, where a 128-row tile wastes less of
    each row on the masked diagonal; both tiles are compiled by the gate."""
    short, long = wgmma_fwd.SHORT_SEQLEN, wgmma_fwd.SHORT_SEQLEN + 1
    assert wgmma_fwd.forward_config(64, "bfloat16", True, seqlen=short).groups == 2
    assert wgmma_fwd.forward_config(64, "bfloat16", True, seqlen=long).groups == 3
    assert wgmma_fwd.forward_config(64, "bfloat16", True).groups == 3  # length unknown
    assert wgmma_fwd.forward_config(64, "float16", False, seqlen=short).groups == 3
    assert wgmma_fwd.forward_config(128, "bfloat16", True, seqlen=long).groups == 2
    for seqlen in (short, long):
        assert wgmma_fwd.forward_config(48, "float16", True, seqlen=seqlen) in wgmma_fwd.all_configs()
    chosen = []
    monkeypatch.setattr(wgmma_fwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: chosen.append(config))
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 132)
    for seqlen_q, seqlen_k, groups in ((512, 512, 2), (512, 4096, 3), (4096, 512, 3)):
        problem = AttentionProblem(AttentionShape(1, seqlen_q, seqlen_k, 4, 4, 64, "bfloat16", 0.1), True)
        q, kv = (contiguous_info((1, s, 4, 64), "bfloat16", 2, "cuda:0", 1 << 20) for s in (seqlen_q, seqlen_k))
        lse = contiguous_info((1, 4, seqlen_q), "float32", 4, "cuda:0", 1 << 20)
        monkeypatch.setattr(wgmma_fwd.launcher, "scratch", lambda *args, **kwargs: (None, None))
        wgmma_fwd.forward(problem, q, kv, kv, q, lse, 0, None)
        assert chosen[-1].groups == groups, (seqlen_q, seqlen_k)


def test_params_struct_is_the_kernels_704_bytes():
    assert wgmma_fwd.PARAMS.size == 704  # flash_fwd_sm90.cu static_asserts sizeof(FwdParams) == 704
    assert len(wgmma_fwd.FIELD_NAMES) == len(set(wgmma_fwd.FIELD_NAMES))
    assert len(wgmma_fwd.PARAMS.unpack(bytes(704))) == len(wgmma_fwd.FIELD_NAMES)


def test_the_host_fields_are_the_kernels_in_its_order():
    """FIELD_NAMES against FwdParams' declarations in flash_fwd_sm90.cu (a FastDiv as its mul,
    shift and d), so that a field added, removed or moved on one side only fails here."""
    import re

    from cuflash2.runtime import compiler

    source = (compiler.kernel_dir() / "wgmma" / "flash_fwd_sm90.cu").read_text()
    body = re.search(r"struct FwdParams \{(.*?)\n\};", source, re.S).group(1)
    declared = []
    for statement in re.sub(r"//[^\n]*", "", body).split(";"):
        words = statement.replace(",", " ").split()
        if not words:
            continue
        kind, names = words[0], [w.lstrip("*") for w in words[1:] if w != "*"]
        declared += [f"{n}.{part}" for n in names for part in ("mul", "shift", "d")] if kind == "FastDiv" else names
    assert tuple(declared) == wgmma_fwd.FIELD_NAMES


def _named(fields: tuple) -> dict:
    """The packed FwdParams fields by name (a FastDiv's three as (mul, shift, d) under its own name)."""
    named = dict(zip(wgmma_fwd.FIELD_NAMES, fields, strict=True))
    for name in [n.split(".")[0] for n in wgmma_fwd.FIELD_NAMES if n.endswith(".mul")]:
        named[name] = tuple(named[f"{name}.{part}"] for part in ("mul", "shift", "d"))
    return named


def _fast_divide(n: int, divisor: tuple[int, int, int]) -> int:
    """The kernel's FastDiv::div (common/fast_div.cuh) on 32-bit unsigned arithmetic, in Python."""
    mul, shift, _ = divisor
    return ((((n * mul) >> 32) + n) & 0xFFFFFFFF) >> shift


@pytest.mark.parametrize("divisor", [1, 2, 3, 5, 6, 7, 12, 31, 64, 100, 132, 641, 1000, 4097, 65535, 65536, 99991,
                                     2 ** 20 + 7, 2 ** 30, 2 ** 30 + 1, 2 ** 31 - 1])
def test_fast_divisor_divides_every_non_negative_int32_exactly(divisor):
    """FastDiv::div (common/fast_div.cuh), in Python: exact for 0 <= n < 2^31, at the multiples of
    the divisor and next to them, at the top of the range and at random."""
    constants = fast_div.fast_divisor(divisor)
    assert 0 <= constants[0] < 2 ** 32 and constants[2] == divisor
    fast_div.LAYOUT.pack(*constants)  # fits the kernel's struct
    rng = np.random.default_rng(divisor)
    near_multiples = [k * divisor + r for k in (0, 1, 2, 7, 1000, (2 ** 31 - 1) // divisor) for r in (-1, 0, 1)]
    for n in near_multiples + [2 ** 31 - 1, 2 ** 31 - 2] + rng.integers(0, 2 ** 31, 2000).tolist():
        if 0 <= n < 2 ** 31:
            assert _fast_divide(n, constants) == n // divisor, n


def test_fast_divisor_rejects_a_divisor_outside_int32():
    for bad in (0, -3, 2 ** 31):
        with pytest.raises(ValueError, match="divisor"):
            fast_div.fast_divisor(bad)


def _tile_at(t: int, fields: tuple, causal: bool) -> tuple:
    """The kernel's tile_at (flash_fwd_sm90.cu) on the packed FwdParams fields: (m_block, head, batch)."""
    f = _named(fields)
    m_blocks_div, heads_div, section_tiles_div, pairs_div, last_pairs_div = (
        f[name] for name in ("m_blocks", "heads", "section_tiles", "section_pairs", "last_pairs"))
    nheads, batch, m_blocks, section_pairs = heads_div[2], f["batch"], m_blocks_div[2], pairs_div[2]

    def divmod_fast(n, divisor):
        quotient = _fast_divide(n, divisor)
        return quotient, n - quotient * divisor[2]

    if not causal:
        pair, m_block = divmod_fast(t, m_blocks_div)
    else:
        section, r = divmod_fast(t, section_tiles_div)
        first_pair = section * section_pairs
        last = first_pair + section_pairs > nheads * batch
        rank, pair = divmod_fast(r, last_pairs_div if last else pairs_div)
        pair += first_pair
        m_block = m_blocks - 1 - rank
    batch_index, head = divmod_fast(pair, heads_div)
    return m_block, head, batch_index


@pytest.mark.parametrize("batch, heads, seqlen, causal", [(2, 4, 256, False), (3, 5, 1000, False), (1, 7, 4096, True),
                                                         (5, 1, 32768, True), (3, 3, 16384, True), (2, 16, 512, True)])
def test_the_tile_order_visits_every_tile_once_and_causal_sections_run_longest_first(monkeypatch, batch, heads,
                                                                                      seqlen, causal):
    """tile_at with the host's division constants: every (query block, head, batch) exactly once;
    causal, sections of whole (batch, head) pairs (the last one smaller where they do not divide)
    with the longest query blocks first inside each."""
    monkeypatch.setattr(tensor_maps, "encode_tiled", lambda *args, **kwargs: bytes(128))
    shape = AttentionShape(batch, seqlen, seqlen, heads, heads, 128, "bfloat16", 0.1)
    config = wgmma_fwd.forward_config(128, "bfloat16", causal, seqlen=seqlen)
    q = contiguous_info((batch, seqlen, heads, 128), "bfloat16", 2, "cuda:0", 1 << 20)
    lse = contiguous_info((batch, heads, seqlen), "float32", 4, "cuda:0", 1 << 20)
    tiles = wgmma_fwd.tile_count(shape, config)
    build = wgmma_fwd.struct_builder(q, q, q, q, lse, shape, config, wgmma_fwd.TailSplit(1))
    fields = wgmma_fwd.PARAMS.unpack(wgmma_fwd.PARAMS.pack(*build([1 << 20] * 5 + [0, 0, 0])))
    order = [_tile_at(t, fields, causal) for t in range(tiles)]
    m_blocks = -(-seqlen // config.block_m)
    assert sorted(order) == [(m, h, b) for m in range(m_blocks) for h in range(heads) for b in range(batch)]
    if causal:
        pairs = wgmma_fwd.section_pairs(shape)
        if seqlen == 32768:
            assert 1 < pairs < batch * heads and batch * heads % pairs  # a smaller last section is covered
        for start in range(0, tiles, pairs * m_blocks):
            section = order[start:start + pairs * m_blocks]
            assert len({(h, b) for _, h, b in section}) == min(pairs, batch * heads - start // m_blocks)
            assert [m for m, _, _ in section] == sorted((m for m, _, _ in section), reverse=True)


def _bshd(b=2, s=256, h=4, d=128, ptr=1 << 20, strides=None):
    info = contiguous_info((b, s, h, d), "bfloat16", 2, "cuda:0", ptr)
    return info if strides is None else TensorInfo(info.shape, strides, "bfloat16", "cuda:0", ptr, 2)


def _problem(d=128, dtype="bfloat16", causal=False, features=None):
    from cuflash2.problem.features import PLAIN

    return AttentionProblem(AttentionShape(2, 256, 256, 4, 4, d, dtype, 0.1), causal, features or PLAIN)


def _spans(cta: int, ctas: int, tiles: int, key_blocks: int, split) -> list:
    """The kernel's walk (span_at in flash_fwd_sm90.cu) of the CTA at place `cta` (TileWalk::place),
    written out: (tile, lo, hi) per span, in the order the CTA runs them."""
    spans, pos = [], 0
    while True:
        if pos < split.whole_rounds:
            tile = cta + pos * ctas
            span = (tile, 0, key_blocks)
        else:
            begin, end = cta * split.units // ctas, (cta + 1) * split.units // ctas
            t = (end - 1) // key_blocks - (pos - split.whole_rounds)
            if end <= begin or t < begin // key_blocks:
                return spans
            span = (split.whole_rounds * ctas + t, max(begin - t * key_blocks, 0), min(end - t * key_blocks, key_blocks))
        if span[0] >= tiles:
            return spans
        spans.append(span)
        pos += 1


@pytest.mark.parametrize("tiles, ctas, key_blocks", [(2048, 132, 13), (2048, 132, 2), (133, 132, 3), (263, 132, 7),
                                                     (500, 7, 5), (1000, 132, 100), (2816, 132, 16), (9, 4, 2)])
def test_a_split_tail_runs_every_key_block_once_and_cuts_a_tile_at_most_once(tiles, ctas, key_blocks):
    """Every (tile, key block) runs exactly once; a cut tile has two spans, the low key blocks first
    thing in CTA c's tail (handed over) and the high ones last in CTA c + 1's (taking over); the
    tail's work per CTA differs by at most one key block; whole tiles keep the static walk."""
    split = wgmma_fwd.split_tail(tiles, ctas, key_blocks, setting=True)
    assert split.units > 0 and split.whole_rounds == tiles // ctas - 1
    runs, spans_of_tile = {}, {}
    tail_work = []
    for cta in range(ctas):
        spans = _spans(cta, ctas, tiles, key_blocks, split)
        for i, (tile, lo, hi) in enumerate(spans):
            assert 0 <= lo < hi <= key_blocks
            spans_of_tile.setdefault(tile, []).append((cta, i, len(spans), lo, hi))
            for n in range(lo, hi):
                runs[tile, n] = runs.get((tile, n), 0) + 1
        assert [s[0] for s in spans[:split.whole_rounds]] == [cta + r * ctas for r in range(split.whole_rounds)]
        tail_work.append(sum(hi - lo for _, lo, hi in spans[split.whole_rounds:]))
    assert runs == {(t, n): 1 for t in range(tiles) for n in range(key_blocks)}
    assert max(tail_work) - min(tail_work) <= 1 and min(tail_work) >= key_blocks  # a tile or more each
    for tile, spans in spans_of_tile.items():
        assert len(spans) <= 2
        if len(spans) == 2:
            (c0, i0, _, lo0, hi0), (c1, i1, n1, lo1, hi1) = sorted(spans)
            assert c1 == c0 + 1 and lo0 == 0 and hi0 == lo1 and hi1 == key_blocks
            assert i0 == split.whole_rounds and i1 == n1 - 1  # the hand-over first, the take-over last


def test_the_tail_is_split_where_the_last_round_leaves_sms_idle():
    """split_tail: FA2's grid at head dim 128 (2048 tiles on 132 SMs, 15.5 rounds) splits; a whole
    number of rounds, a last round nearly full, fewer tiles than CTAs, single key blocks and walks
    past 32-bit unit arithmetic do not; the setting forces either way where a split is possible."""
    assert wgmma_fwd.split_tail(2048, 132, 13) == wgmma_fwd.TailSplit(14, (2048 - 14 * 132) * 13)
    assert wgmma_fwd.split_tail(2112, 132, 13) == wgmma_fwd.TailSplit(16)
    assert wgmma_fwd.split_tail(2110, 132, 13) == wgmma_fwd.TailSplit(16)  # 0.02 of a tile idle
    assert wgmma_fwd.split_tail(2110, 132, 13, setting=True).units > 0
    assert wgmma_fwd.split_tail(2048, 132, 13, setting=False) == wgmma_fwd.TailSplit(16)
    assert wgmma_fwd.split_tail(100, 132, 13, setting=True) == wgmma_fwd.TailSplit(1)
    assert wgmma_fwd.split_tail(2048, 132, 1, setting=True) == wgmma_fwd.TailSplit(16)
    assert wgmma_fwd.split_tail(2048, 132, 2 ** 24, setting=True) == wgmma_fwd.TailSplit(16)


@pytest.mark.parametrize("causal, seqlen, setting, split", [
    (False, 2048, "", True), (True, 2048, "", False), (False, 1024, "", False), (False, 1024, "1", True),
    (False, 2048, "0", False), (True, 2048, "1", False), (False, 128, "1", False)])
def test_a_split_launch_gets_scratch_for_the_rows_handed_over_and_zeroed_flags(monkeypatch, causal, seqlen, setting,
                                                                               split):
    """Long non-causal calls with a partly filled last round launch one CTA per SM with the split
    walk in the struct, a zeroed counter for the CTAs' places in the walk, fp32 scratch for one
    hand-over per CTA and consumer group and zeroed flags; short ones (staged output) only when the
    variable forces it; causal ones keep the tile counter and no split."""
    monkeypatch.setenv(wgmma_fwd.SPLIT_TAIL_VARIABLE, setting)
    monkeypatch.setenv(wgmma_fwd.KV_CLUSTERS_VARIABLE, "0")  # CTA pairs walk whole tiles
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 132)
    record = dict(scratch=[], launches=[])

    def fake_scratch(shape, dtype=None, zero=False):
        record["scratch"].append((tuple(shape), np.dtype(dtype or np.float32).name, zero))
        return None, contiguous_info(tuple(shape), "float32", 4, "cuda:0", (16 + len(record["scratch"])) << 24)

    monkeypatch.setattr(wgmma_fwd.launcher, "scratch", fake_scratch)
    monkeypatch.setattr(wgmma_fwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: record["launches"].append(
                            (config, tuple(grid), arguments.packer.unpack(arguments.packer.pack(*arguments.fields())))))
    monkeypatch.setattr(wgmma_fwd.tensor_maps, "encode_tiled", lambda *args, **kwargs: bytes(128))
    b, h, d = 16384 // seqlen, 16, 128
    problem = AttentionProblem(AttentionShape(b, seqlen, seqlen, h, h, d, "bfloat16", 0.1), causal)
    q, k, v, out = (contiguous_info((b, seqlen, h, d), "bfloat16", 2, "cuda:0", (1 + i) << 24) for i in range(4))
    lse = contiguous_info((b, h, seqlen), "float32", 4, "cuda:0", 9 << 24)
    wgmma_fwd.forward(problem, q, k, v, out, lse, 0, None)
    (config, grid, fields), = record["launches"]
    tiles = -(-seqlen // config.block_m) * h * b
    key_blocks = -(-seqlen // config.block_n)
    assert grid == (min(tiles, 132),)
    whole_rounds, units = _named(fields)["whole_rounds"], _named(fields)["split_units"]
    if split:
        assert record["scratch"] == [((1,), "int32", True),  # the places in the walk
                                     ((wgmma_fwd.partial_floats(config, 132),), "float32", False),
                                     ((132 * config.groups,), "int32", True)]
        assert config.groups == 2 and wgmma_fwd.partial_floats(config, 132) == 132 * 2 * 128 * (64 + 4)
        assert (whole_rounds, units) == (tiles // 132 - 1, (tiles - (tiles // 132 - 1) * 132) * key_blocks)
        assert all(_named(fields)[n] for n in ("tile_counter", "partials", "partial_ready"))  # their addresses
    else:
        assert units == 0 and not _named(fields)["partials"] and not _named(fields)["partial_ready"]
        assert record["scratch"] == ([((1,), "int32", True)] if causal else [])


@pytest.mark.parametrize("d, causal, seqlen_q, setting, pairs", [
    (128, False, 2048, "", True), (128, False, 4096, "", True), (128, False, 2100, "", False),
    (128, True, 2048, "", False), (128, False, 2048, "0", False), (128, False, 16384, "", False),
    (64, False, 2304, "", False), (64, False, 2304, "1", True), (64, False, 2048, "1", False),
    (256, False, 1024, "1", True), (128, True, 2048, "1", False)])
def test_calls_run_in_cta_pairs_where_measured_faster_or_forced(monkeypatch, d, causal, seqlen_q, setting, pairs):
    """Head dim 128 non-causal calls with 160-key blocks run in CTA pairs sharing K and V, when the
    query blocks of a head pair up; KV_CLUSTERS_VARIABLE forces pairs wherever possible or none.
    A paired launch has an even grid, whole tiles (no split tail) and K/V boxes of half a block."""
    monkeypatch.setenv(wgmma_fwd.KV_CLUSTERS_VARIABLE, setting)
    monkeypatch.setenv(wgmma_fwd.SPLIT_TAIL_VARIABLE, "")
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 133)
    monkeypatch.setattr(wgmma_fwd.launcher, "max_active_clusters", lambda config, device_id, ctas: 66)
    launches, boxes = [], []
    monkeypatch.setattr(wgmma_fwd.launcher, "scratch", lambda shape, dtype=None, zero=False: (None, contiguous_info(
        tuple(shape), "float32", 4, "cuda:0", 1 << 30)))
    monkeypatch.setattr(wgmma_fwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: launches.append(
                            (config, tuple(grid), arguments.packer.unpack(arguments.packer.pack(*arguments.fields())))))
    monkeypatch.setattr(wgmma_fwd.tensor_maps, "encode_tiled",
                        lambda dtype, address, sizes, strides, box: boxes.append(box) or bytes(128))
    b, h = max(1, 16384 // seqlen_q), 16
    problem = AttentionProblem(AttentionShape(b, seqlen_q, 2048, h, h, d, "bfloat16", 0.1), causal)
    q, out = (contiguous_info((b, seqlen_q, h, d), "bfloat16", 2, "cuda:0", (1 + i) << 24) for i in range(2))
    k, v = (contiguous_info((b, 2048, h, d), "bfloat16", 2, "cuda:0", (3 + i) << 24) for i in range(2))
    lse = contiguous_info((b, h, seqlen_q), "float32", 4, "cuda:0", 9 << 24)
    wgmma_fwd.forward(problem, q, k, v, out, lse, 0, None)
    (config, grid, fields), = launches
    assert config.cluster_kv == pairs
    if pairs:
        tiles = -(-seqlen_q // config.block_m) * h * b
        assert grid == (min(tiles, 132),) and _named(fields)["split_units"] == 0
        assert [box[1] for box in boxes[1:3]] == [config.block_n // 2] * 2  # K and V: half a block each
        assert "-DCF_CLUSTER_KV" in config.compile_options() and config in wgmma_fwd.all_configs()
    else:
        assert [box[1] for box in boxes[1:3]] == [config.block_n] * 2


@pytest.mark.parametrize("resident_pairs, grid, paired", [(66, 132, True), (60, 120, True), (0, 132, False)])
def test_a_paired_grid_is_the_pairs_the_device_holds_at_once(monkeypatch, resident_pairs, grid, paired):
    """A persistent walk of pairs launches no more pairs than the device runs at once (how SMs fall
    into GPCs decides, cuOccupancyMaxActiveClusters), else a pair would wait for a second wave;
    where no pair fits, the call runs unpaired."""
    monkeypatch.setenv(wgmma_fwd.KV_CLUSTERS_VARIABLE, "")
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(wgmma_fwd.launcher, "max_active_clusters", lambda config, device_id, ctas: resident_pairs)
    monkeypatch.setattr(wgmma_fwd.launcher, "scratch", lambda shape, dtype=None, zero=False: (None, contiguous_info(
        tuple(shape), "float32", 4, "cuda:0", 1 << 30)))
    launches = []
    monkeypatch.setattr(wgmma_fwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: launches.append((config, tuple(grid))))
    monkeypatch.setattr(wgmma_fwd.tensor_maps, "encode_tiled", lambda *args, **kwargs: bytes(128))
    problem = AttentionProblem(AttentionShape(8, 2048, 2048, 16, 16, 128, "bfloat16", 0.1), False)
    q, k, v, out = (contiguous_info((8, 2048, 16, 128), "bfloat16", 2, "cuda:0", (1 + i) << 24) for i in range(4))
    lse = contiguous_info((8, 16, 2048), "float32", 4, "cuda:0", 9 << 24)
    wgmma_fwd.forward(problem, q, k, v, out, lse, 0, None)
    assert [(config.cluster_kv, g) for config, g in launches] == [(paired, (grid,))]


def test_cta_pairs_refuse_calls_they_cannot_run():
    """Pairs need a non-causal call with a positive, even number of query blocks per head and an
    output not staged over the V stages they share; a paired launch has an even grid."""
    config = dataclasses.replace(wgmma_fwd.forward_config(128, "bfloat16", False, seqlen=2048), cluster_kv=True)
    for causal, seqlen_q in ((True, 2048), (False, 2100)):
        problem = AttentionProblem(AttentionShape(2, seqlen_q, 2048, 16, 16, 128, "bfloat16", 0.1), causal)
        with pytest.raises(ValueError, match=f"causal={causal}, seqlen_q={seqlen_q}"):
            wgmma_fwd.launch_plan(problem, config, 132)
    problem = AttentionProblem(AttentionShape(8, 2048, 2048, 16, 16, 128, "bfloat16", 0.1), False)
    assert wgmma_fwd.launch_plan(problem, config, 133) == (132, wgmma_fwd.TailSplit(16))  # 2048 tiles, whole
    assert not wgmma_fwd.pairs_possible(config, False, 0)
    over_v = wgmma_fwd.forward_config(256, "bfloat16", False, seqlen=512)
    assert over_v.output_over_v and not wgmma_fwd.pairs_possible(over_v, False, 512)
    short_256 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 256, "bfloat16", 0.1), False)
    assert not wgmma_fwd.paired(over_v, short_256).cluster_kv


def test_unsupported_reasons_name_what_is_missing():
    from cuflash2.problem.features import Features

    q = _bshd()
    ok = [("q", q), ("k", q), ("v", q), ("out", q)]
    reason = wgmma_fwd.unsupported_reason
    assert reason(90, _problem(), ok) == "" and reason(90, _problem(causal=True), ok) == ""
    assert "9.0" in reason(80, _problem(), ok)
    assert "9.0" in reason(100, _problem(), ok)
    assert "float16 or bfloat16" in reason(90, _problem(dtype="float32"), ok)
    assert "multiple of 8" in reason(90, _problem(d=100), ok)
    assert "multiple of 8" in reason(90, _problem(d=264), ok)
    assert "plain and causal" in reason(90, _problem(features=Features(window_left=16, window_right=0)), ok)
    assert "plain and causal" in reason(90, _problem(features=Features(softcap=30.0)), ok)
    misaligned = ("k", _bshd(ptr=(1 << 20) + 8))
    assert "k with a 16-byte aligned base" in reason(90, _problem(), [misaligned])
    padded = ("v", _bshd(d=128, strides=(256 * 4 * 136, 4 * 136, 136, 1)))  # rows of 272 bytes: fine
    assert reason(90, _problem(), [padded]) == ""
    odd_rows = ("v", _bshd(d=128, strides=(256 * 4 * 130, 4 * 130, 130, 1)))  # 260 bytes: not a multiple of 16
    assert "v with" in reason(90, _problem(), [odd_rows])
    not_last = ("q", _bshd(strides=(256 * 4 * 128, 4 * 128, 128, 2)))
    assert "q with" in reason(90, _problem(), [not_last])


def test_the_family_runs_the_sm90_dense_forward_and_leaves_the_rest(monkeypatch):
    from cuflash2 import families
    from cuflash2.problem.features import Features

    q = _bshd()
    tensors = [("q", q), ("k", q), ("v", q), ("out", q)]
    assert families.family_for(90, _problem(), "forward", tensors).name == "wgmma"
    assert families.family_for(90, _problem(causal=True), "forward").name == "wgmma"
    assert families.family_for(80, _problem(), "forward", tensors).name == "mma_sync"
    grads = tensors + [("dout", q), ("dq", q), ("dk", q), ("dv", q)]
    assert families.family_for(90, _problem(), "backward", grads).name == "wgmma"  # head dim 128
    assert families.family_for(90, _problem(), "backward", grads, deterministic=True).name == "wgmma"
    assert families.family_for(90, _problem(d=64), "backward", grads).name == "wgmma"
    assert families.family_for(90, _problem(d=96), "backward", grads).name == "wgmma"  # on the d128 kernel
    assert families.family_for(90, _problem(d=192), "backward", grads).name == "wgmma"  # on the d256 kernel
    assert families.family_for(90, _problem(d=160), "backward", grads).name == "mma_sync"
    assert families.family_for(90, _problem(), "backward", misaligned_grads := [("dout", _bshd(ptr=(1 << 20) + 2))]
                               ).name == "mma_sync"
    assert misaligned_grads
    assert families.family_for(90, _problem(), "kvcache").name == "mma_sync"
    assert families.family_for(90, _problem(d=59), "forward").name == "mma_sync"
    window = _problem(features=Features(window_left=8, window_right=8))
    assert families.family_for(90, window, "forward", tensors).name == "mma_sync"
    misaligned = [("q", _bshd(ptr=(1 << 20) + 2))]
    assert families.family_for(90, _problem(), "forward", misaligned).name == "mma_sync"


def test_the_variable_forces_mma_sync_on_hopper(monkeypatch):
    from cuflash2 import families

    monkeypatch.setenv(families.FAMILY_VARIABLE, "mma_sync")
    assert families.family_for(90, _problem(), "forward").name == "mma_sync"
    monkeypatch.setenv(families.FAMILY_VARIABLE, "wgmma")
    assert families.family_for(90, _problem(), "forward").name == "wgmma"
    assert families.family_for(80, _problem(), "forward").name == "mma_sync"  # wgmma cannot run it


def test_single_entry_dims_may_have_any_stride():
    assert tensor_maps.strides_fit(1 << 20, [256, 3, 7], [16, 1, 1])
    assert not tensor_maps.strides_fit(1 << 20, [256, 3, 7], [16, 2, 1])


def test_tensor_map_arguments_are_checked_before_the_driver():
    with pytest.raises(ValueError, match="16-byte aligned"):
        tensor_maps.encode_tiled("bfloat16", 8, (128, 64, 1, 1), (256, 16, 16), (64, 64, 1, 1))
    with pytest.raises(ValueError, match="box sides"):
        tensor_maps.encode_tiled("bfloat16", 1 << 20, (128, 512, 1, 1), (256, 16, 16), (64, 512, 1, 1))
    with pytest.raises(ValueError, match="3 strides"):
        tensor_maps.encode_tiled("bfloat16", 1 << 20, (128, 512, 1, 1), (256, 16), (64, 64, 1, 1))


def test_slowdown_warnings_are_recognised():
    log = ("ptxas warning : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine "
           "register count at entry\nptxas info    : (C7519) warpgroup.arrive is injected in around line 10\n"
           "ptxas info    : Used 168 registers")
    assert len(compiler.slowdown_warnings(log).splitlines()) == 2
    assert compiler.slowdown_warnings("ptxas info    : Used 168 registers, used 3 barriers") == ""


@pytest.mark.compile
def test_the_gate_catches_an_ignored_setmaxnreg():
    """A kernel without a register cap at entry gets its setmaxnreg ignored: ptxas says so, and the
    compile check must see it (so a real kernel that regresses this way fails CI)."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    source = ('extern "C" __global__ void k(float* x) {\n'
              '  if (threadIdx.x < 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\\n");\n'
              '  else asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\\n");\n  x[threadIdx.x] = 1.f;\n}\n')
    program = nvrtc.createProgram(source, "gate.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-arch=sm_90a", "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    assert "setmaxnreg" in compiler.slowdown_warnings(log)


@pytest.mark.compile
@pytest.mark.parametrize("config", wgmma_fwd.all_configs() + wgmma_bwd.all_configs(), ids=lambda c: c.short_id())
def test_every_instantiation_compiles_clean_for_sm90a(config):
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    report = compiler.compile_offline(config, "sm_90")
    assert not report.error, f"{config.template_name()} failed to compile:\n{report.error}"
    assert report.registers > 0, f"no ptxas resource report for {report.line()}"
    # setmaxnreg.inc takes registers from the block's own pool: the kernel must start with its full
    # share (the static_assert in FwdTile budgets against it), or the consumers wait forever.
    if config.smem_bytes:  # the warp-specialised kernels (not the backward's row preprocessing)
        assert report.registers == 65536 // config.threads // 8 * 8, report.line()
    assert not report.slowdown_warnings, f"{report.line()}\n{report.slowdown_warnings}"
    assert report.stack_frame_bytes == 0 and report.spill_store_bytes == 0 and report.spill_load_bytes == 0, \
        report.line()
    assert report.ok


@pytest.mark.compile
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_backward_computes_store_addresses_per_row_not_per_column(d):
    """The dK/dV stores test each column pair against the call's head dim; computed under those
    tests, a row's address (a division by kv_group and 64-bit products) is repeated for every pair,
    which cost the short calls 7-15%. Integer divisions in the PTX of a whole backward kernel stay
    a handful (the store loop computing addresses per column had one per column pair: 33, 65 and
    129). The GQA kernels store into a per-query-head accumulator, whose row address has no
    division to repeat: they are not the case this catches."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    config = wgmma_bwd.WgmmaBwdConfig(d, True, "bfloat16", False)
    ptx = compiler.compile_ptx(config, "sm_90a")
    assert ".entry" in ptx and "wgmma.mma_async" in ptx
    divisions = re.findall(r"^\s*(?:div|rem)\.[su](?:32|64)\b", ptx, re.MULTILINE)
    assert len(divisions) <= 8, f"{config.short_id()}: {len(divisions)} integer divisions in its PTX"


def test_compile_ptx_reports_nvrtc_errors(monkeypatch):
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    monkeypatch.setattr(compiler, "kernel_source", lambda name: "this is not C++;")
    with pytest.raises(RuntimeError, match="does not compile for sm_90a"):
        compiler.compile_ptx(wgmma_bwd.WgmmaBwdConfig(64, True, "bfloat16", False), "sm_90a")


@pytest.mark.compile
def test_the_hang_check_build_compiles():
    """The debug builds (bounded mbarrier waits) of the forward and the backward compile; their poll
    counters cost registers, so they may run their wgmmas serialised: they are for correctness runs,
    not timings."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    for config in (wgmma_fwd.forward_config(128, "bfloat16", True, hang_check=True),
                   wgmma_bwd.WgmmaBwdConfig(64, True, "bfloat16", False, hang_check=True)):
        report = compiler.compile_offline(config, "sm_90")
        assert not report.error, report.error
        assert report.registers > 0


def _stub_replayed_launches(monkeypatch) -> tuple[list, list]:
    """A recorded wgmma forward replayed without a GPU: the kernel lookup, struct launches and
    memsets stubbed on 132 SMs. Returns the lists that collect (grid, threads, smem, stream, fields)
    per launch and (address, bytes) per memset."""
    import types

    from cuflash2.core import replay
    from cuflash2.runtime import launcher

    monkeypatch.setattr(replay, "get_kernel", lambda config, device_id: types.SimpleNamespace(
        kernel=types.SimpleNamespace(ptr=1)))
    monkeypatch.setattr(wgmma_fwd, "sm_count", lambda device_id: 132)
    sent, memsets = [], []
    monkeypatch.setattr(launcher, "launch_struct", lambda function, grid, threads, smem, stream, packer, fields:
                        sent.append((grid, threads, smem, stream, fields)))
    monkeypatch.setattr(launcher, "memset_async", lambda address, nbytes, stream: memsets.append((address, nbytes)))
    return sent, memsets


def test_a_replay_rebuilds_the_parameter_struct_for_new_addresses(monkeypatch):
    """The tensor maps hold their tensors' addresses: a recorded wgmma forward keeps how to build
    its parameter struct, and a replay builds it for the addresses of that call (scratch included)."""
    import numpy as np

    from cuflash2.core import replay

    def fake_map(dtype, data_ptr, sizes, strides_bytes, box, swizzle=3):
        return data_ptr.to_bytes(8, "little") + bytes(120)

    monkeypatch.setattr(tensor_maps, "encode_tiled", fake_map)
    sent, memsets = _stub_replayed_launches(monkeypatch)
    problem = _problem(causal=True)
    tensors = [contiguous_info((2, 256, 4, 128), "bfloat16", 2, "cuda:0") for _ in range(4)]
    tensors.append(contiguous_info((2, 4, 256), "float32", 4, "cuda:0"))
    recording = replay.record(lambda q, k, v, o, l: wgmma_fwd.forward(problem, q, k, v, o, l, 0, None), tensors, 0)
    assert recording is not None and len(recording.launches) == 1 and recording.regions == [(4, True)]
    addresses = [(i + 1) << 32 for i in range(5)]
    recording.run(addresses, 77, scratch_base=0xABC000)
    (grid, threads, smem, stream, fields), = sent
    config = wgmma_fwd.forward_config(128, "bfloat16", True, seqlen=256)
    assert grid == (16, 1, 1) and threads == config.threads and smem == config.smem_bytes and stream == 77
    maps = [int.from_bytes(m[:8], "little") for m in fields[:4]]  # q, k, v and the output's store map
    assert maps == addresses[:4] and list(fields[4:9]) == [addresses[3], addresses[4], 0xABC000, 0, 0]
    assert memsets == [(0xABC000, 4)]  # the tile counter starts at zero on every replay
    assert wgmma_fwd.PARAMS.pack(*fields)  # the fields fit the kernel's layout
    assert _named(fields)["head_dim"] == 128
    built = []
    monkeypatch.setattr(tensor_maps, "encode_tiled", lambda *args, **kwargs: built.append(args) or fake_map(*args))
    recording.run(addresses, 77, scratch_base=0xABC000)  # the same addresses: the same struct, not rebuilt
    assert not built and sent[1][4] == fields
    moved = [a + 256 for a in addresses]
    recording.run(moved, 77, scratch_base=0xABC000)
    assert len(built) == 4 and [int.from_bytes(m[:8], "little") for m in sent[2][4][:4]] == moved[:4]


def test_a_replayed_split_tail_starts_from_zeroed_places_and_flags(monkeypatch):
    """A split tail's CTAs take their places from a counter and wait on flags raised by the CTA
    before them: a replay must clear both before every launch (a counter left at the last call's
    count would place every CTA past the walk, and a stale flag would let a CTA read rows not yet
    handed over), while the partial rows need no clearing."""
    from cuflash2.core import replay

    monkeypatch.setenv(wgmma_fwd.SPLIT_TAIL_VARIABLE, "")
    monkeypatch.setenv(wgmma_fwd.KV_CLUSTERS_VARIABLE, "0")  # CTA pairs walk whole tiles
    monkeypatch.setattr(tensor_maps, "encode_tiled", lambda *args, **kwargs: bytes(128))
    sent, memsets = _stub_replayed_launches(monkeypatch)
    b, s, h, d = 8, 2048, 16, 128  # 2048 tiles on 132 SMs: 15.5 rounds, the tail split
    problem = AttentionProblem(AttentionShape(b, s, s, h, h, d, "bfloat16", 0.1), False)
    tensors = [contiguous_info((b, s, h, d), "bfloat16", 2, "cuda:0") for _ in range(4)]
    tensors.append(contiguous_info((b, h, s), "float32", 4, "cuda:0"))
    recording = replay.record(lambda q, k, v, o, l: wgmma_fwd.forward(problem, q, k, v, o, l, 0, None), tensors, 0)
    config = wgmma_fwd.forward_config(d, "bfloat16", False, seqlen=s)
    partial_bytes = wgmma_fwd.partial_floats(config, 132) * 4
    assert recording.regions == [(4, True), (partial_bytes, False), (132 * config.groups * 4, True)]
    addresses = [(i + 1) << 32 for i in range(5)]
    for _ in range(2):
        recording.run(addresses, 77, scratch_base=0xABC000)
    offsets = recording.offsets
    cleared = [(0xABC000 + offsets[0], 4), (0xABC000 + offsets[2], 132 * config.groups * 4)]
    assert sorted(memsets) == sorted(cleared * 2)  # before each of the two launches
    fields = sent[-1][4]
    counter, partials, flags = fields[6:9]
    assert (counter, partials, flags) == tuple(0xABC000 + o for o in offsets)
    assert _named(fields)["split_units"] > 0  # the tail is split


def test_replays_are_dropped_when_the_family_variable_changes(monkeypatch):
    """A replay holds the kernels chosen when it was recorded: setting CUFLASH2_FAMILY to compare
    the families must not replay the other family's launches."""
    from cuflash2.core import replay
    from cuflash2.families import FAMILY_VARIABLE

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    cache = replay.ReplayCache()
    cache.keep("call", "a replay")
    assert cache.lookup("call") == "a replay" and "call" in cache
    monkeypatch.setenv(FAMILY_VARIABLE, "mma_sync")
    assert cache.lookup("call") is None and "call" not in cache
    cache.keep("call", "another")
    monkeypatch.setenv(wgmma_fwd.HANG_CHECK_VARIABLE, "1")
    assert "call" not in cache


def test_scratch_of_a_captured_call_lives_on(monkeypatch):
    """A CUDA graph replays into the scratch addresses it captured: scratch taken while the stream
    captures is kept (the tile counter of a causal Hopper forward, the backward's accumulators)."""
    import types

    import numpy as np

    from cuflash2.runtime import launcher

    capturing = [False]
    stream = types.SimpleNamespace(is_capturing=lambda: capturing[0])
    fake_cupy = types.SimpleNamespace(
        zeros=lambda shape, dtype: types.SimpleNamespace(strides=(4,), data=types.SimpleNamespace(ptr=1 << 20)),
        empty=lambda shape, dtype: types.SimpleNamespace(strides=(4,), data=types.SimpleNamespace(ptr=1 << 21)),
        cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setattr(launcher, "import_cupy", lambda: fake_cupy)
    monkeypatch.setattr(launcher, "_captured_scratch", [])
    array, info = launcher.scratch((1,), np.int32, zero=True)
    assert info.data_ptr == 1 << 20 and launcher._captured_scratch == []
    capturing[0] = True
    array, info = launcher.scratch((1,), np.int32, zero=True)
    assert launcher._captured_scratch == [array]


def test_backward_params_struct_is_the_kernels_size():
    source = (compiler.kernel_dir() / wgmma_bwd.SOURCE).read_text()
    size = int(re.search(r"sizeof\(BwdParams\) == (\d+)", source).group(1))  # the kernel's static_assert
    assert wgmma_bwd.PARAMS.size == size == 960


def test_the_backward_runs_head_dims_32_to_128_and_leaves_the_rest(monkeypatch):
    from cuflash2.problem.features import Features


    q = _bshd()
    grads = [("dout", q), ("q", q), ("k", q), ("v", q), ("out", q), ("dq", q), ("dk", q), ("dv", q)]
    assert wgmma_bwd.unsupported_reason(90, _problem(causal=True), False, grads) == ""
    assert wgmma_bwd.unsupported_reason(90, _problem(), True, grads) == ""  # deterministic: ordered dQ adds
    assert wgmma_bwd.unsupported_reason(90, _problem(d=64), False, grads) == ""
    for d in (32, 40, 96, 104):  # on the kernel of the next head dim up, its columns past d as zeros
        assert wgmma_bwd.unsupported_reason(90, _problem(d=d), False, grads) == ""
    for d in (192, 200, 248, 256):  # on the d256 kernel
        assert wgmma_bwd.unsupported_reason(90, _problem(d=d), False, grads) == ""
    for d in (24, 100, 136, 184, 264):
        assert f"multiples of 8 in 32-128 and 192-256, got {d}" in wgmma_bwd.unsupported_reason(
            90, _problem(d=d), False, grads)
    assert [wgmma_bwd.kernel_head_dim(d) for d in (32, 64, 72, 128, 192, 256)] == [64, 64, 128, 128, 256, 256]
    assert "compute capability 9.0" in wgmma_bwd.unsupported_reason(80, _problem(), False, grads)
    assert "plain and causal" in wgmma_bwd.unsupported_reason(90, _problem(features=Features(softcap=5.0)), False,
                                                              grads)
    odd = [("dk", _bshd(strides=(256 * 4 * 129, 4 * 129, 129, 1)))]
    assert "4-byte aligned" in wgmma_bwd.unsupported_reason(90, _problem(), False, odd)
    narrow_dq = [("dq", _bshd(ptr=(1 << 20) + 2))]  # the conversion stores 4-byte pairs
    assert "dq" in wgmma_bwd.unsupported_reason(90, _problem(), False, narrow_dq)
    # With GQA dk and dv come from the conversion too: 4-byte aligned pairs are not enough there.
    padded_rows = [("dk", _bshd(strides=(256 * 4 * 130, 4 * 130, 130, 1)))]
    assert wgmma_bwd.unsupported_reason(90, _problem(), False, padded_rows) == ""
    gqa = AttentionProblem(AttentionShape(2, 256, 256, 4, 2, 128, "bfloat16", 0.1), False)
    assert "dk" in wgmma_bwd.unsupported_reason(90, gqa, False, padded_rows)


def _record_backward(monkeypatch, problem, deterministic=False, **outputs):
    """Runs the Hopper backward's host side with the launcher, tensor maps and conversions faked:
    returns the tensors passed and what was asked of those (scratch, launches, maps, conversions).
    `outputs` may replace dk or dv (TensorInfos)."""
    s = problem.shape
    b, sq, sk, h, hk, d = s.batch, s.seqlen_q, s.seqlen_k, s.nheads, s.nheads_kv, s.head_dim
    q, dout, out, dq = (contiguous_info((b, sq, h, d), "bfloat16", 2, "cuda:0", (1 + i) << 24) for i in range(4))
    k, v, dk, dv = (contiguous_info((b, sk, hk, d), "bfloat16", 2, "cuda:0", (5 + i) << 24) for i in range(4))
    lse = contiguous_info((b, h, sq), "float32", 4, "cuda:0", 9 << 24)
    dk, dv = outputs.get("dk", dk), outputs.get("dv", dv)
    record = dict(scratch=[], launches=[], maps=[], converts=[], tensors=dict(q=q, k=k, v=v, dout=dout, dk=dk, dv=dv))

    def fake_scratch(shape, dtype=None, zero=False):
        record["scratch"].append((tuple(shape), np.dtype(dtype or np.float32).name, zero))
        return None, contiguous_info(tuple(shape), "float32", 4, "cuda:0", (16 + len(record["scratch"])) << 24)

    monkeypatch.setattr(wgmma_bwd.launcher, "scratch", fake_scratch)
    monkeypatch.setattr(wgmma_bwd.launcher, "launch_kernel", lambda config, device_id, stream, grid, args:
                        record["launches"].append((config, tuple(grid))))
    monkeypatch.setattr(wgmma_bwd.launcher, "launch_struct_kernel",
                        lambda config, device_id, stream, grid, arguments: record["launches"].append(
                            (config, tuple(grid), arguments.packer.pack(*arguments.fields()))))
    monkeypatch.setattr(wgmma_bwd.tensor_maps, "encode_tiled",
                        lambda dtype, ptr, sizes, strides, box: record["maps"].append((ptr, tuple(sizes), tuple(box)))
                        or bytes(128))
    monkeypatch.setattr(wgmma_bwd, "convert_accumulator", lambda *args, **kwargs: record["converts"].append(args))
    wgmma_bwd.backward(problem, dout, q, k, v, out, lse, dq, dk, dv, 0, None, deterministic)
    return record


@pytest.mark.parametrize("d, gqa", [(64, False), (128, False), (128, True), (96, False), (40, True), (256, False),
                                    (256, True), (192, False)])
def test_the_backward_launches_its_passes_with_the_tiles_of_its_head_dim(monkeypatch, d, gqa):
    """Without a GPU: the launches the Hopper backward queues (pre-pass, main kernel, dQ conversion,
    and with GQA the dK/dV sums), their grids, the scratch they get, the tensor maps' boxes and the
    parameter struct they pack, for seqlens that are not multiples of the tiles."""
    b, sq, sk, h, hk = 2, 300, 200, 4, 2 if gqa else 4
    kd = 64 if d <= 64 else 128 if d <= 128 else 256  # the kernel's head dim
    block_m, block_n = {64: (128, 128), 128: (64, 128), 256: (64, 64)}[kd]  # BwdTile<kd>::kBlockM, kBlockN
    m_blocks, n_blocks = -(-sq // block_m), -(-sk // block_n)
    monkeypatch.setattr(wgmma_bwd, "sm_count", lambda device_id: 132)
    record = _record_backward(monkeypatch, AttentionProblem(AttentionShape(b, sq, sk, h, hk, d, "bfloat16", 0.1), True))
    scratch, maps, t = record["scratch"], record["maps"], record["tensors"]

    (rows, rows_grid), (main, main_grid, packed), (dq_pass, dq_grid) = record["launches"]
    assert (rows.kernel, rows_grid) == ("rows", (-(-m_blocks * block_m // 32), h, b))
    # A causal call of 300 rows, too short for the persistent grid (PERSISTENT_ABOVE): a CTA per tile.
    persistent = False
    assert (main.head_dim, main.causal, main.gqa, main.deterministic, main.persistent) == (kd, True, gqa, False,
                                                                                           persistent)
    units_per_head = -(-n_blocks // 2)  # key blocks j and n_blocks - 1 - j
    assert main_grid == ((units_per_head * h * b, 1, 1) if persistent else (n_blocks, h, b))
    assert (rows.head_dim, dq_pass.kernel, dq_pass.head_dim, dq_grid) == (kd, "dq", kd, (m_blocks, h, b))
    assert scratch[:2] == [((b, h, m_blocks * block_m), "float32", False)] * 2  # LSE_log2, D
    assert scratch[2] == ((b, h, m_blocks, block_m * kd), "float32", True)  # the dQ accumulator, zeroed
    assert len(scratch) == (5 if gqa else 3)  # + dK, dV per query head with GQA; no turn counters
    assert len(record["converts"]) == (2 if gqa else 0)
    # Q and dO in boxes of the query block, K and V of the CTA's keys; dims innermost first. Then the
    # maps of what the kernel stores by TMA in boxes of 64 keys: dk and dv, or with GQA its fp32 sums
    # per query head (32 columns a box).
    assert maps[:4] == [(t["q"].data_ptr, (d, sq, h, b), (64, block_m, 1, 1)),
                        (t["k"].data_ptr, (d, sk, hk, b), (64, block_n, 1, 1)),
                        (t["v"].data_ptr, (d, sk, hk, b), (64, block_n, 1, 1)),
                        (t["dout"].data_ptr, (d, sq, h, b), (64, block_m, 1, 1))]
    # ..., turns pointer, dk, dv, 6 i64, 6 ints, 2 floats, head dim, the persistent walk's units, the
    # dK/dV store flag
    fields = wgmma_bwd.PARAMS.unpack(packed)
    box = (32, 64, 1, 1) if gqa else (64, 64, 1, 1)
    assert maps[4:] == [(fields[10], (d, sk, h, b), box), (fields[11], (d, sk, h, b), box)]
    assert gqa or fields[10:12] == (t["dk"].data_ptr, t["dv"].data_ptr)
    assert fields[-21] == 0  # no turn counters
    assert fields[-12:-6] == (sq, sk, h, h // hk, m_blocks, 0)
    assert fields[-5] == pytest.approx(0.1) and fields[-6] == pytest.approx(0.1 * 1.4426950408889634)
    assert fields[-4] == d  # the call's head dim: the kernel stores its columns, loads the rest as zeros
    assert fields[-3:] == (units_per_head, units_per_head * h * b, 1)


@pytest.mark.parametrize("name", ["dk", "dv"])
@pytest.mark.parametrize("offset, row_stride", [(4, None), (0, 4 * 128 + 2)])
def test_key_gradients_that_no_map_describes_are_stored_from_registers(monkeypatch, name, offset, row_stride):
    """dK or dV at an address or with strides a TMA map cannot take (a base not 16-byte aligned,
    a row stride that is not a multiple of 8 elements) make the kernel store both from registers
    (the flag off, no dK/dV maps)."""
    b, s, h, d = 2, 300, 4, 128
    odd = contiguous_info((b, s, h, d), "bfloat16", 2, "cuda:0", (12 << 24) + offset)
    if row_stride is not None:
        odd = dataclasses.replace(odd, strides=(s * row_stride, row_stride, d, 1))
    fine = contiguous_info((b, s, h, d), "bfloat16", 2, "cuda:0", 13 << 24)
    assert wgmma_bwd.stores_key_gradients_by_tma(fine, fine)
    assert not wgmma_bwd.stores_key_gradients_by_tma(*((odd, fine) if name == "dk" else (fine, odd)))
    monkeypatch.setattr(wgmma_bwd, "sm_count", lambda device_id: 132)
    problem = AttentionProblem(AttentionShape(b, s, s, h, h, d, "bfloat16", 0.1), True)
    record = _record_backward(monkeypatch, problem, **{name: odd})
    fields = wgmma_bwd.PARAMS.unpack(record["launches"][1][2])
    assert fields[4] == fields[5] == bytes(128) and fields[-1] == 0  # no dK/dV maps, the flag off
    assert [ptr for ptr, _, _ in record["maps"]] == [record["tensors"][n].data_ptr for n in ("q", "k", "v", "dout")]
    assert fields[10:12] == (record["tensors"]["dk"].data_ptr, record["tensors"]["dv"].data_ptr)
    first = 12 if name == "dk" else 15  # the output's batch, row and head strides (elements)
    assert fields[first:first + 3] == tuple(odd.strides[:3])


@pytest.mark.parametrize("d, causal, seqlen, persistent", [
    (128, False, 512, False), (128, False, 2048, False), (128, False, 4096, False),
    (128, True, 512, False), (128, True, 513, True), (128, True, 2048, True), (128, True, 8192, True),
    (128, True, 20000, True), (64, True, 1024, False), (64, False, 512, False), (256, True, 512, False),
    (192, True, 2048, False), (96, True, 1000, True), (96, False, 1000, False), (96, True, 300, False)])
def test_causal_backward_calls_above_512_run_a_persistent_grid(monkeypatch, d, causal, seqlen, persistent):
    """Causal calls longer than PERSISTENT_ABOVE's 512 (the longer length) at kernel head dim 128
    launch one CTA per SM, at most one per unit of two key blocks; non-causal and shorter calls, head
    dims 64 and 256 one CTA per (key block, head, batch) tile."""
    monkeypatch.setattr(wgmma_bwd, "sm_count", lambda device_id: 132)
    b, h = 3, 4
    for sq, sk in ((seqlen, seqlen // 2), (seqlen // 3, seqlen)):
        problem = AttentionProblem(AttentionShape(b, sq, sk, h, h, d, "bfloat16", 0.1), causal)
        (_, (main, main_grid, packed), _) = _record_backward(monkeypatch, problem)["launches"]
        n_blocks = -(-sk // (64 if d > 128 else 128))
        units = -(-n_blocks // 2) * h * b
        assert main.persistent == persistent
        assert main_grid == ((min(units, 132), 1, 1) if persistent else (n_blocks, h, b))
        assert wgmma_bwd.PARAMS.unpack(packed)[-2] == units
    monkeypatch.setattr(wgmma_bwd, "sm_count", lambda device_id: 10)  # fewer SMs than units: one CTA per SM
    problem = AttentionProblem(AttentionShape(b, 700, 700, h, h, 128, "bfloat16", 0.1), True)
    assert _record_backward(monkeypatch, problem)["launches"][1][1] == (10, 1, 1)
    deterministic = _record_backward(monkeypatch, problem, deterministic=True)["launches"][1][0]
    assert deterministic.deterministic and not deterministic.persistent
    # More units than the walk's one-word place can count (1 << 27): one CTA per tile.
    monkeypatch.setattr(wgmma_bwd, "MAX_PERSISTENT_UNITS", 3 * h * b)  # this call has 3 per (head, batch)
    (_, (main, main_grid, _), _) = _record_backward(monkeypatch, problem)["launches"]
    assert not main.persistent and main_grid == (6, h, b)


def test_the_persistent_backward_is_its_own_instantiation():
    """The persistent grid is a template flag with its own cache entry; deterministic mode never uses it
    (its turns follow the order one-tile CTAs start in), and every head dim and mask that a call may
    run persistent has both instantiations."""
    per_tile = wgmma_bwd.WgmmaBwdConfig(128, True, "bfloat16", False)
    persistent = wgmma_bwd.WgmmaBwdConfig(128, True, "bfloat16", False, persistent=True)
    assert per_tile.template_name().endswith("false, false>") and persistent.template_name().endswith("false, true>")
    assert persistent.short_id() != per_tile.short_id()
    with pytest.raises(ValueError, match="deterministic"):
        wgmma_bwd.WgmmaBwdConfig(128, True, "bfloat16", False, deterministic=True, persistent=True)
    configs = [c for c in wgmma_bwd.all_configs() if isinstance(c, wgmma_bwd.WgmmaBwdConfig)]
    assert {(c.head_dim, c.causal) for c in configs if c.persistent} == {(128, True)}
    assert all(dataclasses.replace(c, persistent=False) in configs for c in configs if c.persistent)


@pytest.mark.parametrize("causal, sk, sms, cyclic", [(False, 1000, 132, 1), (False, 1000, 7, 0), (True, 1000, 132, 0)])
def test_the_deterministic_backward_gets_zeroed_turn_counters_and_its_walk(monkeypatch, causal, sk, sms, cyclic):
    """Deterministic calls get zeroed int32 turn counters per query block and a ticket per head, and
    non-causal ones walk cyclically only when every CTA of a head (one per key block) fits on the
    device at once (the kernel's turns wait for CTAs of any key block then)."""
    b, sq, h, d = 2, 300, 4, 128
    monkeypatch.setattr(wgmma_bwd, "sm_count", lambda device_id: sms)
    problem = AttentionProblem(AttentionShape(b, sq, sk, h, h, d, "bfloat16", 0.1), causal)
    record = _record_backward(monkeypatch, problem, deterministic=True)
    m_blocks = -(-sq // 64)
    (_, (main, main_grid, packed), _) = record["launches"]
    assert main.deterministic and main_grid == (-(-sk // 128), h, b)  # 8 key blocks
    assert record["scratch"][3] == ((b, h, m_blocks + 1), "int32", True)  # turn counters, then a ticket
    fields = wgmma_bwd.PARAMS.unpack(packed)
    assert fields[-21] != 0 and fields[-7] == cyclic


def test_the_deterministic_backward_is_its_own_instantiation():
    """deterministic=True compiles the kernel with ordered dQ reductions (its own template flag and
    cache entry), and every head dim, dtype and mask has one."""
    plain = wgmma_bwd.WgmmaBwdConfig(128, True, "bfloat16", False)
    ordered = wgmma_bwd.WgmmaBwdConfig(128, True, "bfloat16", False, deterministic=True)
    assert plain.template_name().endswith("false, false>") and ordered.template_name().endswith("true, false>")
    assert ordered.short_id() != plain.short_id() and ordered != plain
    configs = [c for c in wgmma_bwd.all_configs() if isinstance(c, wgmma_bwd.WgmmaBwdConfig)]
    assert {(c.head_dim, c.causal, c.dtype, c.gqa) for c in configs if c.deterministic} == {
        (c.head_dim, c.causal, c.dtype, c.gqa) for c in configs if not c.deterministic}


@pytest.mark.parametrize("head_dim, seqlen, splits", [(256, 2048, False), (256, 4096, False), (256, 8192, True),
                                                      (192, 2048, True), (64, 2048, True)])
def test_wide_head_dims_split_their_tail_from_8k_keys(monkeypatch, head_dim, seqlen, splits):
    """FA2's grid (1024-2048 tiles on 132 SMs, a partly filled last round): above head dim 192 the
    tail is split only from WIDE_HEAD_SPLIT_SEQLEN keys, at smaller head dims at every length; the
    environment variable still forces it either way."""
    monkeypatch.delenv(wgmma_fwd.SPLIT_TAIL_VARIABLE, raising=False)
    shape = AttentionShape(16384 // seqlen, seqlen, seqlen, 2048 // head_dim, 2048 // head_dim, head_dim,
                           "bfloat16", 0.1)
    problem = AttentionProblem(shape, False)
    config = dataclasses.replace(wgmma_fwd.forward_config(head_dim, "bfloat16", False, seqlen=seqlen),
                                 cluster_kv=False)
    assert (wgmma_fwd.launch_plan(problem, config, 132)[1].units > 0) == splits
    monkeypatch.setenv(wgmma_fwd.SPLIT_TAIL_VARIABLE, "1")
    assert wgmma_fwd.launch_plan(problem, config, 132)[1].units > 0


def test_the_plan_in_words_follows_the_launch_plan(monkeypatch):
    """describe_plan (`cuflash2 info`): the tile, the output path, CTA pairs and the walk that
    forward would launch on that many SMs."""
    for variable in (wgmma_fwd.SPLIT_TAIL_VARIABLE, wgmma_fwd.KV_CLUSTERS_VARIABLE):
        monkeypatch.delenv(variable, raising=False)

    def plan(head_dim, seqlen, causal, ctas=132):
        shape = AttentionShape(16384 // seqlen, seqlen, seqlen, 2048 // head_dim, 2048 // head_dim, head_dim,
                               "bfloat16", 0.1)
        return wgmma_fwd.describe_plan(AttentionProblem(shape, causal), ctas)

    assert plan(128, 2048, False) == ("128 query rows (2 consumer warpgroups) by 160-key blocks, output stored "
                                      "from registers, CTA pairs sharing each K and V block, 2048 tiles on 132 "
                                      "CTAs, whole tiles")
    assert plan(64, 4096, False).startswith("192 query rows (3 consumer warpgroups) by 128-key blocks")
    assert plan(64, 4096, False).endswith("the last round split across the SMs")
    assert plan(256, 2048, False).endswith("1024 tiles on 132 CTAs, whole tiles")
    assert "output staged for TMA stores" in plan(128, 512, True) and plan(128, 512, True).endswith("longest tiles first")
    assert plan(128, 2048, False, ctas=1000).endswith("2048 tiles on 1000 CTAs, whole tiles")
