"""Property-based test of the public API on the CPU path: every call either computes the right
answer or is rejected with a clear ValueError / TypeError / NotImplementedError."""

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import cuflash2  # noqa: E402
from cuflash2 import dropout, reference  # noqa: E402

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.int32]


@st.composite
def calls(draw):
    batch = draw(st.integers(0, 2))
    sq, sk = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 2)) + draw(st.sampled_from([0, 0, 0, 1]))  # sometimes not a multiple
    d = draw(st.sampled_from([8, 16, 40, 12, 264]))
    dk = d if draw(st.integers(0, 5)) else d + 8  # sometimes a k/v head dim that differs from q
    dtypes = [draw(st.sampled_from(DTYPES))] * 3
    if draw(st.integers(0, 5)) == 0:
        dtypes[draw(st.integers(1, 2))] = draw(st.sampled_from(DTYPES))
    options = {"causal": draw(st.booleans())}
    if draw(st.integers(0, 3)) == 0:
        options["softmax_scale"] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 0.3]))
    if draw(st.integers(0, 5)) == 0:
        options["dropout_p"] = draw(st.sampled_from([0.1, 0.5, 1.0, -0.2]))
        options["dropout_seed"] = draw(st.integers(0, 2**40))
    if draw(st.integers(0, 2)) == 0:
        options["window_size"] = (draw(st.integers(-2, 6)), draw(st.integers(-2, 6)))
    if draw(st.integers(0, 3)) == 0:
        options["softcap"] = draw(st.sampled_from([0.5, 5.0, -1.0, float("inf")]))
    if draw(st.integers(0, 3)) == 0:
        alibi_shape = draw(st.sampled_from([(h,), (batch, h), (h + 1,)]))
        options["alibi_slopes"] = np.linspace(0.1, 1.0, int(np.prod(alibi_shape))).reshape(alibi_shape).astype(
            draw(st.sampled_from([np.float32, np.float32, np.float64])))
    transpose_k = draw(st.integers(0, 5)) == 0  # a non-contiguous view
    return batch, sq, sk, h, hk, d, dk, dtypes, options, transpose_k


def _arrays(batch, sq, sk, h, hk, d, dk, dtypes, transpose_k, rng):
    q = rng.standard_normal((batch, sq, h, d)).astype(dtypes[0])
    k = rng.standard_normal((batch, sk, hk, dk)).astype(dtypes[1])
    v = rng.standard_normal((batch, sk, hk, dk)).astype(dtypes[2])
    if transpose_k:
        k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return q, k, v


@settings(max_examples=150, deadline=None)
@given(calls())
def test_computed_correctly_or_rejected_clearly(call):
    batch, sq, sk, h, hk, d, dk, dtypes, options, transpose_k = call
    q, k, v = _arrays(batch, sq, sk, h, hk, d, dk, dtypes, transpose_k, np.random.default_rng(0))
    try:
        out, lse, _ = cuflash2.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    except (ValueError, TypeError, NotImplementedError) as exc:
        message = str(exc)
        assert ":" in message and len(message) > 20, message  # names the argument and says what is wrong
        return
    # accepted: it must be a valid problem and the answer must be right
    assert 1 <= d <= 256 and h % hk == 0
    assert np.dtype(q.dtype).name in ("float16", "bfloat16")
    assert 0 <= options.get("dropout_p", 0) < 1 and 0 <= options.get("softcap", 0) < float("inf")
    assert min(options.get("window_size", (-1, -1))) >= -1
    slopes = options.get("alibi_slopes")
    assert slopes is None or (slopes.dtype == np.float32 and slopes.shape in ((h,), (batch, h)))
    scale = options.get("softmax_scale")
    assert out.shape == q.shape and lse.shape == (batch, h, sq)
    if sk == 0 or batch == 0 or sq == 0:
        assert (out.astype(np.float32) == 0).all() and np.isposinf(lse).all()
        return
    keep, rescale = None, 1.0
    if options.get("dropout_p", 0) > 0:
        keep = dropout.keep_mask(np, options["dropout_seed"], 0, batch, h, sq, sk, options["dropout_p"])
        rescale = dropout.rescale(options["dropout_p"])
    ref, ref_lse = reference.attention_naive(q, k, v, softmax_scale=scale, causal=options["causal"],
                                             window_size=options.get("window_size", (-1, -1)),
                                             softcap=options.get("softcap", 0.0), alibi_slopes=slopes,
                                             dropout_mask=keep, dropout_rescale=rescale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.abs(out.astype(np.float64) - ref).max() < 2e-2
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0.0) < 1e-3  # rows that see no key: infinite in both
