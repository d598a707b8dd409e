"""The Hopper (wgmma) forward on an sm_90 GPU: fp32 references with FA2's rule, which family ran
each call, the CUFLASH2_FAMILY override, the debug build and the torch path."""

import numpy as np
import pytest

from attention_ref import stable_seed
from test_forward_gpu import check_forward, make_inputs

from cuflash2.families import FAMILY_VARIABLE, mma_sync, wgmma

pytestmark = pytest.mark.gpu


def _is_hopper() -> bool:
    try:
        import cupy

        return cupy.cuda.Device().compute_capability == "90"
    except Exception:
        return False


hopper_only = pytest.mark.skipif(not _is_hopper(), reason="the wgmma family runs on compute capability 9.0")


def _count_entries(monkeypatch, entry: str) -> dict:
    """Counts the calls of each family's `entry` ("forward", "backward") that launch (the spy calls
    through; the dry run that records a call's launches for its replays does not count)."""
    from cuflash2.runtime import launcher

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    counts = {"wgmma": 0, "mma_sync": 0}
    for family in (wgmma.FAMILY, mma_sync.FAMILY):
        def spy(*args, _real=getattr(family, entry), _name=family.name, **kwargs):
            counts[_name] += not launcher.is_recording()
            return _real(*args, **kwargs)

        monkeypatch.setattr(family, entry, spy)
    return counts


@pytest.fixture
def ran(monkeypatch):
    """Counts the forward entries of each family that launch."""
    return _count_entries(monkeypatch, "forward")


