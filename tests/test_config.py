"""Kernel configurations (cuflash2/config.py) and FLOP counting (cuflash2/bench.py). CPU only, fast."""

import itertools
import dataclasses
import re

import pytest

from cuflash2 import bench
from cuflash2.families import mma_sync as config
from cuflash2.families.mma_sync import backward_plan, KernelConfig, all_forward_configs, forward_config, head_dim_bucket, smem_limit
from cuflash2.families.mma_sync import backward_plans, forward_tiles

ARCHS = (80, 86, 89, 90)
FWD_KERNEL = "flash_fwd_kernel"


def fwd_config(dtype, head_dim, block_m, block_n, warps, stages, causal, kernel=FWD_KERNEL):
    """A forward KernelConfig built by keyword (independent of the dataclass' field order)."""
    return KernelConfig(kernel=kernel, dtype=dtype, head_dim=head_dim, block_m=block_m, block_n=block_n,
                        warps=warps, stages=stages, causal=causal)
HEAD_DIMS = tuple(range(8, config.MAX_HEAD_DIM + 1, 8))


# ---------------------------------------------------------------------------------- forward_config


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", config.DTYPES)
def test_forward_config_every_head_dim(arch, causal, dtype):
    limit = smem_limit(arch)
    for d in HEAD_DIMS:
        c = forward_config(d, dtype, causal, arch)
        where = f"d={d} {c.short_id()} sm_{arch}"
        assert c.dtype == dtype and c.causal is causal, where
        assert c.head_dim >= d and c.head_dim % 32 == 0 and c.head_dim <= config.MAX_HEAD_DIM, where
        assert c.head_dim == head_dim_bucket(d), where
        assert c.head_dim - d < 32, f"{where}: bucket wastes a whole 32-column slice"
        assert c.smem_bytes <= limit, f"{where}: {c.smem_bytes} B > {limit} B"
        assert c.warps >= 1 and c.block_m % (16 * c.warps) == 0, where
        assert c.block_n % 16 == 0 and c.block_n > 0, where
        assert c.stages >= 2, where
        assert c.threads == 32 * c.warps <= 1024, where
        assert c.kernel == FWD_KERNEL, where


def test_forward_config_is_deterministic_and_hashable():
    a = forward_config(72, "bf16", True, 80)
    b = forward_config(72, "bf16", True, 80)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.block_m = 64  # frozen: it is a cache key


def test_forward_config_causal_flag_is_a_bool():
    assert forward_config(64, "fp16", 1, 80).causal is True
    assert forward_config(64, "fp16", 0, 80).causal is False


@pytest.mark.parametrize("dtype", ["fp32", "float16", "bfloat16", "", "BF16"])
def test_forward_config_bad_dtype(dtype):
    with pytest.raises(ValueError, match=rf"dtype: expected one of .*got {re.escape(repr(dtype))}"):
        forward_config(64, dtype, False, 80)


@pytest.mark.parametrize("arch", [70, 75, 61])
def test_forward_config_old_arch(arch):
    with pytest.raises(ValueError, match=r"arch: expected compute capability >= 8\.0"):
        forward_config(64, "bf16", False, arch)


def test_smem_bytes_formula():
    c = fwd_config("bf16", 128, 128, 64, 8, 3, False)
    assert c.smem_bytes == 128 * 128 * 2 + 3 * 64 * 128 * 2
    assert c.threads == 256


# ------------------------------------------------------------------------------- template / ids


@pytest.mark.parametrize("arch", [80, 90, 86])
def test_template_name_round_trips(arch):
    pattern = re.compile(r"^(\w+)<(Bf16|Fp16), (\d+), (\d+), (\d+), (\d+), (\d+), (true|false), (true|false)>$")
    for c in all_forward_configs(arch):
        match = pattern.match(c.template_name())
        assert match, c.template_name()
        kernel, ctype, d, bm, bn, w, s, causal, variant = match.groups()
        parsed = fwd_config({"Bf16": "bf16", "Fp16": "fp16"}[ctype], int(d), int(bm), int(bn), int(w), int(s),
                            causal == "true", kernel)
        assert dataclasses.replace(parsed, variant=variant == "true") == c


