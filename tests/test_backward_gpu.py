"""Backward kernels on the GPU against fp32 reference gradients, with FA2's tolerance rule."""

import numpy as np
import pytest

from attention_ref import attention_backward_ref, stable_seed
from test_forward_gpu import HEAD_DIMS, SEQLENS, check_forward, make_inputs

from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu


def run_backward(cp, q, k, v, dout, causal, deterministic=False):
    import cuflash2

    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    return cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)


def check_backward(cp, q, k, v, dout, causal, deterministic=False):
    grads = run_backward(cp, q, k, v, dout, causal, deterministic)
    f32 = [as_float32(cp, x) for x in (q, k, v, dout)]
    ref = attention_backward_ref(cp, *f32, causal)
    naive = attention_backward_ref(cp, *f32, causal, low_precision=np.dtype(q.dtype).name)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        g32 = as_float32(cp, g)
        assert not bool(cp.isnan(g32).any()), f"NaN in {name}"
        err = float(cp.abs(g32 - r).max())
        naive_err = float(cp.abs(n - r).max())
        assert err <= 3 * naive_err + 1e-4, f"{name}: max error {err:.3e} > 3 x naive {naive_err:.3e}"
    return grads


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_matches_reference(head_dim, seqlens, causal, dtype):
    import cupy as cp

    sq, sk = seqlens
    seed = stable_seed("bwd", head_dim, sq, sk, causal, dtype)
    batch = 1 if sq * sk > 1 << 20 else 2
    q, k, v = make_inputs(cp, batch, sq, sk, 2, 2, head_dim, dtype, seed)
    (dout,) = make_inputs(cp, batch, sq, 1, 2, 2, head_dim, dtype, seed + 1)[:1]
    check_backward(cp, q, k, v, dout, causal)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_backward_gqa_and_deterministic(heads, heads_kv, causal, head_dim, deterministic):
    import cupy as cp

    q, k, v = make_inputs(cp, 2, 173, 301, heads, heads_kv, head_dim, "bf16", heads + 13 * heads_kv)
    (dout,) = make_inputs(cp, 2, 173, 1, heads, 1, head_dim, "bf16", 99)[:1]
    check_backward(cp, q, k, v, dout, causal, deterministic)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_deterministic_backward_is_bit_identical(head_dim):
    import cupy as cp

    q, k, v = make_inputs(cp, 2, 777, 1029, 4, 2, head_dim, "bf16", 21)
    (dout,) = make_inputs(cp, 2, 777, 1, 4, 1, head_dim, "bf16", 22)[:1]
    first = run_backward(cp, q, k, v, dout, True, deterministic=True)
    for _ in range(20):
        again = run_backward(cp, q, k, v, dout, True, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


def test_large_magnitude_inputs_stay_finite():
    import cupy as cp

    q, k, v = make_inputs(cp, 2, 513, 513, 4, 4, 128, "fp16", 31)
    rng = np.random.default_rng(5)
    q = cp.asarray((cp.asnumpy(q).astype(np.float32) * 5).astype(np.float16))
    k = cp.asarray((cp.asnumpy(k).astype(np.float32) * 3).astype(np.float16))
    dout = cp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(np.float16))
    for g in run_backward(cp, q, k, v, dout, causal=True):
        assert bool(cp.isfinite(as_float32(cp, g)).all())


def test_fully_masked_rows_have_zero_gradients():
    import cupy as cp

    q, k, v = make_inputs(cp, 1, 200, 50, 2, 2, 64, "bf16", 41)
    (dout,) = make_inputs(cp, 1, 200, 1, 2, 1, 64, "bf16", 42)[:1]
    dq, dk, dv = run_backward(cp, q, k, v, dout, causal=True)
    assert bool((as_float32(cp, dq[:, :150]) == 0).all())
    assert bool(cp.isfinite(as_float32(cp, dk)).all()) and bool(cp.isfinite(as_float32(cp, dv)).all())


def test_noncontiguous_dout_and_given_outputs():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 130, 150, 4, 4, 64, "bf16", 51)
    (big,) = make_inputs(cp, 2, 130, 1, 8, 1, 64, "bf16", 52)[:1]
    dout = big[:, :, ::2]  # head stride 2x
    out, lse = cuflash2.flash_attn_forward(q, k, v)
    expected = cuflash2.flash_attn_backward(cp.ascontiguousarray(dout), q, k, v, out, lse, deterministic=True)
    dq, dk, dv = (cp.empty_like(x) for x in (q, k, v))
    result = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, dq=dq, dk=dk, dv=dv)
    assert result[0] is dq and result[1] is dk and result[2] is dv
    for a, b in zip(result, expected):
        assert bool((a.view(cp.uint16) == b.view(cp.uint16)).all())


_SM90_PLANS = [pytest.param({"atomic_dq": True}, hd, "bf16", id=f"atomic-{hd}") for hd in (64, 96, 128, 256)] + [
    pytest.param({"fused": True}, hd, "bf16", id=f"fused-{hd}")
    for hd in (40, 64, 72, 80, 96, 120, 128, 144, 192, 200, 256)] + [
    # fp16: masked exponentials may overflow to inf before the d64 build clears their halves
    pytest.param({"fused": True}, hd, "fp16", id=f"fused-{hd}-fp16") for hd in (64, 96, 128, 256)] + [
    # the d64 build with 64-row query blocks (a tuning tile): P^T in registers, two dQ buffers
    pytest.param({"fused": True, "tile": (64, 8, 2)}, 64, "bf16", id="fused-64-m64")]


