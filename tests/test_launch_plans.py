"""Kernel-argument packing and the KV-cache launch plans (pure: no GPU needed)."""

import struct

import numpy as np
import pytest

import types

from cuflash2.core import kvcache, replay
from cuflash2.families import mma_sync as config
from cuflash2.families.mma_sync import kvcache_launches
from cuflash2.families.mma_sync import launches as launch
from cuflash2.problem.tensors import TensorInfo
from cuflash2.runtime import device, launcher
from cuflash2.runtime import launcher as packed_launch


def test_each_argument_gets_a_little_endian_8_byte_slot():
    args = (np.uint64(2**40 + 5), np.int32(-3), np.float32(1.5), np.int64(-7))
    packed = bytes(packed_launch.pack_slots(args))
    assert len(packed) == 4 * packed_launch.SLOT_BYTES
    assert struct.unpack_from("<Q", packed, 0)[0] == 2**40 + 5
    assert struct.unpack_from("<i", packed, 8)[0] == -3  # a 4-byte parameter reads the low half
    assert struct.unpack_from("<f", packed, 16)[0] == 1.5
    assert struct.unpack_from("<q", packed, 24)[0] == -7


def test_unsupported_argument_types_are_named():
    with pytest.raises(TypeError, match="kernel argument: expected np.uint64.*got int"):
        packed_launch.pack_slots((np.int32(1), 5))


def _info(shape, dtype="bfloat16", itemsize=2):
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return TensorInfo(tuple(shape), strides, dtype, "cuda:0", 0x7F0000000000, itemsize)


def _decode_infos(paged=False, rotary=False, append=True):
    batch, hk, d = 4, 8, 128
    cache = (32, 16, hk, d) if paged else (batch, 2048, hk, d)
    return {"q": _info((batch, 1, 32, d)), "k_cache": _info(cache), "v_cache": _info(cache),
            "k": _info((batch, 1, hk, d)) if append else None, "v": _info((batch, 1, hk, d)) if append else None,
            "cache_seqlens": _info((batch,), "int32", 4), "cache_batch_idx": None, "cache_leftpad": None,
            "block_table": _info((batch, 128), "int32", 4) if paged else None, "alibi_slopes": None,
            "rotary_cos": _info((4096, 64), "float32", 4) if rotary else None,
            "rotary_sin": _info((4096, 64), "float32", 4) if rotary else None}


_FAKE_KERNEL = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xABC))