def test_short_id_is_unique_and_readable():
    configs = {c for arch in (80, 86, 90) for c in all_forward_configs(arch)}
    ids = {c.short_id() for c in configs}
    assert len(ids) == len(configs)
    c = fwd_config("fp16", 96, 128, 64, 8, 2, True)
    assert c.short_id() == "fwd-fp16-d96-causal-m128n64w8s2"
    assert fwd_config("bf16", 32, 128, 128, 4, 2, False).short_id() == "fwd-bf16-d32-full-m128n128w4s2"
    assert forward_config(64, "bf16", True, 90, variant=True).short_id() == "fwd-bf16-d64-causal-var-m128n64w8s3"


def test_short_causal_tile_only_where_measured():
    """Causal calls whose query and key lengths are both up to FWD_SHORT_SEQLEN take FA2's 64x64
    4-warp tile at head dim 256 on sm_90 (measured faster there); every other call keeps its tile,
    and the tile is compiled ahead."""
    short = forward_config(256, "bf16", True, 90, seqlen=config.FWD_SHORT_SEQLEN)
    assert (short.block_m, short.block_n, short.warps) == (64, 64, 4)
    assert short in all_forward_configs(90)
    assert forward_config(256, "bf16", True, 90, seqlen=config.FWD_SHORT_SEQLEN + 1) == forward_config(
        256, "bf16", True, 90)
    for args in ((256, "bf16", False, 90), (128, "bf16", True, 90), (256, "bf16", True, 80), (256, "fp16", True, 86),
                 (256, "bf16", True, 100)):
        assert forward_config(*args, seqlen=512) == forward_config(*args)
    assert forward_config(256, "bf16", True, 90, True, seqlen=512) == forward_config(256, "bf16", True, 90, True)


def test_non_causal_head_dim_256_tile_on_sm90_only():
    """Non-causal head dim 256 takes the 64x64 4-warp tile on sm_90 at every length (measured
    faster there); other archs, the variant kernel and causal calls above the short limit keep theirs."""
    for seqlen in (None, 512, 16384):
        c = forward_config(256, "fp16", False, 90, seqlen=seqlen)
        assert (c.block_m, c.block_n, c.warps, c.stages) == (64, 64, 4, 2), c.short_id()
    assert forward_config(256, "bf16", False, 80).block_m == 128
    assert forward_config(256, "bf16", False, 90, variant=True).block_n == 32
    assert forward_config(256, "bf16", True, 90).block_m == 128
    assert forward_config(256, "bf16", False, 90) in all_forward_configs(90)


def test_forward_launch_picks_the_tile_by_the_longer_sequence(monkeypatch):
    """A short query against long keys (chunked prefill) has long blocks: it keeps the long tile."""
    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.problem.tensors import AttentionShape, contiguous_info

    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: 264)
    sent = []
    monkeypatch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args: sent.append(config))
    for seqlen_q, seqlen_k in ((1024, 1024), (1024, 16384)):
        q = contiguous_info((1, seqlen_q, 8, 256), "bfloat16", 2)
        kv = contiguous_info((1, seqlen_k, 8, 256), "bfloat16", 2)
        lse = contiguous_info((1, 8, seqlen_q), "float32", 4)
        shape = AttentionShape(1, seqlen_q, seqlen_k, 8, 8, 256, "bfloat16", 0.0625)
        launch.forward(q, kv, kv, q, lse, shape, True, 0, None)
    assert [c.block_m for c in sent] == [64, 128]


def test_variant_configs_mirror_the_plain_ones():
    """Every plain instantiation has a variant twin; the variant tiles differ only where the plain
    tile spills with the extra per-element work (recorded in config.py)."""
    for arch in (80, 86, 90):
        configs = all_forward_configs(arch)
        # tiles of causal calls by length (the short-sequence class): plain only
        by_length = [c for d in config.HEAD_DIM_BUCKETS for t in config.DTYPES
                     for seqlen in config.FWD_SEQLEN_CLASSES
                     if (c := forward_config(d, t, True, arch, seqlen=seqlen)) != forward_config(d, t, True, arch)]
        plain = [c for c in configs if not c.variant and c not in by_length]
        variant = [c for c in configs if c.variant]
        assert len(plain) == len(variant) == len(config.HEAD_DIM_BUCKETS) * 2 * 2
        for c in plain:
            twin = forward_config(c.head_dim, c.dtype, c.causal, arch, variant=True)
            assert twin.variant and (twin.head_dim, twin.dtype, twin.causal) == (c.head_dim, c.dtype, c.causal)
            own_tiles = forward_tiles._FWD_VARIANT_TILES_SMALL_SMEM if arch == 86 else forward_tiles._FWD_VARIANT_TILES_LARGE_SMEM
            if arch == 90 and c.head_dim in forward_tiles._FWD_TILES_SM90:  # measured for plain attention only
                assert (twin.block_m, twin.block_n, twin.warps, twin.stages) == \
                    forward_tiles._FWD_TILES_LARGE_SMEM[c.head_dim], c.short_id()
            elif c.head_dim not in own_tiles:  # the others have their own variant tiles (config.py)
                assert dataclasses.replace(twin, variant=False) == c
        plan = backward_plan(128, "bf16", True, arch, variant=True)
        assert all(k.variant for k in (*plan.main, plan.dq))
        assert not plan.dot.variant and not plan.convert.variant


