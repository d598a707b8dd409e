"""CPU checks of the chunked / sampled references in reliability_helpers.py against the whole-matrix
references of tests/attention_ref.py (the scale tests rely on them and run only on a GPU)."""

import numpy as np
import pytest
from attention_ref import attention_backward_ref, attention_ref
from reliability_helpers import head_backward_ref, head_forward_ref, sample_indices


def _inputs(sq, sk, heads, d, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32) for s in
            ((1, sq, heads, d), (1, sk, heads, d), (1, sk, heads, d), (1, sq, heads, d))]


@pytest.mark.parametrize("low_precision", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37), (40, 40), (1, 9)])
def test_head_references_match_whole_matrix_references(sq, sk, causal, low_precision):
    q, k, v, dout = _inputs(sq, sk, 2, 16, sq * 100 + sk)
    scale = 0.3
    ref_out, ref_lse = attention_ref(np, q, k, v, causal, scale, low_precision=low_precision)
    grads = attention_backward_ref(np, q, k, v, dout, causal, scale, low_precision=low_precision)
    rows, cols = sample_indices(sq, 7, 1, block=16), sample_indices(sk, 7, 2, block=16)
    tol = {"rtol": 1e-5, "atol": 1e-6} if low_precision is None else {"rtol": 2e-2, "atol": 2e-2}
    for h in range(2):
        qh, kh, vh, doh = (x[0, :, h, :] for x in (q, k, v, dout))
        out, lse, _, _ = head_forward_ref(np, qh, kh, vh, causal, scale, low_precision, round_logits=True, chunk=16)
        np.testing.assert_allclose(out, ref_out[0, :, h], **tol)
        if low_precision is None:
            np.testing.assert_allclose(lse, ref_lse[0, h], rtol=1e-5, atol=1e-6)
        out_b, _, row_max, row_sum = head_forward_ref(np, qh, kh, vh, causal, scale, low_precision, chunk=16)
        dq, dk, dv = head_backward_ref(np, qh, kh, vh, doh, out_b, row_max, row_sum, rows, cols, causal, scale,
                                       low_precision)
        np.testing.assert_allclose(dq, grads[0][0, rows, h], **tol)
        np.testing.assert_allclose(dk, grads[1][0, cols, h], **tol)
        np.testing.assert_allclose(dv, grads[2][0, cols, h], **tol)


def test_sample_indices_cover_ends_and_block_edges():
    idx = sample_indices(1000, 10, 0, block=128)
    assert {0, 1, 127, 128, 998, 999, 895, 896}.issubset(set(idx.tolist()))
    assert list(idx) == sorted(set(idx.tolist())) and idx.max() < 1000
    assert sample_indices(1, 5, 0).tolist() == [0]