@hopper_only
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 72, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("seqlens", [(1, 239), (113, 203), (203, 113), (1024, 1023)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_hopper_forward_runs_and_matches(ran, head_dim, seqlens, causal, dtype):
    import cupy as cp

    sq, sk = seqlens
    q, k, v = make_inputs(cp, 2, sq, sk, 4, 4, head_dim, dtype, stable_seed("wgmma", head_dim, sq, sk, causal, dtype))
    check_forward(cp, q, k, v, causal)
    assert ran == {"wgmma": 1, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv", [(16, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("seqlen", [1000, 1500])
def test_gqa_and_many_tiles_per_cta(ran, seqlen, head_dim, heads, heads_kv, causal):
    """More tiles than SMs (the persistent walk and, causal, the tile counter), grouped heads; at
    1000 rows (a short call) above head dim 128 each tile's output goes through the V stages before
    the next tile's V loads."""
    import cupy as cp

    q, k, v = make_inputs(cp, 3, seqlen, seqlen, heads, heads_kv, head_dim, "bf16",
                          stable_seed("wgmma-gqa", head_dim, heads, heads_kv, causal, seqlen))
    check_forward(cp, q, k, v, causal)
    assert ran["wgmma"] == 1


@hopper_only
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [120, 128])
@pytest.mark.parametrize("sq, sk", [(1100, 1030), (2000, 1700), (1025, 4097), (3000, 161)])
def test_long_non_causal_calls_on_wide_key_blocks(ran, head_dim, sq, sk, dtype):
    """Long non-causal calls at head dim 128 run 160-key blocks: key lengths that are not multiples
    of them (a partial last block, a single block plus one key), more tiles than SMs."""
    import cupy as cp

    from cuflash2.families.wgmma import forward as wgmma_forward

    assert wgmma_forward.forward_config(head_dim, "bfloat16", False, seqlen=max(sq, sk)).block_n == 160
    q, k, v = make_inputs(cp, 2, sq, sk, 16, 8, head_dim, dtype, stable_seed("wgmma-wide", head_dim, sq, sk, dtype))
    check_forward(cp, q, k, v, False)
    assert ran == {"wgmma": 1, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(8192, 8192), (8200, 8500), (700, 9000), (9000, 700)])
def test_calls_from_8k_on_the_widest_key_blocks(ran, sq, sk, causal, dtype):
    """Calls at head dim 128 from 8k keys or queries run 192-key blocks: partly filled last key
    blocks, a partial last query tile, fewer query tiles than SMs, and (causal, more queries than
    keys) rows that see no key."""
    import cupy as cp

    from cuflash2.families.wgmma import forward as wgmma_forward

    assert wgmma_forward.forward_config(128, "bfloat16", causal, seqlen=max(sq, sk)).block_n == 192
    q, k, v = make_inputs(cp, 1, sq, sk, 4, 2, 128, dtype, stable_seed("wgmma-widest", sq, sk, dtype))
    check_forward(cp, q, k, v, causal)
    assert ran == {"wgmma": 1, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("head_dim", [96, 128, 192, 256])
@pytest.mark.parametrize("sk", [8191, 8192])
def test_both_tile_boundaries_of_non_causal_calls(ran, head_dim, sk):
    """From 8192 keys on, a non-causal tile's epilogue runs under the next tile's first Q K^T (as
    every causal tile's does), below it between the two: on each side of the switch 256 tiles, so
    that on 132 SMs most CTAs run two, and partial last key blocks."""
    import cupy as cp

    q, k, v = make_inputs(cp, 1, 2048, sk, 16, 4, head_dim, "bf16", stable_seed("wgmma-boundary", head_dim, sk))
    check_forward(cp, q, k, v, False)
    assert ran == {"wgmma": 1, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("profile", ["ramp", "jump"])
def test_row_maxima_that_climb_across_key_blocks(ran, profile, head_dim, causal, dtype):
    """The kernel visits key blocks from the last to the first and keeps each row's reference for
    the exponentials until a block's maximum exceeds it by more than 2^8: keys scaled up towards
    the first ones make the maxima climb block after block ("ramp": by less than that, so the
    probabilities grow up to 2^8 against a reference that seldom moves; "jump": by far more in the
    last blocks visited, so the reference moves and O is rescaled by tiny factors)."""
    import cupy as cp

    sq = sk = 1500
    q, k, v = make_inputs(cp, 2, sq, sk, 4, 4, head_dim, dtype,
                          stable_seed("wgmma-climb", profile, head_dim, causal, dtype))
    position = cp.arange(sk, dtype=cp.float32) / sk
    gain = 1 + 6 * (1 - position) if profile == "ramp" else cp.where(position < 0.02, 12.0, 1.0)
    k = (k.astype(cp.float32) * gain[None, :, None, None]).astype(k.dtype)
    check_forward(cp, q, k, v, causal)
    assert ran == {"wgmma": 1, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", [(2048, 128), (1024, 100)])
def test_causal_tiles_that_see_no_key(ran, head_dim, sq, sk):
    """seqlen_q far above seqlen_k, causal: most query tiles see no key (no loads; O = 0 and LSE =
    +inf) while the tile schedule goes on, with more tiles than SMs (short calls: between tiles
    whose output is staged in shared memory)."""
    import cupy as cp

    q, k, v = make_inputs(cp, 8, sq, sk, 16, 4, head_dim, "bf16", stable_seed("wgmma-empty", head_dim, sq))
    out, lse = check_forward(cp, q, k, v, True)
    assert bool((out[:, :sq - sk].astype(cp.float32) == 0).all())
    assert bool(cp.isinf(lse[:, :, :sq - sk]).all())
    assert ran["wgmma"] == 1


@hopper_only
@pytest.mark.parametrize("head_dim, b, sq, sk, heads, heads_kv", [
    (128, 2, 2000, 1700, 8, 8), (120, 2, 2100, 161, 8, 2), (64, 3, 1500, 1500, 8, 8), (64, 3, 1200, 200, 8, 4),
    (256, 4, 1000, 1000, 8, 8), (96, 4, 900, 777, 8, 8), (192, 2, 1900, 2100, 8, 1), (32, 6, 1100, 1000, 8, 8),
    (128, 1, 8200, 8300, 4, 4)])
def test_split_tails_match(monkeypatch, ran, head_dim, b, sq, sk, heads, heads_kv):
    """Non-causal calls with more tiles than SMs, the tail split wherever it can be (a tile's key
    blocks cut between two CTAs, one handing its rows over, the other folding them in): wide key
    blocks (160 keys, and 192 from 8k), two key blocks per tile, three consumer groups, GQA, the
    staged output of short calls (above head dim 128 over the V stages). Against the fp32
    reference, and against the same call without a split (not the same bits: the cut tile sums its
    keys in another order)."""
    import cupy as cp

    from cuflash2.families.wgmma import forward as wgmma_forward
    from cuflash2.problem.features import AttentionProblem
    from cuflash2.problem.tensors import AttentionShape
    from cuflash2.runtime.device import sm_count

    q, k, v = make_inputs(cp, b, sq, sk, heads, heads_kv, head_dim, "bf16",
                          stable_seed("wgmma-split", head_dim, b, sq, sk, heads, heads_kv))
    problem = AttentionProblem(AttentionShape(b, sq, sk, heads, heads_kv, head_dim, "bfloat16", 0.1), False)
    config = wgmma_forward.forward_config(head_dim, "bfloat16", False, seqlen=max(sq, sk))
    outputs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(wgmma_forward.SPLIT_TAIL_VARIABLE, setting)
        _, split = wgmma_forward.launch_plan(problem, config, sm_count(cp.cuda.Device().id))
        assert (split.units > 0) == (setting == "1")
        outputs[setting] = check_forward(cp, q, k, v, False)
    (o1, l1), (o0, l0) = outputs.values()
    assert float(cp.abs(o1.astype(cp.float32) - o0.astype(cp.float32)).max()) < 1e-2
    assert float(cp.abs(l1 - l0).max()) < 1e-4  # fp32 rounding of another summation order
    assert ran == {"wgmma": 2, "mma_sync": 0}


@hopper_only
@pytest.mark.parametrize("head_dim, b, sq, sk, heads, heads_kv, dtype", [
    (128, 8, 2048, 2048, 16, 16, "bf16"), (128, 2, 2000, 2000, 8, 2, "fp16"), (64, 3, 1536, 1500, 8, 8, "bf16"),
    (96, 4, 1000, 777, 8, 8, "bf16"), (256, 2, 2048, 2048, 8, 8, "fp16"), (128, 2, 1024, 900, 8, 8, "bf16")])
def test_cta_pairs_match_unpaired_whole_tiles(monkeypatch, ran, head_dim, b, sq, sk, heads, heads_kv, dtype):
    """Non-causal calls in CTA pairs (clusters of two sharing each K and V block by multicast),
    forced at every tile kind: 160-key blocks (the default pairs; at 2000 keys the last block's
    second half lies wholly past the keys), three consumer groups, GQA, the staged output of short
    calls. Against the fp32 reference, and bit for bit against the same call unpaired with whole
    tiles (the same summation order)."""
    import cupy as cp

    from cuflash2.families.wgmma import forward as wgmma_forward
    from cuflash2.problem.features import AttentionProblem
    from cuflash2.problem.tensors import AttentionShape

    q, k, v = make_inputs(cp, b, sq, sk, heads, heads_kv, head_dim, dtype,
                          stable_seed("wgmma-pairs", head_dim, b, sq, sk, heads, heads_kv, dtype))
    name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    problem = AttentionProblem(AttentionShape(b, sq, sk, heads, heads_kv, head_dim, name, 0.1), False)
    config = wgmma_forward.forward_config(head_dim, name, False, seqlen=max(sq, sk))
    outputs = {}
    for pairs in ("1", "0"):
        monkeypatch.setenv(wgmma_forward.KV_CLUSTERS_VARIABLE, pairs)
        monkeypatch.setenv(wgmma_forward.SPLIT_TAIL_VARIABLE, "0")
        assert wgmma_forward.paired(config, problem).cluster_kv == (pairs == "1")
        outputs[pairs] = check_forward(cp, q, k, v, False)
    (o1, l1), (o0, l0) = outputs.values()
    assert bool((o1.view(cp.uint16) == o0.view(cp.uint16)).all()) and bool((l1 == l0).all())
    assert ran == {"wgmma": 2, "mma_sync": 0}


@hopper_only
def test_strided_views_and_out(ran):
    """q, k, v as views of one packed (b, s, 3, h, d) tensor and a given `out` (strides TMA takes)."""
    import cupy as cp

    import cuflash2

    rng = np.random.default_rng(7)
    qkv = cp.asarray(rng.standard_normal((2, 300, 3, 4, 128), dtype=np.float32)).astype(cp.float16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    check_forward(cp, q, k, v, True)
    out = cp.empty((2, 300, 4, 128), cp.float16)
    got = cuflash2.flash_attn_func(q, k, v, causal=True, out=out)
    assert got is out or bool((got == out).all())
    ref = cuflash2.flash_attn_func(q, k, v, causal=True)
    assert bool((out == ref).all())  # the same kernel, the same bits
    assert ran["wgmma"] >= 2 and ran["mma_sync"] == 0  # (a repeated signature replays without the entry)


@hopper_only
@pytest.mark.parametrize("head_dim", [72, 128, 200])
def test_the_output_store_writes_only_the_output(ran, head_dim):
    """`out` as a strided view into a larger buffer (every fourth head of 4 x 6, rows padded): the
    TMA stores of the output tiles write its rows and columns and nothing past the sequence end,
    the head dim or between the heads."""
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 300, 260, 6, 6, head_dim, "fp16", stable_seed("wgmma-out", head_dim))
    buffer = cp.full((2, 304, 4, 6, head_dim + 8), 7.0, cp.float16)
    out = buffer[:, :300, 1, :, :head_dim]
    got = cuflash2.flash_attn_func(q, k, v, causal=True, out=out)
    assert got is out or bool((got == out).all())
    ref = cuflash2.flash_attn_func(q, k, v, causal=True)
    assert bool((out == ref).all())
    check_forward(cp, q, k, v, True)
    untouched = buffer.copy()
    untouched[:, :300, 1, :, :head_dim] = 7.0
    assert bool((untouched == 7.0).all())
    assert ran["wgmma"] >= 2 and ran["mma_sync"] == 0


@hopper_only
@pytest.mark.parametrize("case", ["window", "softcap", "head_dim_59", "misaligned"])
def test_what_it_does_not_run_goes_to_mma_sync(ran, case):
    import cupy as cp

    import cuflash2

    head_dim = 59 if case == "head_dim_59" else 64
    q, k, v = make_inputs(cp, 2, 200, 200, 4, 4, head_dim, "bf16", stable_seed("wgmma-route", case))
    kwargs = {"window": {"window_size": (32, 0)}, "softcap": {"softcap": 20.0}}.get(case, {})
    if case == "misaligned":  # rows 2 bytes off a 16-byte boundary
        wide = cp.zeros((2, 200, 4, 72), q.dtype)
        wide[..., 1:65] = q
        q = wide[..., 1:65]
    cuflash2.flash_attn_func(q, k, v, causal=True, **kwargs)
    assert ran == {"wgmma": 0, "mma_sync": 1}


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_repeated_calls_replay_with_the_struct_rebuilt(ran, causal):
    """A repeated call replays its recorded launch with the parameter struct (tensor maps, tile
    counter) rebuilt for its own tensors: the same bits as the full path, on new inputs too."""
    import cupy as cp

    import cuflash2
    from cuflash2.core import replay

    q, k, v = make_inputs(cp, 2, 700, 700, 4, 4, 128, "bf16", stable_seed("wgmma-replay", causal))
    first = cuflash2.flash_attn_func(q, k, v, causal=causal)
    assert ran == {"wgmma": 1, "mma_sync": 0}
    assert any(isinstance(entry, replay.Replay) for entry in replay.CALLS.entries.values())
    q2, k2, v2 = (x[:, ::-1].copy() for x in (q, k, v))  # other addresses, other values
    replayed = [cuflash2.flash_attn_func(a, b, c, causal=causal) for a, b, c in ((q, k, v), (q2, k2, v2))]
    assert ran == {"wgmma": 1, "mma_sync": 0}  # both replayed
    assert bool((replayed[0] == first).all())
    replay.FAST_CALLS = False
    try:
        full = cuflash2.flash_attn_func(q2, k2, v2, causal=causal)
    finally:
        replay.FAST_CALLS = True
    assert bool((replayed[1] == full).all())


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_the_variable_compares_both_families_on_one_call(monkeypatch, causal):
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 777, 777, 8, 2, 128, "bf16", stable_seed("wgmma-ab", causal))
    outputs = {}
    for name in ("wgmma", "mma_sync"):
        monkeypatch.setenv(FAMILY_VARIABLE, name)
        outputs[name] = check_forward(cp, q, k, v, causal)
    (o1, l1), (o2, l2) = outputs.values()
    assert float(cp.abs(o1.astype(cp.float32) - o2.astype(cp.float32)).max()) < 2e-2
    assert float(cp.abs(l1 - l2).max()) < 1e-4


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_the_debug_build_with_bounded_waits(monkeypatch, ran, causal):
    """The debug build (barrier and flag waits trap after a bounded spin), causal and with a split
    tail."""
    import cupy as cp

    from cuflash2.families.wgmma import forward as wgmma_forward

    monkeypatch.setenv(wgmma.HANG_CHECK_VARIABLE, "1")
    monkeypatch.setenv(wgmma_forward.SPLIT_TAIL_VARIABLE, "1")
    q, k, v = make_inputs(cp, 4, 600, 900, 16, 8, 128, "fp16", stable_seed("wgmma-debug", causal))
    check_forward(cp, q, k, v, causal)
    assert ran["wgmma"] == 1


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_torch_training_step_with_the_hopper_forward(ran, causal):
    """torch autograd: the wgmma forward's LSE feeds the mma.sync backward; gradients match those
    of the mma.sync forward."""
    torch = pytest.importorskip("torch")
    import cuflash2

    grads = {}
    for name in ("wgmma", "mma_sync"):
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, k, v = (torch.randn(2, 513, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(FAMILY_VARIABLE, name)
            out = cuflash2.flash_attn_func(q, k, v, causal=causal)
            out.float().square().sum().backward()
        grads[name] = (out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
    for a, b in zip(*grads.values()):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 2e-2 * max(1.0, scale)
    assert ran["wgmma"] >= 1 and ran["mma_sync"] >= 1


def _attention_grads(fn, q, k, v, dout):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fn(q, k, v).backward(dout)
    return [x.grad.float() for x in (q, k, v)]


def _assert_within_fa2_rule(grads, q, k, v, dout, causal):
    """dq, dk, dv within 3x the error of the same math in 16-bit torch against fp32 (FA2's rule)."""
    from test_torch_gpu import reference  # here: that module needs torch, the others here do not

    exact = _attention_grads(lambda x, y, z: reference(x.float(), y.float(), z.float(), causal), q, k, v,
                             dout.float())
    low = _attention_grads(lambda x, y, z: reference(x, y, z, causal), q, k, v, dout)
    for name, g, e, l in zip(("dq", "dk", "dv"), grads, exact, low):
        error, allowed = (g - e).abs().max().item(), 3 * (l - e).abs().max().item() + 1e-4
        assert error <= allowed, f"{name}: error {error:.3g} > {allowed:.3g}"


@hopper_only
@pytest.mark.parametrize("d", [64, 128, 256, 32, 40, 72, 96, 120, 192, 200])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("b, sq, sk, h, hk, causal", [(2, 256, 256, 4, 4, False), (2, 256, 256, 4, 4, True),
                                                      (1, 200, 333, 4, 4, True), (1, 333, 200, 4, 4, True),
                                                      (2, 130, 170, 8, 2, False), (2, 130, 170, 8, 2, True),
                                                      (1, 1024, 1024, 2, 1, True), (3, 65, 64, 2, 2, False)])
def test_the_hopper_backward_matches_the_reference(monkeypatch, b, sq, sk, h, hk, causal, dtype, d):
    """Head dims 64, 128 and 256, and those that run on their kernels with padded columns (32-120,
    192-200):
    gradients within 3x the error of the same math in 16-bit torch against fp32 (FA2's rule), and
    the wgmma backward is the one that ran."""
    import torch

    import cuflash2
    from cuflash2.families.wgmma import backward as wgmma_backward

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    calls = []
    real = wgmma_backward.backward
    monkeypatch.setattr(wgmma_backward, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(stable_seed("hopper-backward", b, sq, sk, h, hk, causal, dtype, d))
    dt = getattr(torch, dtype)
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    got = _attention_grads(lambda x, y, z: cuflash2.flash_attn_func(x, y, z, causal=causal), q, k, v, dout)
    assert calls, "the Hopper backward did not run"
    _assert_within_fa2_rule(got, q, k, v, dout, causal)


@pytest.fixture
def ran_backward(monkeypatch):
    """Counts the backward entries of each family that launch."""
    return _count_entries(monkeypatch, "backward")


@hopper_only
@pytest.mark.parametrize("case", ["d64", "d128 causal", "window", "softcap", "alibi", "dropout", "d96", "d24",
                                  "d256", "d192", "d160", "deterministic"])
def test_the_backward_leaves_what_the_hopper_kernel_does_not_run_to_mma_sync(ran_backward, case):
    """Plain and causal backwards at head dims that are multiples of 8 in 32-128 and 192-256 run on
    the wgmma family, deterministic or not; variants and other head dims on mma_sync."""
    import cupy as cp

    import cuflash2
    from cuflash2.materialize import as_float32

    d = {"d64": 64, "d96": 96, "d24": 24, "d256": 256, "d192": 192, "d160": 160}.get(case, 128)
    options = {"d128 causal": dict(causal=True), "window": dict(window_size=(32, 16)), "softcap": dict(softcap=5.0),
               "alibi": dict(alibi_slopes=cp.linspace(0.1, 0.5, 4, dtype=cp.float32)),
               "dropout": dict(dropout_p=0.2, dropout_seed=7), "deterministic": dict(deterministic=True)}.get(case, {})
    q, k, v = make_inputs(cp, 2, 200, 300, 4, 4, d, "bf16", stable_seed("backward-routing", case))
    out, lse = cuflash2.flash_attn_forward(q, k, v, **{key: x for key, x in options.items() if key != "deterministic"})
    dout = cp.asarray(np.ones(q.shape, np.float32).astype(q.dtype))
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **options)
    cp.cuda.get_current_stream().synchronize()
    on_hopper = ("d64", "d128 causal", "d96", "d256", "d192", "deterministic")
    expected, other = ("wgmma", "mma_sync") if case in on_hopper else ("mma_sync", "wgmma")
    assert ran_backward[expected] >= 1 and ran_backward[other] == 0, ran_backward
    assert all(bool(cp.isfinite(as_float32(cp, g)).all()) for g in grads)


@hopper_only
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, sq, sk, h, hk, causal", [(2, 1000, 1000, 4, 4, False), (2, 1000, 1000, 4, 4, True),
                                                      (1, 700, 1500, 8, 2, True), (1, 1500, 700, 4, 1, True),
                                                      (3, 97, 1100, 2, 2, False), (2, 1000, 1100, 4, 4, "linear")])
def test_the_deterministic_hopper_backward_gives_the_same_bits_every_run(monkeypatch, b, sq, sk, h, hk, causal, d):
    """deterministic=True runs the Hopper backward with ordered dQ reductions: the same gradients to
    the bit on every run (many key blocks add to each query block here), within FA2's rule.
    "linear": non-causal, with the walk a head takes when its CTAs do not all fit on the device."""
    import torch

    import cuflash2
    from cuflash2.families.wgmma import backward as wgmma_backward

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    if causal == "linear":
        monkeypatch.setattr(wgmma_backward, "sm_count", lambda device_id: 1)
        causal = False
    modes = []
    real = wgmma_backward.backward
    monkeypatch.setattr(wgmma_backward, "backward", lambda *a, **kw: modes.append(a[12]) or real(*a, **kw))
    torch.manual_seed(stable_seed("hopper-deterministic", b, sq, sk, h, hk, causal, d))
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    run = lambda: _attention_grads(  # noqa: E731
        lambda x, y, z: cuflash2.flash_attn_func(x, y, z, causal=causal, deterministic=True), q, k, v, dout)
    first = run()
    for _ in range(3):
        assert all(torch.equal(g, f) for g, f in zip(run(), first)), "gradients differ between runs"
    assert modes and all(modes), "the deterministic Hopper backward did not run"
    _assert_within_fa2_rule(first, q, k, v, dout, causal)


@hopper_only
@pytest.mark.parametrize("d, causal, b, sq, sk, h, hk", [
    (128, True, 40, 600, 600, 16, 16), (128, True, 6, 900, 1000, 8, 2), (128, True, 4, 700, 1000, 16, 4),
    (128, True, 4, 1000, 700, 16, 16), (128, True, 6, 640, 640, 24, 24), (96, True, 9, 555, 555, 20, 20),
    (128, True, 24, 1024, 1024, 16, 8), (128, True, 5, 900, 1000, 31, 31), (128, True, 3, 2000, 1900, 16, 16),
    (128, True, 2, 5000, 4100, 16, 16), (128, True, 1, 8192, 8192, 16, 16)])
def test_the_persistent_hopper_backward_walks_many_tiles_per_cta(monkeypatch, d, causal, b, sq, sk, h, hk):
    """Causal calls at head dim 128 longer than 512 run the persistent grid: with more units of two key blocks
    than SMs each CTA walks several tiles (its K/V reloaded between them, its Q/dO pipeline and dQ
    reductions running on across tiles; odd key-block counts leave a middle block alone). Gradients
    within FA2's rule, and dK/dV the same bits as the one-CTA-per-tile grid's (each tile computes
    them alone, in the same order; dQ's reductions may add in another order)."""
    import torch

    import cuflash2
    from cuflash2.core import replay
    from cuflash2.families.wgmma import backward as wgmma_backward

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    launched = []
    real = wgmma_backward.main_grid
    monkeypatch.setattr(wgmma_backward, "main_grid", lambda *a: launched.append((a[0], real(*a))) or launched[-1][1])
    torch.manual_seed(stable_seed("hopper-persistent", d, causal, b, sq, sk, h, hk))
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = _attention_grads(lambda x, y, z: cuflash2.flash_attn_func(x, y, z, causal=causal), q, k, v, dout)
    config, grid = launched[-1]
    units = -(-(-(-sk // 128)) // 2) * h * b
    assert config.persistent and grid[0] < units, (config, grid, units)
    _assert_within_fa2_rule(got, q, k, v, dout, causal)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    assert launched[-1][0].persistent
    monkeypatch.setattr(wgmma_backward, "persistent_grid", lambda *args: False)
    replay.clear()  # the call's recorded launches would replay the persistent grid
    per_tile = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    assert not launched[-1][0].persistent
    assert torch.equal(grads[1], per_tile[1]) and torch.equal(grads[2], per_tile[2])
    torch.testing.assert_close(grads[0], per_tile[0], atol=2e-2, rtol=2e-2)


@hopper_only
@pytest.mark.parametrize("d", [40, 64, 128, 192, 200, 256])
def test_the_key_gradient_stores_write_every_element_and_nothing_else(monkeypatch, d):
    """dk= and dv= as strided views into larger buffers: with strides a TMA map takes, the kernel
    stores them through shared memory by TMA, with rows padded by two elements it stores them from
    registers. Both write every element of the views (filled with NaN first), the same bits as
    contiguous outputs, and nothing past the sequence end, the head dim or between the heads."""
    import torch

    import cuflash2
    from cuflash2.families.wgmma import backward as wgmma_backward

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    decided = []
    real = wgmma_backward.stores_key_gradients_by_tma
    monkeypatch.setattr(wgmma_backward, "stores_key_gradients_by_tma",
                        lambda *a: decided.append(real(*a)) or decided[-1])
    torch.manual_seed(stable_seed("hopper-dkv-store", d))
    b, sq, sk, h = 2, 300, 260, 4
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    expected = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    for pad, by_tma in ((8, True), (2, False)):
        buffers = [torch.full((b, sk + 3, 2, h, d + pad), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        dk, dv = (x[:, :sk, 1, :, :d] for x in buffers)
        for x in (dk, dv):
            x.fill_(float("nan"))
        decided.clear()
        got = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dk=dk, dv=dv)
        assert decided and set(decided) == {by_tma}  # the call itself, and its recording for replays
        assert got[1].data_ptr() == dk.data_ptr() and got[2].data_ptr() == dv.data_ptr()
        assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
        for x in buffers:
            x[:, :sk, 1, :, :d] = 7.0
            assert bool((x == 7.0).all()), "written outside the view"


@hopper_only
@pytest.mark.parametrize("d", [32, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_key_gradient_sums_are_the_same_bits_by_tma_or_registers(monkeypatch, d, causal):
    """With GQA the kernel writes dK and dV summed per query head in fp32 (converted after): stored by
    TMA (the default) or from registers (the fallback, forced here), the gradients are the same bits."""
    import torch

    import cuflash2
    from cuflash2.families.wgmma import backward as wgmma_backward

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    torch.manual_seed(stable_seed("hopper-gqa-dkv-store", d, causal))
    b, sq, sk, h, hk = 2, 190, 300, 8, 2
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    decided = []
    real = wgmma_backward.stores_key_gradients_by_tma
    monkeypatch.setattr(wgmma_backward, "stores_key_gradients_by_tma",
                        lambda *a: decided.append(real(*a)) or decided[-1])
    by_tma = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    assert decided and set(decided) == {True}  # the call itself, and its recording for replays
    decided.clear()
    monkeypatch.setattr(wgmma_backward, "stores_key_gradients_by_tma", lambda *a: decided.append(False) or False)
    dk, dv = (torch.empty_like(k) for _ in range(2))  # a new signature: run and recorded again
    from_registers = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dk=dk, dv=dv)
    assert decided
    assert torch.equal(by_tma[1], from_registers[1]) and torch.equal(by_tma[2], from_registers[2])


@hopper_only
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_hopper_backward_writes_dq_into_rows_that_are_not_16_byte_aligned(monkeypatch, d):
    """dq= views whose rows are only 4-byte aligned take the conversion's narrow stores: the same
    bits as a contiguous dq (deterministic=True: the accumulation is the same on both calls)."""
    import torch

    import cuflash2

    monkeypatch.delenv(FAMILY_VARIABLE, raising=False)
    torch.manual_seed(stable_seed("hopper-dq-narrow", d))
    b, sq, sk, h = 2, 300, 260, 3
    q, dout = (torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    expected = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    padded = torch.full((b, sq, h, d + 4), 7.0, device="cuda", dtype=torch.bfloat16)
    dq = padded[..., 2:d + 2]  # rows 4-byte aligned (row stride 3 (d + 4) elements), not 16
    got = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dq=dq)
    assert got[0].data_ptr() == dq.data_ptr()
    assert torch.equal(dq, expected[0]) and all(torch.equal(g, e) for g, e in zip(got[1:], expected[1:]))
    assert bool((padded[..., :2] == 7).all()) and bool((padded[..., d + 2:] == 7).all())  # nothing written outside