# ---------------------------------------------------------------------------------- head_dim_bucket


def test_head_dim_bucket_values():
    assert [head_dim_bucket(d) for d in (1, 8, 32, 33, 40, 64, 65, 96, 128, 129, 200, 256)] == \
        [32, 32, 32, 64, 64, 64, 96, 96, 128, 160, 224, 256]
    for d in range(1, 257):
        b = head_dim_bucket(d)
        assert b in config.HEAD_DIM_BUCKETS and d <= b < d + 32


@pytest.mark.parametrize("d", [257, 264, 300, 512, 10_000])
def test_head_dim_bucket_too_large(d):
    with pytest.raises(ValueError, match=rf"head_dim: expected at most 256, got {d}"):
        head_dim_bucket(d)


@pytest.mark.parametrize("d", [0, -1, -64])
def test_head_dim_bucket_not_positive(d):
    with pytest.raises(ValueError, match=rf"head_dim: .*got {d}"):
        head_dim_bucket(d)


def test_buckets_are_multiples_of_32():
    assert config.HEAD_DIM_BUCKETS == tuple(range(32, 257, 32))


# ---------------------------------------------------------------------------------------- smem_limit


def test_smem_limit_known_archs():
    assert smem_limit(80) == 163 * 1024
    assert smem_limit(86) == 99 * 1024
    assert smem_limit(89) == 99 * 1024
    assert smem_limit(90) == 227 * 1024


@pytest.mark.parametrize("arch,limit_kb", [(100, 227), (103, 227), (120, 99), (121, 99), (110, 99), (130, 99)])
def test_smem_limit_newer_archs(arch, limit_kb):
    """Known newer parts get their datasheet budget; unknown ones the smallest supported budget."""
    assert smem_limit(arch) == limit_kb * 1024
    forward_config(256, "bf16", True, arch)  # something launchable exists
    for kernel in backward_plan(256, "bf16", True, arch, gqa=True).kernels():
        assert kernel.smem_bytes <= smem_limit(arch)


@pytest.mark.parametrize("arch", [0, 50, 61, 70, 75, 79])
def test_smem_limit_old_arch_raises(arch):
    with pytest.raises(ValueError, match=rf"arch: expected compute capability >= 8\.0, got {arch // 10}\.{arch % 10}"):
        smem_limit(arch)


# ------------------------------------------------------------------------------ all_forward_configs


@pytest.mark.parametrize("arch", ARCHS)
def test_all_forward_configs(arch):
    configs = all_forward_configs(arch)
    assert len(configs) == len(set(configs)), "duplicates"
    assert len({c.template_name() for c in configs}) == len(configs)
    # every (bucket, dtype, causal) served exactly once, and everything forward_config can return is listed
    keys = {(c.head_dim, c.dtype, c.causal) for c in configs}
    assert keys == set(itertools.product(config.HEAD_DIM_BUCKETS, config.DTYPES, (False, True)))
    listed = set(configs)
    for d, dtype, causal in itertools.product(HEAD_DIMS, config.DTYPES, (False, True)):
        assert forward_config(d, dtype, causal, arch) in listed
    assert all(c.smem_bytes <= smem_limit(arch) for c in configs)


# ------------------------------------------------------------------------------- backward plans