@pytest.mark.parametrize("seqlens", [(211, 157), (64, 300)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize(("plan", "head_dim", "dtype"), _SM90_PLANS)
def test_sm90_dq_plans_match_reference(plan, head_dim, dtype, heads_kv, causal, seqlens):
    """The plans that accumulate dQ with bulk fp32 reductions (sm_90) stay correct: the main kernel
    with dQ, and the fused one-pass kernel; ragged query and key blocks, GQA, causal or not."""
    import cupy as cp

    import cuflash2
    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.frameworks.arrays import describe
    from cuflash2.problem.tensors import validate_qkv

    if launch.device_arch(0) < 90:
        pytest.skip("bulk reductions need sm_90")
    seqlen_q, seqlen_k = seqlens
    q, k, v = make_inputs(cp, 2, seqlen_q, seqlen_k, 4, heads_kv, head_dim, dtype, head_dim)
    (dout,) = make_inputs(cp, 2, seqlen_q, 1, 4, 1, head_dim, dtype, 7)[:1]
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    grads = [cp.empty_like(x) for x in (q, k, v)]
    infos = [describe("x", x) for x in (q, k, v)]
    shape = validate_qkv(*infos)
    launch.backward(describe("dout", dout), *infos, describe("out", out), describe("lse", lse),
                    *(describe("g", g) for g in grads), shape, causal, False, 0, cp.cuda.get_current_stream(),
                    **plan)
    f32 = [as_float32(cp, x) for x in (q, k, v, dout)]
    ref = attention_backward_ref(cp, *f32, causal)
    naive = attention_backward_ref(cp, *f32, causal, low_precision=np.dtype(q.dtype).name)
    for g, r, n in zip(grads, ref, naive):
        assert float(cp.abs(as_float32(cp, g) - r).max()) <= 3 * float(cp.abs(n - r).max()) + 1e-4


@pytest.mark.parametrize("arch", [80, 86])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_other_architectures_tile_tables(arch, causal, head_dim):
    """The tiles chosen for A100 (sm_80) and 99 KB GPUs (sm_86/89) run correctly here too."""
    import cupy as cp

    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.families.mma_sync import forward_config
    from cuflash2.frameworks.arrays import describe
    from cuflash2.problem.tensors import validate_qkv
    from attention_ref import attention_ref

    q, k, v = make_inputs(cp, 2, 150, 173, 4, 2, head_dim, "bf16", arch + head_dim)
    (dout,) = make_inputs(cp, 2, 150, 1, 4, 1, head_dim, "bf16", 3)[:1]
    infos = [describe("x", x) for x in (q, k, v)]
    shape = validate_qkv(*infos)
    out, lse = cp.empty_like(q), cp.empty((2, 4, 150), dtype=np.float32)
    stream = cp.cuda.get_current_stream()
    launch.forward(*infos, describe("out", out), describe("lse", lse), shape, causal, 0, stream,
                   forward_config(head_dim, "bf16", causal, arch))
    grads = [cp.empty_like(x) for x in (q, k, v)]
    launch.backward(describe("dout", dout), *infos, describe("out", out), describe("lse", lse),
                    *(describe("g", g) for g in grads), shape, causal, False, 0, stream, arch=arch)
    f32 = [as_float32(cp, x) for x in (q, k, v, dout)]
    ref, _ = attention_ref(cp, *f32[:3], causal)
    naive, _ = attention_ref(cp, *f32[:3], causal, low_precision="bfloat16")
    assert float(cp.abs(as_float32(cp, out) - ref).max()) <= 2 * float(cp.abs(naive - ref).max()) + 1e-5
    ref_g = attention_backward_ref(cp, *f32, causal)
    naive_g = attention_backward_ref(cp, *f32, causal, low_precision="bfloat16")
    for g, r, n in zip(grads, ref_g, naive_g):
        assert float(cp.abs(as_float32(cp, g) - r).max()) <= 3 * float(cp.abs(n - r).max()) + 1e-4


@pytest.mark.parametrize("heads_kv", [5, 1])
@pytest.mark.parametrize("slots", [1, 7, 10_000])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_causal_grouped_grid_orders_match_reference(monkeypatch, head_dim, slots, heads_kv):
    """Causal forward and backward with the grouped grid order (BlockGrid) at several chunk sizes:
    `slots` is what the launch believes the GPU runs at once, so 15 (head, batch) groups go in
    chunks of 1, 3 or 15 (config.groups_per_chunk); with 300 rows, several query and key blocks;
    MHA (the fused backward) and MQA (the forward's grouped grid with shared K/V heads)."""
    import cupy as cp

    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher

    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: slots)
    seed = stable_seed("grouped", head_dim, slots, heads_kv)
    q, k, v = make_inputs(cp, 3, 300, 300, 5, heads_kv, head_dim, "bf16", seed)
    (dout,) = make_inputs(cp, 3, 300, 1, 5, 5, head_dim, "bf16", seed + 1)[:1]
    check_forward(cp, q, k, v, True)
    check_backward(cp, q, k, v, dout, True)