@pytest.fixture
def h200(monkeypatch):
    for module in (kvcache, kvcache_launches):
        monkeypatch.setattr(module, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(kvcache_launches, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(replay, "get_kernel", lambda config, device_id: _FAKE_KERNEL)


def _decode_recording(infos, causal, interleaved, num_splits):
    """(launches, name of each buffer) of a KV-cache call signature's recording (lse returned)."""
    _, recording = kvcache.recording_for(0, infos, None, causal, (-1, -1), 0.0, interleaved, num_splits, True)
    names = list(kvcache.INPUT_BUFFERS) + ["out", "lse"]
    return recording, names


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_plan_launches_and_pointer_slots(h200, paged, rotary):
    infos = _decode_infos(paged, rotary)
    recording, names = _decode_recording(infos, False, True, 0)
    names += (["q_rot"] if rotary else []) + ["o_partial", "lse_partial"]  # scratch regions, in request order
    kernels = [step.config.kernel for step in recording.launches]
    # append k, append v, (rotate q,) attention, and the split-KV combine (4 sequences x 8 kv heads
    # do not fill 264 block slots, so the keys are split)
    assert len(kernels) == (5 if rotary else 4) and kernels[0] == kernels[1]
    assert len(recording.regions) == (3 if rotary else 2)
    attention = recording.launches[-2]
    expected = {"k_cache", "v_cache", "out", "lse", "cache_seqlens", "o_partial", "lse_partial",
                "q_rot" if rotary else "q"} | ({"block_table"} if paged else set())
    assert {names[source] for _, source in attention.slots} == expected
    for step in recording.launches:  # no stand-in address is left outside the slots
        slot_indices = {i for i, _ in step.slots}
        for i, (kind, arg) in enumerate(zip(step.types, step.template)):
            if kind is np.uint64 and i not in slot_indices:
                assert arg == 0


def test_decode_plan_fills_in_each_calls_addresses(h200, monkeypatch):
    recording, names = _decode_recording(_decode_infos(append=False), False, True, 1)
    (attention,) = recording.launches  # num_splits=1: no combine
    sent = []
    monkeypatch.setattr(launcher, "launch_packed", lambda function, grid, threads, smem, stream, packer, args:
                        sent.append((grid, args)))
    pointers = [0x1000 * (i + 1) for i in range(len(names))]
    recording.run(pointers, 0)
    (grid, args), = sent
    for index, source in attention.slots:
        assert args[index] == pointers[source]
    assert args[0] == pointers[names.index("q")] and args[3] == pointers[names.index("out")]
    assert grid[1:] == (8, 4)  # GQA decoding: one row block per kv head (query heads as rows)


@pytest.mark.parametrize("head_dim", [32, 40, 64, 96, 120, 128, 256])
def test_dq_accumulator_swizzle_permutes_within_rows_and_spreads_banks(head_dim):
    """The dQ staging swizzle (mirrored by the convert kernel) must be a permutation of each row's
    column pairs, and must put a warp's fragment store (8 rows x 4 lanes x 2 floats) on all 32
    banks: 2 wavefronts of 128 bytes instead of 8."""
    plan = config.backward_plan(head_dim, "bf16", False, 90, atomic_dq=True)
    mask = next(c for c in plan.main if c.accumulates_dq).dq_column_swizzle(head_dim)
    pairs = np.arange(0, head_dim, 2)
    for row in range(8):
        moved = pairs ^ (mask & ((row % 4) * 8))
        assert sorted(moved) == list(pairs)
    if head_dim % 32:
        assert mask == 0
        return
    row_words = head_dim  # fp32 words per staged row
    for first_col in range(0, head_dim, 8):  # one MMA column tile: lanes hold cols first_col + 2 * (lane % 4)
        banks = [((row * row_words + ((first_col + 2 * (lane % 4)) ^ (mask & ((row % 4) * 8)))) % 32) // 2
                 for lane in range(32) for row in [lane // 4]]
        assert max(banks.count(b) for b in set(banks)) == 2  # each 8-byte bank pair serves 2 lanes


def staged_row(row: int, interleave: bool) -> int:
    """Mirror of dq_staged_row (kernels_cu/common/dq_layout.cuh): row r of each group of 8 at 2 (r % 4) + r / 4."""
    return (row & ~7) | (2 * (row & 3) + ((row >> 2) & 1)) if interleave else row


def test_dq_row_interleave_permutes_each_group_of_eight_rows():
    for base in (0, 8, 64, 120):
        rows = [staged_row(base + r, True) for r in range(8)]
        assert sorted(rows) == list(range(base, base + 8))
        assert rows[:4] == [base, base + 2, base + 4, base + 6]  # a half-warp's 4 rows: two apart
    assert [staged_row(r, False) for r in range(16)] == list(range(16))


@pytest.mark.parametrize("head_dim", [40, 64, 104, 120, 128, 160, 192, 200, 256])
def test_fused_dq_rows_padded_instead_of_swizzled_spread_banks(head_dim):
    """The fused kernel pads each staged dQ row (and accumulator row) instead of permuting columns.
    A warp's fragment store (8 rows x 4 lanes x 2 floats, st.shared.v2) is served per half-warp
    (rows lane // 4 of lanes 0-15, then 16-31): with 32 bytes of padding the 4 rows of a half-warp
    start 8 banks apart and each half takes one wavefront. The head-dim-128 build keeps 16 bytes
    (32 would not leave room for its two dQ buffers), which alone leaves rows 4 banks apart (2-way),
    and interleaves its rows instead, which puts a half-warp's rows two apart: 8 banks again."""
    fused = config.backward_plan(head_dim, "bf16", False, 90).main[0]
    assert fused.kernel == config.BWD_FUSED and fused.dq_column_swizzle(head_dim) == 0
    pitch = fused.dq_row_pitch(head_dim)  # fp32 words per staged row: the kernel's width, padded
    pad = fused.dq_row_pad_floats
    assert pitch == fused.head_dim + pad and (pitch * 4) % 16 == 0  # bulk copies move 16-byte units
    assert pad == (4 if fused.head_dim == 128 else 8)
    assert fused.dq_row_interleave == (pad == 4)
    assert fused.block_m % 8 == 0  # the interleave stays inside a query block
    assert fused.smem_bytes <= config.smem_limit(90)
    for first_col in range(0, head_dim, 8):
        for half in (range(16), range(16, 32)):
            for interleave, expected in ((fused.dq_row_interleave, 1), (False, 1 if pad == 8 else 2)):
                banks = [(staged_row(lane // 4, interleave) * pitch + first_col + 2 * (lane % 4) + word) % 32
                         for lane in half for word in (0, 1)]
                assert max(banks.count(b) for b in set(banks)) == expected


def test_only_the_atomic_dq_main_kernel_swizzles_the_dq_accumulator():
    assert config.backward_plan(64, "bf16", False, 90, atomic_dq=True).main[0].dq_column_swizzle(64) == 24
    # unpadded rows span the head dim rounded up to 8 columns (the kernels' fp32_cols)
    assert config.backward_plan(64, "bf16", False, 90, atomic_dq=True).main[0].dq_row_pitch(64) == 64
    assert config.backward_plan(64, "bf16", False, 90, atomic_dq=True).main[0].dq_row_pitch(60) == 64
    assert config.backward_plan(64, "bf16", False, 90, atomic_dq=True).main[0].dq_row_pitch(59) == 64
    assert config.backward_plan(64, "bf16", False, 90).main[0].dq_column_swizzle(64) == 0  # fused: padded
    assert config.backward_plan(64, "bf16", False, 90).main[0].dq_row_pitch(60) == 72
    assert config.backward_plan(64, "bf16", False, 90, deterministic=True).main[0].dq_column_swizzle(64) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [False, True])
def test_forward_launch_arguments_pack(monkeypatch, causal, variant):
    """Every argument launch.forward passes has a packable numpy type (a Python int or float would
    be refused by the packed launch at run time, on the GPU only)."""
    from cuflash2.problem.features import Features
    from cuflash2.problem.tensors import AttentionShape

    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: 264)
    sent = []
    monkeypatch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args: sent.append((config, args)))
    q = _info((2, 100, 8, 64))
    kv = _info((2, 120, 2, 64))
    lse = _info((2, 8, 100), "float32", 4)
    features = Features(window_left=16, softcap=5.0) if variant else Features()
    shape = AttentionShape(2, 100, 120, 8, 2, 64, "bfloat16", 0.125)
    launch.forward(q, kv, kv, q, lse, shape, causal, 0, None, features=features)
    (config, args), = sent
    assert config.variant == variant
    assert len(packed_launch.pack_slots(tuple(args))) == packed_launch.SLOT_BYTES * len(args)


def test_decode_plan_arguments_pack(h200):
    recording, _ = _decode_recording(_decode_infos(paged=True, rotary=True), True, False, 0)
    for step in recording.launches:
        args = tuple(kind(a) for kind, a in zip(step.types, step.template))
        assert len(packed_launch.pack_slots(args)) == packed_launch.SLOT_BYTES * len(args)


def _grid_order(grid, nheads, grouped):
    """(block, head, batch) of every thread block in launch order (blockIdx.x fastest), decoded as
    BlockGrid (kernels_cu/common/block_mask.cuh) does."""
    gx, gy, gz = grid
    order = []
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                group = z * gx + x
                order.append((y, group % nheads, group // nheads) if grouped else (x, y, z))
    return order


@pytest.mark.parametrize(("groups", "blocks", "slots", "expected"), [
    (64, 32, 264, 16),  # one wave is 264 blocks: 9 groups, rounded up to a divisor of 64
    (128, 16, 264, 32),
    (15, 3, 7, 3),
    (15, 3, 1, 1),  # a group fills a wave: plain order
    (7, 4, 264, 7),  # a prime number of groups: one chunk
    (12, 200, 132, 1),
    (2 * 65535, 1000, 132, 2),  # grid z holds at most 65535 chunks
])
def test_groups_per_chunk(groups, blocks, slots, expected):
    assert config.groups_per_chunk(groups, blocks, slots) == expected


@pytest.mark.parametrize(("nheads", "batch", "blocks", "slots"), [(5, 3, 3, 7), (8, 2, 4, 20), (3, 1, 9, 1)])
def test_grouped_grid_covers_every_block_once_longest_first_per_chunk(nheads, batch, blocks, slots):
    """The grouped grid visits every (block, head, batch) once, and within each chunk of groups
    every group's block i starts before any group's block i + 1."""
    c = config.forward_config(64, "bf16", True, 90)
    assert c.grouped_grid
    grid = c.grid(blocks, nheads, batch, slots)
    size = config.groups_per_chunk(nheads * batch, blocks, slots)
    assert grid == (size, blocks, nheads * batch // size)
    order = _grid_order(grid, nheads, True)
    assert sorted(order) == sorted((i, h, b) for i in range(blocks) for h in range(nheads) for b in range(batch))
    per_chunk = size * blocks
    for start in range(0, len(order), per_chunk):
        chunk_blocks = [i for i, _, _ in order[start:start + per_chunk]]
        assert chunk_blocks == sorted(chunk_blocks)


def _capture_backward(monkeypatch, seqlen_k, causal, fused=None):
    """(config, grid, args) of every launch of one launch.backward call, without a GPU."""
    from cuflash2.problem.tensors import AttentionShape, contiguous_info

    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: 264)
    monkeypatch.setattr(launcher, "scratch", lambda shape, dtype=np.float32, zero=False:
                        (None, contiguous_info(shape, np.dtype(dtype).name, np.dtype(dtype).itemsize)))
    sent = []
    monkeypatch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args: sent.append((config, grid, args)))
    q, kv = _info((2, 64, 8, 128)), _info((2, seqlen_k, 8, 128))
    lse = _info((2, 8, 64), "float32", 4)
    shape = AttentionShape(2, 64, seqlen_k, 8, 8, 128, "bfloat16", 0.125)
    launch.backward(q, q, kv, kv, q, lse, q, kv, kv, shape, causal, False, 0, None, fused=fused)
    return sent


@pytest.mark.parametrize("causal", [False, True])
def test_causal_fused_backward_launches_the_grouped_grid(monkeypatch, causal):
    """The causal one-pass backward runs on the grouped grid, (G, key blocks, chunks), so the first
    key blocks (the longest) of a chunk of groups start first; the non-causal one keeps (key blocks,
    heads, batch). Both get nheads as their last argument."""
    sent = _capture_backward(monkeypatch, 300, causal)
    (main, grid, args), = [(c, g, a) for c, g, a in sent if c.kernel == config.BWD_FUSED]
    key_blocks = -(-300 // main.block_n)
    assert main.grouped_grid == causal
    assert grid == (main.grid(key_blocks, 8, 2, 264) if causal else (key_blocks, 8, 2))
    if causal:
        assert grid == (16, key_blocks, 1)  # 264 slots / 3 key blocks -> 88 groups wanted; all 16 then
    assert args[-1] == np.int32(8)


def test_causal_fused_backward_past_the_grid_limit_uses_another_plan(monkeypatch):
    """More key blocks than grid y holds: the causal backward takes a plan with the key blocks in
    grid x, and an explicit fused=True is refused with a clear error."""
    seqlen_k = 65536 * 128 + 1
    sent = _capture_backward(monkeypatch, seqlen_k, True)
    mains = [(c, g) for c, g, _ in sent if c.kernel in (config.BWD, config.BWD_FUSED)]
    assert mains and all(c.kernel == config.BWD and not c.grouped_grid for c, _ in mains)
    assert all(g[0] == -(-seqlen_k // c.block_n) for c, g in mains)
    with pytest.raises(ValueError, match="fused: the causal one-pass backward handles at most 65535 key blocks"):
        _capture_backward(monkeypatch, seqlen_k, True, fused=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [False, True])
def test_causal_forward_launches_the_grouped_grid(monkeypatch, causal, variant):
    """Causal forward grids take the grouped order (the last query blocks, the longest, of a chunk
    of groups start first); non-causal ones keep (query blocks, heads, batch). Past grid y's limit
    the causal forward refuses the call before any launch."""
    from cuflash2.problem.features import Features
    from cuflash2.problem.tensors import AttentionShape

    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: 4)
    sent = []
    monkeypatch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args: sent.append((config, grid, args)))
    features = Features(softcap=5.0) if variant else Features()
    q, kv, lse = _info((2, 300, 8, 64)), _info((2, 300, 2, 64)), _info((2, 8, 300), "float32", 4)
    launch.forward(q, kv, kv, q, lse, AttentionShape(2, 300, 300, 8, 2, 64, "bfloat16", 0.125), causal, 0, None,
                   features=features)
    (c, grid, args), = sent
    m_blocks = -(-300 // c.block_m)
    assert c.grouped_grid == causal
    assert grid == ((2, m_blocks, 8) if causal else (m_blocks, 8, 2))  # 4 slots / 3 blocks: chunks of 2 groups
    assert args[-1] == np.int32(8)
    rows = 65536 * c.block_m
    long_q = _info((1, rows, 8, 64))
    shape = AttentionShape(1, rows, rows, 8, 8, 64, "bfloat16", 0.125)
    if causal:
        with pytest.raises(ValueError, match="the causal forward handles at most"):
            launch.forward(long_q, long_q, long_q, long_q, lse, shape, True, 0, None, features=features)
        assert len(sent) == 1
    else:
        launch.forward(long_q, long_q, long_q, long_q, lse, shape, False, 0, None, features=features)
        assert sent[-1][1][0] == 65536