@pytest.mark.skipif(not hasattr(config, "all_backward_configs"), reason="no backward kernels in this version")
@pytest.mark.parametrize("arch", ARCHS)
def test_all_backward_configs(arch):
    """Every backward plan exists on every arch (99 KB parts included) and fits its shared memory."""
    configs = config.all_backward_configs(arch)
    assert configs and len(configs) == len(set(configs)), "duplicates"
    limit = smem_limit(arch)
    for c in configs:
        assert c.smem_bytes <= limit, f"{c.short_id()} sm_{arch}: {c.smem_bytes} B > {limit} B"
        assert c.dtype in config.DTYPES and c.warps >= 1, c.short_id()
    for d, dtype, causal in itertools.product(HEAD_DIMS, config.DTYPES, (False, True)):
        for kernel in config.backward_plan(d, dtype, causal, arch).kernels():
            assert kernel in set(configs), f"d={d}: {kernel.short_id()} missing from all_backward_configs"


# ------------------------------------------------------------------------------------ FLOP counting


def brute_force_pairs(sq, sk, causal):
    return sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + sk - sq)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 7), (7, 1), (5, 5), (13, 29), (29, 13), (64, 64), (100, 37),
                                   (37, 100), (3, 0), (0, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_brute_force(sq, sk, causal):
    assert bench.visible_pairs(sq, sk, causal) == brute_force_pairs(sq, sk, causal)


def test_visible_pairs_matches_reference_mask():
    np = pytest.importorskip("numpy")
    from cuflash2.reference import visible_mask

    for sq, sk in [(9, 17), (17, 9), (12, 12)]:
        assert bench.visible_pairs(sq, sk, True) == int(np.count_nonzero(visible_mask(sq, sk, causal=True)))


def test_attention_flops_full():
    b, s, h, d = 2, 1024, 16, 128
    assert bench.attention_flops(b, s, s, h, d, False) == 4.0 * b * s * s * h * d
    assert bench.attention_flops(b, 100, 300, h, d, False) == 4.0 * b * 100 * 300 * h * d


def test_attention_flops_modes():
    args = (2, 257, 513, 8, 64, False)
    fwd = bench.attention_flops(*args)
    assert bench.attention_flops(*args, mode="fwd") == fwd
    assert bench.attention_flops(*args, mode="bwd") == pytest.approx(2.5 * fwd)
    assert bench.attention_flops(*args, mode="fwd+bwd") == pytest.approx(3.5 * fwd)
    with pytest.raises(KeyError):
        bench.attention_flops(*args, mode="sideways")


@pytest.mark.parametrize("s", [1, 2, 17, 128, 4096])
def test_attention_flops_causal_square_is_half(s):
    full = bench.attention_flops(1, s, s, 4, 64, False)
    causal = bench.attention_flops(1, s, s, 4, 64, True)
    assert causal == full / 2  # FA2's convention for sq == sk
    exact = 4.0 * 4 * 64 * brute_force_pairs(s, s, True) if s <= 128 else causal
    assert abs(causal - exact) <= full / s  # differs from the exact count by under 1/s of full


@pytest.mark.parametrize("sq,sk", [(100, 300), (300, 100), (1, 64), (64, 1)])
def test_attention_flops_causal_rectangular_counts_visible_pairs(sq, sk):
    flops = bench.attention_flops(3, sq, sk, 2, 32, True)
    assert flops == 4.0 * 3 * 2 * 32 * brute_force_pairs(sq, sk, True)


def test_peak_tflops():
    assert bench.peak_tflops("NVIDIA H200")[0] == 989.0
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert bench.peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    peak, why = bench.peak_tflops("Some Future GPU")
    assert peak is None and "unknown" in why


# ------------------------------------------------------------------------- backward dQ accumulation


@pytest.mark.parametrize("arch", [80, 86])
def test_atomic_dq_needs_sm90(arch):
    """The main-kernel dQ accumulation relies on sm_90's bulk reductions: older GPUs get a clear error
    from the planner and never see those kernels in the compile-all list."""
    with pytest.raises(ValueError, match=r"atomic_dq: needs compute capability 9\.0 or newer, got 8\.\d"):
        config.backward_plan(128, "bf16", False, arch, atomic_dq=True)
    assert not any(c.kernel == config.BWD and c.flags[2] for c in config.all_backward_configs(arch))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_atomic_dq_plan_on_sm90(head_dim, gqa, causal):
    """Every head dim has a main kernel that accumulates dQ, whose dQ product splits evenly over the
    warps, and no dQ kernel; the plan is in the compile-all list."""
    plan = config.backward_plan(head_dim, "fp16", causal, 90, gqa=gqa, atomic_dq=True)
    assert plan.dq is None
    with_dq = [c for c in plan.main if c.flags[2]]
    assert len(with_dq) == 1
    c = with_dq[0]
    assert backward_plans._dq_split_ok(c.block_m, c.warps, c.head_dim), c.short_id()
    assert c.block_n == 16 * c.warps
    assert set(plan.kernels()) <= set(config.all_backward_configs(90))
    with pytest.raises(ValueError, match="cannot be deterministic"):
        config.backward_plan(head_dim, "fp16", causal, 90, deterministic=True, atomic_dq=True)


def test_dq_split_rule():
    """dQ = dS K over the warps: 16-row tiles times column groups of a multiple of 16 columns."""
    assert backward_plans._dq_split_ok(32, 8, 128)  # 2 row tiles x 4 groups of 32 columns
    assert not backward_plans._dq_split_ok(32, 8, 96)  # groups of 24 columns
    assert backward_plans._dq_split_ok(64, 8, 96)  # 4 row tiles x 2 groups of 48
    assert not backward_plans._dq_split_ok(64, 2, 64)  # 4 row tiles over 2 warps


def test_backward_smem_includes_dq_staging():
    c = config.KernelConfig(config.BWD, "bf16", 128, 32, 128, 8, 2, False, (True, True, True, False))
    expected = 2 * 128 * 128 * 2 + 2 * (2 * 32 * 128 * 2 + 2 * 32 * 4) + 128 * 32 * 2 + 2 * 32 * 128 * 4
    assert c.smem_bytes == expected
    assert c.smem_bytes <= smem_limit(90)


def test_fused_backward_default_and_limits():
    """The one-pass backward is the default only where it was measured faster (head-dim buckets 64
    to 256 on sm_90, plain, non-deterministic), and is refused with a clear
    error elsewhere."""
    def main(**kw):
        return config.backward_plan(**{"dtype": "bf16", "causal": False, "arch": 90, **kw}).main

    assert [c.kernel for c in main(head_dim=128)] == [config.BWD_FUSED]
    assert [c.kernel for c in main(head_dim=128, causal=True)] == [config.BWD_FUSED]
    assert [c.kernel for c in main(head_dim=128, gqa=True)] == [config.BWD_FUSED]
    for head_dim in (104, 120):  # padded columns of the 128 bucket: the same kernel, measured faster too
        assert [c.kernel for c in main(head_dim=head_dim)] == [config.BWD_FUSED]
    assert main(head_dim=128, gqa=True)[0].flags == (True,)  # fp32 dK/dV, summed over the group later
    assert [c.kernel for c in main(head_dim=64, causal=True, gqa=True)] == [config.BWD_FUSED]  # fits at 64
    assert [c.kernel for c in main(head_dim=128, causal=True, gqa=True)] == [config.BWD_FUSED]  # spill-free now
    for head_dim in (72, 96):  # bucket 96: 16-row dQ warps (FA2's d96 layout)
        assert [c.kernel for c in main(head_dim=head_dim)] == [config.BWD_FUSED]
    # not the default: head dim 32, deterministic, variant, sm_80, explicit plans
    for kw in ({"head_dim": 32}, {"deterministic": True},
               {"variant": True},
               {"arch": 80}, {"atomic_dq": True}, {"atomic_dq": False}, {"split": True}):
        assert config.BWD_FUSED not in [c.kernel for c in main(**{"head_dim": 128, **kw})], kw
    assert [c.kernel for c in main(head_dim=64, fused=True)] == [config.BWD_FUSED]
    plan = config.backward_plan(128, "bf16", False, 90)
    assert plan.dq is None and plan.main[0].accumulates_dq
    for kw in ({"head_dim": 32}, {"arch": 80}, {"variant": True}, {"deterministic": True}):
        with pytest.raises(ValueError, match="fused: the one-pass backward needs sm_90"):
            main(**{"head_dim": 128, "fused": True, **kw})
    # a tuning tile that does not fit is refused before any compilation
    with pytest.raises(ValueError, match="tile: the fused backward with 128-row query blocks needs"):
        main(head_dim=256, fused=True, tile=(128, 8, 2))
    assert main(head_dim=64, fused=True, tile=(64, 8, 2))[0].block_m == 64


@pytest.mark.parametrize("head_dim", [136, 160, 192])
def test_sm90_forward_tile_of_head_dims_160_and_192(head_dim):
    """Buckets 160 and 192 on sm_90 take the 128x128 8-warp tile (measured faster), except causal
    calls up to FWD_SHORT_SEQLEN, which take FA2's 64x64 4-warp tile; the A100 and the variant
    kernels keep their own tiles, bucket 224 its own."""
    def tile(causal, seqlen):
        c = forward_config(head_dim, "bf16", causal, 90, seqlen=seqlen)
        assert c in all_forward_configs(90)  # compiled (and checked for spills) with the others
        return (c.block_m, c.block_n, c.warps, c.stages)

    longest_64_row_causal = config.FWD_LONG_CAUSAL_SEQLEN
    for seqlen in (None, 512, config.FWD_SHORT_SEQLEN, config.FWD_SHORT_SEQLEN + 1, longest_64_row_causal + 1):
        assert tile(False, seqlen) == (128, 128, 8, 2)
    for seqlen in (512, config.FWD_SHORT_SEQLEN):
        assert tile(True, seqlen) == (64, 64, 4, 2)
    for seqlen in (None, config.FWD_SHORT_SEQLEN + 1, longest_64_row_causal + 1):
        assert tile(True, seqlen) == (128, 128, 8, 2)
    for causal in (False, True):
        assert forward_config(head_dim, "bf16", causal, 80).block_n == 64
        assert forward_config(head_dim, "bf16", causal, 90, variant=True).block_n == 64
    assert forward_config(224, "bf16", False, 90).block_n == 64


def test_fused_backward_smem_and_compile_list():
    c = config.fused_backward_config(128, "fp16", True, False)
    dq_buffers = 2 * 64 * (128 + 4) * 4  # rows padded by 16 bytes (no bank conflicts on the staging stores)
    assert c.smem_bytes == 2 * 128 * 128 * 2 + 2 * (2 * 64 * 128 * 2 + 2 * 64 * 4) + 2 * 128 * 64 * 2 + dq_buffers
    assert c.smem_bytes <= smem_limit(90)
    assert c.short_id() == "bwd-fused-fp16-d128-causal-m64n128w8s2"
    assert config.fused_backward_config(64, "bf16", False, True).short_id() == "bwd-fused-bf16-d64-full-m128n128w8s2-f32"
    d64 = config.fused_backward_config(64, "bf16", False, False)  # 128-row blocks: one dQ buffer of its own
    one_buffer = 2 * 128 * 64 * 2 + 2 * (2 * 128 * 64 * 2 + 2 * 128 * 4) + 2 * 128 * 128 * 2 + 128 * (64 + 8) * 4
    assert d64.smem_bytes == one_buffer and one_buffer + 128 * (64 + 8) * 4 > smem_limit(90)
    assert "flash_bwd_fused_kernel<Fp16, 128, 64, 128, 8, true, false>" == c.template_name()
    fused = {c for c in config.all_backward_configs(90) if c.kernel == config.BWD_FUSED}
    assert len(fused) == 5 * 2 * 2 * 2  # widths 64, 96, 128, 192, 256 x dtypes x causal x gqa
    assert {c.head_dim for c in fused} == {64, 96, 128, 192, 256}


@pytest.mark.parametrize(("head_dim", "width"), [(136, 192), (192, 192), (200, 256), (256, 256)])
def test_fused_backward_above_128_uses_64_key_blocks_and_stages_dq_over_q(head_dim, width):
    """Above head dim 128 the fused kernel works on 64-key blocks (2 key groups x 4 column groups),
    buckets 160 and 224 run the next even-tiled width; width 192 stages dQ in one buffer of its own,
    width 256 over a consumed Q/dO stage (FusedBwdTraits::kDqBuffers / kDqInStage): that is what
    makes d256 fit."""
    c = config.backward_plan(head_dim, "bf16", True, 90, fused=True).main[0]
    assert (c.kernel, c.head_dim, c.block_m, c.block_n, c.warps) == (config.BWD_FUSED, width, 64, 64, 8)
    fixed = 2 * 64 * width * 2 + 2 * 64 * 64 * 2  # K, V, P^T, dS^T
    plain_stage, dq_buffer = 2 * 64 * width * 2 + 2 * 64 * 4, 64 * (width * 4 + 32)  # Q, dO, LSE, D; padded fp32 dQ rows
    if width == 192:
        assert c.smem_bytes == fixed + 2 * plain_stage + dq_buffer
        assert c.smem_bytes + dq_buffer > smem_limit(90)  # a second buffer would not fit
    else:
        assert c.smem_bytes == fixed + 2 * max(plain_stage, dq_buffer)
        assert fixed + 2 * plain_stage + dq_buffer > smem_limit(90)  # not even one buffer of its own
    assert c.smem_bytes <= smem_limit(90)
    assert c.dq_column_swizzle(head_dim) == 0 and c.dq_row_pad_floats == 8  # padded, not swizzled
    assert not any(c.kernel == config.BWD_FUSED for c in config.all_backward_configs(80))


def test_kvcache_tile_for_decoding_rows():
    """Up to 16 query rows (one-token GQA decoding: a group of query heads as rows) get the
    key-splitting decoding kernel at head dims 64/128/256; 17-32 rows the 32-row tile at head dim
    128; longer queries and other head dims the 64-row tile; 99 KB parts shrink the decoding ring."""
    decode = config.kvcache_config(128, "bf16", False, 90, query_rows=4)
    assert decode.kernel == config.FWD_DECODE
    assert (decode.block_m, decode.block_n, decode.warps, decode.stages) == (16, 128, 4, 3)
    assert decode.smem_bytes == 16 * 128 * 2 + 3 * 128 * 128 * 2
    assert config.kvcache_config(256, "bf16", False, 90, query_rows=16).block_n == 64
    assert config.kvcache_config(64, "bf16", False, 90, query_rows=1).kernel == config.FWD_DECODE
    short = config.kvcache_config(128, "bf16", False, 90, query_rows=17)
    assert (short.kernel, short.block_m, short.block_n, short.warps) == (config.FWD_KVCACHE, 32, 128, 2)
    assert config.kvcache_config(128, "bf16", False, 90, query_rows=33).block_m == 64
    assert config.kvcache_config(128, "bf16", False, 90).block_m == 64
    assert config.kvcache_config(96, "bf16", False, 90, query_rows=4).block_m == 64
    assert config.kvcache_config(128, "fp16", True, 86, query_rows=20).block_n == 64
    for head_dim in (64, 128, 256):  # every decoding tile fits the 99 KB parts, with >= 16 keys per warp
        small = config.kvcache_config(head_dim, "fp16", True, 86, query_rows=4)
        assert small.smem_bytes <= smem_limit(86) and small.block_n // small.warps >= 16
    every = config.all_kvcache_configs(90)
    assert decode in every and short in every and config.kvcache_config(128, "bf16", False, 90) in every
    assert len(every) == len(set(every))


def test_forward_row_sums_in_shared_memory_only_for_tight_tiles():
    """Tiles whose accumulators take >= 160 registers at head dim >= 96 with 32 rows per warp keep
    their running row sums in shared memory (FwdTraits::kSumsInSmem); the launch must reserve it,
    the other tiles need none (the causal 16-row-per-warp tile at head dim 256 is tight too, but
    keeps its sums in registers)."""
    tight = forward_config(128, "bf16", False, 90)
    assert (tight.block_m, tight.block_n, tight.warps) == (128, 64, 4)
    assert tight.forward_row_sums_bytes == 128 * 2 * 2 * 4  # threads x 2 row tiles x 2 rows x fp32
    assert tight.smem_bytes == 128 * 128 * 2 + 2 * 64 * 128 * 2 + 2048
    wide = forward_config(256, "bf16", True, 90)  # 8 warps x 16 rows, 64 keys: 128 + 32 registers
    assert (wide.block_n, wide.warps, wide.forward_row_sums_bytes) == (64, 8, 0)
    assert wide.smem_bytes == 128 * 256 * 2 + 2 * 64 * 256 * 2
    assert forward_config(256, "bf16", False, 90).forward_row_sums_bytes == 0
    d96 = forward_config(96, "bf16", False, 90)  # 4 warps x 32 rows, 64 keys: 2 x (12 + 8) x 4 = 160
    assert (d96.block_n, d96.warps, d96.forward_row_sums_bytes) == (64, 4, 2048)
    assert forward_config(96, "bf16", False, 90, variant=True).block_n == 32  # the 64-key variant build spills
    for head_dim, arch in ((64, 90), (32, 90), (256, 86), (128, 86)):  # fewer accumulator registers
        other = forward_config(head_dim, "bf16", False, arch)
        assert other.forward_row_sums_bytes == 0
        assert other.smem_bytes == other.block_m * other.head_dim * 2 + other.stages * other.block_n * other.head_dim * 2
    assert forward_config(128, "bf16", False, 90, variant=True).forward_row_sums_bytes == 0


# ---- vector width (pure) -------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,expected", [(64, 16), (72, 16), (80, 16), (88, 16), (200, 16), (100, 8), (60, 8),
                                               (90, 4), (62, 4), (1, 2), (3, 2), (59, 2), (111, 2), (255, 2)])
