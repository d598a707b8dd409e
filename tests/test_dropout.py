"""Attention dropout on the CPU: the Philox generator against its published known answers, the
mask's statistics, and the NumPy path (forward, marked probabilities, gradients by finite
differences). CPU only."""

import math

import numpy as np
import pytest

import cuflash2
from cuflash2 import dropout, reference


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    """Philox4x32-10 known-answer vectors of the Random123 distribution."""
    words = dropout.philox4x32_10(np, *counter, *key)
    assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_matches_effective_probability(p):
    keep = dropout.keep_mask(np, seed=123, offset=0, batch=2, nheads=4, seqlen_q=96, seqlen_k=160, p=p)
    n = keep.size
    expected = 1 - dropout.effective_dropout(p)
    sigma = math.sqrt(expected * (1 - expected) / n)
    assert abs(keep.mean() - expected) < 5 * sigma
    assert abs(dropout.effective_dropout(p) - p) <= 2.0 ** -17  # 16-bit numbers: p to within 2^-17


def test_masks_differ_across_heads_batches_seeds_and_offsets():
    base = dropout.keep_mask(np, 7, 0, 2, 2, 32, 48, 0.5)
    assert (base[0, 0] != base[0, 1]).mean() > 0.3 and (base[0, 0] != base[1, 0]).mean() > 0.3
    assert (base != dropout.keep_mask(np, 8, 0, 2, 2, 32, 48, 0.5)).mean() > 0.3
    assert (base != dropout.keep_mask(np, 7, 1, 2, 2, 32, 48, 0.5)).mean() > 0.3
    np.testing.assert_array_equal(base, dropout.keep_mask(np, 7, 0, 2, 2, 32, 48, 0.5))


def test_threshold_bounds():
    assert dropout.dropout_threshold(0.0) == 0
    assert dropout.dropout_threshold(1e-6) == 1  # any p > 0 drops something
    assert dropout.dropout_threshold(0.999) == 65470
    assert dropout.dropout_threshold(0.9999999) == 65535  # always keeps something


@pytest.mark.parametrize("p", [0.17, 0.1, 0.013, 0.5, 0.95])
def test_probability_applied_to_within_2_pow_16(p):
    """The kernels' drop probability is the requested one to within 2^-17 (flash-attn's tests build
    their reference with p itself), and kept entries are scaled by 1 / (1 - p) exactly."""
    assert abs(dropout.effective_dropout(p) - p) <= 2.0 ** -17
    assert dropout.rescale(p) == 1.0 / (1.0 - p)


def test_mask_entries_follow_the_documented_philox_layout():
    """Each entry recomputed on its own from the documented (group, number) mapping."""
    seed, offset, p = (0x1234_5678_9ABC_DEF1, 77, 0.3)
    keep = dropout.keep_mask(np, seed, offset, batch=2, nheads=3, seqlen_q=5, seqlen_k=70, p=p)
    threshold = round(p * 65536)
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, h, row, col = (int(rng.integers(n)) for n in (2, 3, 5, 70))
        group = 4 * (col // 32) + (col // 2) % 4
        words = dropout.philox4x32_10(np, group, row, b * 3 + h, offset, seed & 0xFFFFFFFF, seed >> 32)
        number = 2 * ((col // 8) % 4) + col % 2
        value = (int(words[number // 2]) >> (16 * (number % 2))) & 0xFFFF
        assert keep[b, h, row, col] == (value >= threshold)


def _inputs(seed=0, b=2, sq=9, sk=13, h=2, d=16, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d))]


def test_forward_uses_the_marked_probabilities():
    q, k, v = (x.astype(np.float16) for x in _inputs())
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True,
                                               dropout_seed=99)
    rescale = 1 / (1 - 0.3)
    kept = np.where(probs > 0, probs, 0) * rescale
    expected = np.einsum("bhqk,bkhd->bqhd", kept, v.astype(np.float64))
    np.testing.assert_allclose(out.astype(np.float64), expected, atol=3e-3)
    assert (probs < 0).any() and (probs > 0).any()
    again = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, dropout_seed=99)
    np.testing.assert_array_equal(again, out)
    other = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, dropout_seed=100)
    assert np.abs(other.astype(np.float32) - out.astype(np.float32)).max() > 1e-3


def test_gradients_with_a_fixed_mask_match_finite_differences():
    q, k, v = (x.astype(np.float64) for x in _inputs(1, b=1, sq=5, sk=7, d=8))
    keep = dropout.keep_mask(np, 5, 0, 1, 2, 5, 7, 0.4)
    rescale = 1 / (1 - 0.4)
    dout = np.random.default_rng(2).standard_normal(q.shape)

    def loss(q, k, v):
        out, _ = reference.attention_naive(q, k, v, causal=True, dropout_mask=keep, dropout_rescale=rescale)
        return float((out * dout).sum())

    out, lse = reference.attention_naive(q, k, v, causal=True, dropout_mask=keep, dropout_rescale=rescale)
    grads = reference.attention_backward_naive(dout, q, k, v, out, lse, causal=True, dropout_mask=keep,
                                               dropout_rescale=rescale)
    eps = 1e-6
    for which, grad in enumerate(grads):
        args = [q, k, v]
        numeric = np.zeros_like(args[which])
        for idx in np.ndindex(args[which].shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, atol=1e-6)


def test_numpy_backward_path_with_dropout():
    q, k, v = (x.astype(np.float16) for x in _inputs(3))
    out, lse = cuflash2.flash_attn_forward(q, k, v, dropout_p=0.2, dropout_seed=4)
    dout = np.ones_like(out)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, dropout_p=0.2, dropout_seed=4)
    keep = dropout.keep_mask(np, 4, 0, 2, 2, 9, 13, 0.2)
    expected = reference.attention_backward_naive(dout, q, k, v, out, lse, dropout_mask=keep,
                                                  dropout_rescale=1 / (1 - 0.2))
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.astype(np.float64), e, atol=2e-3)


