"""Replays on the GPU: a repeated call takes its recorded launches and computes exactly what the full
path computes; calls the key cannot vouch for go back to the full path."""

import numpy as np
import pytest

import cuflash2
from cuflash2.core import replay
from cuflash2.frameworks import adapter_for
from cuflash2.problem.options import AttentionOptions

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _mma_sync(monkeypatch):
    """The mma.sync family, whose launches replays record (on sm_90 the dense forward would run on
    the wgmma family, whose calls take the full path: test_wgmma_gpu.py)."""
    monkeypatch.setenv("CUFLASH2_FAMILY", "mma_sync")

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim), causal, window, softcap
    ((2, 200, 200, 4, 4, 64), False, (-1, -1), 0.0),
    ((2, 256, 256, 4, 4, 128), True, (-1, -1), 0.0),
    ((1, 150, 333, 8, 2, 128), True, (-1, -1), 0.0),  # GQA, seqlen_q != seqlen_k
    ((1, 128, 128, 2, 2, 256), False, (-1, -1), 0.0),
    ((2, 160, 160, 4, 4, 96), False, (32, 8), 0.0),  # window: the variant kernels
    ((2, 160, 160, 4, 4, 64), True, (-1, -1), 20.0),  # softcap
]


def _inputs(dims, seed):
    b, sq, sk, h, hk, d = dims
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(np.float16) for shape in
              ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))]
    return [cp.asarray(x) for x in arrays]


def _full_path(fn):
    replay.FAST_CALLS = False
    try:
        return fn()
    finally:
        replay.FAST_CALLS = True


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert cp.array_equal(g.view(cp.uint8), w.view(cp.uint8)), "the plan's result differs from the full path's"


@pytest.mark.parametrize("dims, causal, window, softcap", CASES)
def test_repeated_cupy_calls_take_the_plan_and_match_the_full_path(dims, causal, window, softcap):
    options = {"causal": causal, "window_size": window, "softcap": softcap}
    q, k, v, dout = _inputs(dims, 0)
    out, lse = cuflash2.flash_attn_forward(q, k, v, **options)  # full path: records the plan
    cuflash2.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    assert len(replay.CALLS.entries) == 2
    for seed in (1, 2):  # new buffers, same signature
        q, k, v, dout = _inputs(dims, seed)
        out, lse = cuflash2.flash_attn_forward(q, k, v, **options)
        grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        want = _full_path(lambda: cuflash2.flash_attn_forward(q, k, v, **options))
        _same((out, lse), want)
        _same(grads, _full_path(lambda: cuflash2.flash_attn_backward(dout, q, k, v, *want, deterministic=True,
                                                                     **options)))
    assert sorted(plan.calls for plan in replay.CALLS.entries.values()) == [2, 2]


def test_a_misaligned_input_goes_back_to_the_full_path():
    """A view 2 bytes off a 16-byte boundary never replays the 16-byte plan of its signature: the
    full path runs it with 2-byte accesses, and the result is that of an aligned copy."""
    q, k, v, _ = _inputs((1, 64, 2, 2, 2, 64), 0)
    cuflash2.flash_attn_forward(q, k, v)
    cuflash2.flash_attn_forward(q, k, v)
    (plan,) = replay.CALLS.entries.values()
    shifted = cp.empty(q.size + 8, dtype=q.dtype)[1:q.size + 1].reshape(q.shape)  # same strides, address + 2
    shifted[...] = q
    out, lse = cuflash2.flash_attn_forward(shifted, k, v)
    assert plan.calls == 1
    expected, expected_lse = cuflash2.flash_attn_forward(q, k, v)
    assert cp.array_equal(out, expected) and cp.array_equal(lse, expected_lse)


def test_empty_problems_and_copied_inputs_are_not_planned():
    q, k, v, _ = _inputs((1, 64, 0, 2, 2, 64), 0)
    for _ in range(2):
        out, lse = cuflash2.flash_attn_forward(q, k, v)
    assert not replay.CALLS.entries
    assert not out.any() and bool(cp.isinf(lse).all())
    q, k, v, _ = _inputs((1, 64, 64, 2, 2, 64), 0)
    wide = cp.zeros((1, 64, 2, 128), dtype=q.dtype)
    wide[..., ::2] = q
    strided = wide[..., ::2]  # last stride 2: the full path copies it
    for _ in range(2):
        out, _ = cuflash2.flash_attn_forward(strided, k, v)
    assert not replay.CALLS.entries
    _same((out,), (cuflash2.flash_attn_forward(q, k, v)[0],))


def test_torch_training_steps_take_the_plans_on_the_callers_stream():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    grads = {}
    stream = torch.cuda.Stream()
    for fast in (True, False):
        replay.FAST_CALLS = fast
        try:
            with torch.cuda.stream(stream):
                for step in range(3):
                    torch.manual_seed(step)
                    q, k, v = (torch.randn(2, 192, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    out = cuflash2.flash_attn_func(q, k, v, causal=True, deterministic=True)
                    out.backward(torch.randn_like(out))
                    grads[fast, step] = [x.grad.clone() for x in (out, q, k, v)[1:]] + [out.detach().clone()]
            stream.synchronize()
        finally:
            replay.FAST_CALLS = True
    assert sorted(plan.calls for plan in replay.CALLS.entries.values()) == [2, 2]
    for step in range(3):
        for got, want in zip(grads[True, step], grads[False, step], strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dims, causal", [((2, 256, 256, 4, 4, 128), True), ((1, 150, 333, 8, 2, 64), False),
                                          ((1, 128, 128, 2, 2, 256), True)])
def test_the_default_backward_replays_with_zeroed_accumulators(dims, causal):
    """deterministic=False: on sm_90 the fused kernel adds dQ into fp32 scratch that the plan must
    zero; the pool is dirtied first, so a missed memset would show. Atomic sums may differ in
    the last bits from the full path's, hence the tolerance."""
    q, k, v, dout = _inputs(dims, 0)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)  # records the plan
    for seed in (1, 2):
        q, k, v, dout = _inputs(dims, seed)
        out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
        dirty = cp.full(64 << 20, cp.nan, dtype=cp.float32)
        del dirty  # back to CuPy's pool: the plan's scratch comes from NaN-filled memory
        grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
        want = _full_path(lambda: cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal))
        for g, w in zip(grads, want, strict=True):
            g, w = g.astype(cp.float32), w.astype(cp.float32)
            assert bool(cp.isfinite(g).all())
            assert float(cp.abs(g - w).max()) <= 1e-2 * max(1.0, float(cp.abs(w).max()))
    assert sorted(plan.calls for plan in replay.CALLS.entries.values()) == [2, 2]


def test_forward_into_plans_only_contiguous_outputs_and_shares_them():
    q, k, v, _ = _inputs((2, 128, 128, 4, 4, 64), 0)
    wide = cp.empty((2, 128, 8, 64), dtype=q.dtype)
    lse = cp.empty((2, 4, 128), dtype=cp.float32)
    adapter_for(q).forward_into(q, k, v, wide[:, :, :4], lse, None, AttentionOptions())  # out with a wider row: not planned
    assert not replay.CALLS.entries
    out = cp.empty_like(q)
    adapter_for(q).forward_into(q, k, v, out, lse, None, AttentionOptions())
    assert len(replay.CALLS.entries) == 1  # the same key as flash_attn_forward's: it takes this plan
    got = cuflash2.flash_attn_forward(q, k, v)
    (plan,) = replay.CALLS.entries.values()
    assert plan.calls == 1
    _same(got, (out, lse))
    _same((cp.ascontiguousarray(wide[:, :, :4]),), (out,))