def test_vector_width_of_contiguous_head_dims(head_dim, expected):
    assert config.vector_width(head_dim) == expected
    assert expected in config.possible_vector_widths(head_dim)
    assert config.possible_vector_widths(head_dim)[0] == expected


def test_vector_width_takes_the_least_aligned_pointer_or_stride():
    assert config.vector_width(64, 2, [0x1000, 128, 8192]) == 16
    assert config.vector_width(64, 2, [0x1008, 128]) == 8
    assert config.vector_width(64, 2, [0x1000, 0x2004]) == 4
    assert config.vector_width(64, 2, [0x1000, 130]) == 2
    assert config.vector_width(59, 2, [0x1000, 128]) == 2  # a view q[..., :59] of 64-wide rows
    assert config.vector_width(60, 2, [0x1000, 128]) == 8
    assert config.vector_width(64, 2, [0, 0, 128]) == 16  # zero strides (broadcast, varlen batch) allow any width
    with pytest.raises(ValueError, match="aligned to 2 bytes"):
        config.vector_width(64, 2, [0x1001])


def test_with_vector_width_keeps_16_and_names_the_others():
    c = config.forward_config(64, "fp16", True, 90)
    assert config.with_vector_width(c, 16) is c and c.compile_options() == ()
    narrow = config.with_vector_width(c, 2)
    assert narrow.vec == 2 and narrow.short_id() == c.short_id() + "-v2"
    assert narrow.template_name() == c.template_name()  # a -D define, not a template argument
    assert narrow.compile_options() == ("-DCF_VEC_BYTES=2",)
    rotary = config.kvcache_helper_configs("fp16")[0]
    assert config.with_vector_width(rotary, 2) is rotary  # element-wise: no width