@pytest.mark.parametrize("kwargs,error,fragment", [
    ({"dropout_p": 1.0}, ValueError, "0 <= dropout_p < 1"),
    ({"dropout_p": -0.1}, ValueError, "0 <= dropout_p < 1"),
    ({"dropout_p": float("nan")}, ValueError, "0 <= dropout_p < 1"),
    ({"dropout_p": "0.1"}, None, None),
    ({"dropout_p": 0.1, "dropout_seed": "x"}, TypeError, "dropout_seed: expected an int"),
    ({"dropout_p": 0.1, "dropout_seed": -1}, ValueError, "dropout_seed"),
])
def test_dropout_argument_errors(kwargs, error, fragment):
    q, k, v = (x.astype(np.float16) for x in _inputs())
    if error is None:  # a numeric string is accepted as float() accepts it
        cuflash2.flash_attn_func(q, k, v, **kwargs)
        return
    with pytest.raises(error, match=fragment):
        cuflash2.flash_attn_func(q, k, v, **kwargs)


def test_numpy_path_refuses_a_device_rng_state():
    q, k, v = (x.astype(np.float16) for x in _inputs())
    with pytest.raises(TypeError, match="dropout_rng_state: expected None for NumPy arrays"):
        cuflash2.flash_attn_forward(q, k, v, dropout_p=0.1, dropout_rng_state=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="dropout_seed: expected None when dropout_rng_state is given"):
        cuflash2.flash_attn_forward(q, k, v, dropout_p=0.1, dropout_seed=3, dropout_rng_state=np.zeros(2, np.int64))


def test_explicit_forward_needs_a_seed():
    q, k, v = (x.astype(np.float16) for x in _inputs())
    with pytest.raises(ValueError, match="dropout_seed: expected an int with dropout_p > 0"):
        cuflash2.flash_attn_forward(q, k, v, dropout_p=0.1)


def test_varlen_numpy_dropout_matches_per_sequence_masks():
    q, k, v = (x[0].astype(np.float16) for x in _inputs(5, b=1, sq=20, sk=20))
    cu = np.array([0, 8, 20], np.int32)
    out, lse, probs = cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, dropout_p=0.5, causal=True,
                                                      return_attn_probs=True, dropout_seed=11)
    rescale = 1 / (1 - 0.5)
    for b, (s, e) in enumerate(((0, 8), (8, 20))):
        n = e - s
        kept = np.where(probs[b, :, :n, :n] > 0, probs[b, :, :n, :n], 0) * rescale
        expected = np.einsum("hqk,khd->qhd", kept, v[s:e].astype(np.float64))
        np.testing.assert_allclose(out[s:e].astype(np.float64), expected, atol=3e-3)