@pytest.mark.parametrize("arch", [80, 90, 86])
def test_narrow_forward_tiles_fit_and_take_16_rows_per_warp(arch):
    for bucket in config.HEAD_DIM_BUCKETS:
        for vec in (8, 4, 2):
            for variant in (False, True):
                c = config.with_vector_width(config.forward_config(bucket, "fp16", True, arch, variant), vec)
                assert c.smem_bytes <= config.smem_limit(arch), c.short_id()
                if bucket >= 96:
                    assert c.block_m // (16 * c.warps) == 1, c.short_id()


@pytest.mark.parametrize("head_dim,cols", [(1, 8), (3, 8), (59, 64), (60, 64), (64, 64), (100, 104), (255, 256)])
def test_fp32_scratch_rows_pad_to_8_columns(head_dim, cols):
    assert config.fp32_cols(head_dim) == cols
    assert config.backward_plan(head_dim, "fp16", False, 90, atomic_dq=True).main[0].dq_row_pitch(head_dim) == cols


@pytest.mark.parametrize("head_dim,bucket", [(1, 32), (3, 32), (59, 64), (72, 96), (100, 128), (111, 128),
                                             (200, 224), (255, 256)])
def test_any_head_dim_takes_the_smallest_bucket(head_dim, bucket):
    assert config.head_dim_bucket(head_dim) == bucket
    assert config.forward_config(head_dim, "bf16", False, 80).head_dim == bucket


def test_narrow_configs_cover_every_width_and_family():
    for arch in (80, 90):
        narrow = config.all_narrow_configs(arch)
        assert {c.vec for c in narrow if c.kernel != config.ROTARY_COPY} == {8, 4, 2}
        for vec in (8, 4, 2):
            kinds = {c.kernel for c in narrow if c.vec == vec}
            assert {config.FWD, config.FWD_KVCACHE, config.BWD_DOT, config.BWD_CONVERT} <= kinds
            assert kinds & {config.BWD, config.BWD_FUSED}
