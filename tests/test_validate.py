"""Input validation (cuflash2/validate.py) and the NumPy path of the public API. CPU only, fast.

Every error must have the right type and a message naming the argument, what was expected and what
was given: the checks below match all three.
"""

import math
import re
import zlib

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import reference
from cuflash2.problem.tensors import (AttentionShape, TensorInfo, check_alignment, softmax_scale_or_default,
                                      validate_out, validate_qkv)
from cuflash2.runtime.device import check_compute_capability

BF16 = ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------------ helpers


def info(shape, dtype="float16", device="cpu", ptr=0, itemsize=2, strides=None):
    """TensorInfo of a contiguous array of `shape` (strides in elements)."""
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    return TensorInfo(tuple(shape), tuple(strides), dtype, device, ptr, itemsize)


def qkv_info(b=2, sq=5, sk=7, hq=4, hk=2, d=64, dtype="float16"):
    return info((b, sq, hq, d), dtype), info((b, sk, hk, d), dtype), info((b, sk, hk, d), dtype)


def raises(error, *fragments):
    """pytest.raises(error) whose message contains every fragment (literally)."""
    return pytest.raises(error, match="(?s)" + "".join(f"(?=.*{re.escape(str(f))})" for f in fragments))


def arrays(rng, b=2, sq=5, sk=7, hq=4, hk=2, d=64, dtype=np.float16):
    q = rng.standard_normal((b, sq, hq, d), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d), dtype=np.float32).astype(dtype)
    return q, k, v


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # fresh, reproducible seed


# ---------------------------------------------------------------------------------- validate_qkv


def test_validate_qkv_returns_problem_size():
    shape = validate_qkv(*qkv_info(b=3, sq=5, sk=9, hq=8, hk=2, d=40))
    assert shape == AttentionShape(3, 5, 9, 8, 2, 40, "float16", 1.0 / math.sqrt(40))
    assert shape.kv_group == 4
    assert validate_qkv(*qkv_info(dtype="bfloat16"), softmax_scale=0.5).softmax_scale == 0.5


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_validate_qkv_ndim(which):
    q, k, v = qkv_info()
    bad = info((2, 5, 64))
    args = {"q": q, "k": k, "v": v, which: bad}
    with raises(ValueError, f"{which}:", "4 dims", "(2, 5, 64)"):
        validate_qkv(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16"])
def test_validate_qkv_unsupported_dtype(dtype):
    q, k, v = qkv_info(dtype=dtype)
    with raises(TypeError, "q:", "float16 or bfloat16", dtype):
        validate_qkv(q, k, v)


@pytest.mark.parametrize("which", ["k", "v"])
def test_validate_qkv_mixed_dtypes(which):
    q, k, v = qkv_info(dtype="float16")
    args = {"q": q, "k": k, "v": v, which: info((2, 7, 2, 64), "bfloat16")}
    with raises(TypeError, f"{which}:", "float16", "same as q", "bfloat16"):
        validate_qkv(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["k", "v"])
def test_validate_qkv_device_mismatch(which):
    q, k, v = (info(x.shape, device="cuda:0") for x in qkv_info())
    args = {"q": q, "k": k, "v": v, which: info((2, 7, 2, 64), device="cuda:1")}
    with raises(ValueError, f"{which}:", "cuda:0", "cuda:1"):
        validate_qkv(args["q"], args["k"], args["v"])


def test_validate_qkv_v_shape_differs_from_k():
    q, k, _ = qkv_info()
    with raises(ValueError, "v:", "(2, 7, 2, 64)", "(2, 8, 2, 64)"):
        validate_qkv(q, k, info((2, 8, 2, 64)))


def test_validate_qkv_batch_mismatch():
    q = info((2, 5, 4, 64))
    kv = info((3, 7, 2, 64))
    with raises(ValueError, "k:", "batch 2", "got 3"):
        validate_qkv(q, kv, kv)


def test_validate_qkv_head_dim_mismatch():
    q = info((2, 5, 4, 64))
    kv = info((2, 7, 2, 32))
    with raises(ValueError, "k:", "head dim 64", "got 32"):
        validate_qkv(q, kv, kv)


def test_validate_qkv_batch_zero_is_allowed():
    q, kv = info((0, 5, 4, 64)), info((0, 7, 2, 64))
    assert validate_qkv(q, kv, kv).batch == 0


def test_validate_qkv_seqlen_q_zero_is_allowed():
    q, kv = info((1, 0, 4, 64)), info((1, 7, 2, 64))
    assert validate_qkv(q, kv, kv).seqlen_q == 0


def test_validate_qkv_seqlen_k_zero_is_allowed():
    q, kv = info((1, 3, 4, 64)), info((1, 0, 2, 64))
    assert validate_qkv(q, kv, kv).seqlen_k == 0


@pytest.mark.parametrize("hq,hk", [(0, 1), (4, 0)])
def test_validate_qkv_zero_heads(hq, hk):
    q, kv = info((1, 3, hq, 64)), info((1, 7, hk, 64))
    with raises(ValueError, "k:", "at least one head", f"q {hq}", f"k {hk}"):
        validate_qkv(q, kv, kv)


def test_validate_qkv_heads_not_divisible():
    q, kv = info((1, 3, 6, 64)), info((1, 7, 4, 64))
    with raises(ValueError, "k:", "multiple of nheads", "(6)", "got 4"):
        validate_qkv(q, kv, kv)


@pytest.mark.parametrize("d", [0, 257, 260, 512])
def test_validate_qkv_head_dim_out_of_range(d):
    q, kv = info((1, 3, 2, d)), info((1, 7, 2, d))
    with raises(ValueError, "q:", "expected head dim 1 to 256", f"got {d}"):
        validate_qkv(q, kv, kv)


@pytest.mark.parametrize("d", [1, 3, 59, 111, 200, 255, 4, 12, 60, 72, 80, 88, 100, 250])
def test_validate_qkv_accepts_head_dims_that_are_not_multiples_of_8(d):
    q, kv = info((1, 3, 2, d), ptr=0x1000), info((1, 7, 1, d), ptr=0x2002)
    shape = validate_qkv(q, kv, kv)
    assert shape.head_dim == d and shape.softmax_scale == pytest.approx(1.0 / math.sqrt(d))


@pytest.mark.parametrize("d", list(range(1, 257)))
def test_validate_qkv_every_supported_head_dim(d):
    q, kv = info((1, 3, 2, d)), info((1, 7, 1, d))
    assert validate_qkv(q, kv, kv).head_dim == d


def test_validate_qkv_checks_pointers_unless_told_not_to():
    q, k, v = qkv_info()
    validate_qkv(TensorInfo(q.shape, q.strides, q.dtype, q.device, data_ptr=2), k, v)  # 2-byte aligned is enough
    q = TensorInfo(q.shape, q.strides, q.dtype, q.device, data_ptr=3)
    with raises(ValueError, "q:", "aligned to 2 bytes", "0x3"):
        validate_qkv(q, k, v)
    validate_qkv(q, k, v, check_pointers=False)


@pytest.mark.parametrize("scale", [0, 0.0, -1, -1e-3, float("nan"), float("inf"), float("-inf")])
def test_validate_qkv_bad_softmax_scale(scale):
    with raises(ValueError, "softmax_scale:", "finite positive", str(float(scale))):
        validate_qkv(*qkv_info(), softmax_scale=scale)


# ------------------------------------------------------------------------- softmax_scale_or_default


@pytest.mark.parametrize("d", [8, 40, 64, 256])
def test_softmax_scale_default_uses_unpadded_head_dim(d):
    assert softmax_scale_or_default(None, d) == pytest.approx(1.0 / math.sqrt(d))


@pytest.mark.parametrize("value", [0.125, 2, np.float32(0.5), np.float64(3.0)])
def test_softmax_scale_accepts_numbers(value):
    result = softmax_scale_or_default(value, 64)
    assert isinstance(result, float) and result == float(value)


@pytest.mark.parametrize("value", ["abc", [1.0], object(), 1j])
def test_softmax_scale_rejects_non_numbers(value):
    with raises(TypeError, "softmax_scale:", "a float or None", type(value).__name__):
        softmax_scale_or_default(value, 64)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_softmax_scale_rejects_non_positive_or_non_finite(value):
    with raises(ValueError, "softmax_scale:", "finite positive", str(float(value))):
        softmax_scale_or_default(value, 64)


# -------------------------------------------------------------------------------- check_alignment


def test_check_alignment_accepts_aligned_contiguous():
    check_alignment("q", info((2, 5, 4, 64), ptr=0x1000))
    check_alignment("q", info((2, 5, 4, 8), ptr=0x10))


def test_check_alignment_base_pointer():
    check_alignment("k", info((2, 5, 4, 64), ptr=0x1008))  # 8-byte aligned: 8-byte accesses
    check_alignment("k", info((2, 5, 4, 64), ptr=0x1002))  # 2-byte aligned: 2-byte accesses
    with raises(ValueError, "k:", "aligned to 2 bytes", "whole elements", "0x1001"):
        check_alignment("k", info((2, 5, 4, 64), ptr=0x1001))


def test_check_alignment_accepts_any_stride():
    # row stride 100 elements = 200 bytes: 8-byte aligned rows, read with 8-byte accesses
    check_alignment("v", info((2, 5, 4, 64), strides=(5 * 104, 100, 64, 1), ptr=0x1000))
    check_alignment("v", info((2, 5, 4, 59), strides=(5 * 4 * 59, 4 * 59, 59, 1), ptr=0x1000))


def test_check_alignment_ignores_strides_of_size_one_dims():
    odd = info((1, 1, 1, 64), strides=(3, 5, 7, 1), ptr=0x1000)
    check_alignment("q", odd)


def test_check_alignment_uses_itemsize():
    check_alignment("q", info((2, 3, 4), strides=(16, 6, 1), itemsize=4, ptr=0x1004))
    with raises(ValueError, "q:", "aligned to 4 bytes", "0x1002"):
        check_alignment("q", info((2, 3, 4), strides=(12, 4, 1), itemsize=4, ptr=0x1002))


# ---------------------------------------------------------------------------------- validate_out


def _shape(b=2, sq=5, sk=7, hq=4, hk=2, d=64, dtype="float16"):
    return AttentionShape(b, sq, sk, hq, hk, d, dtype, 0.125)


def test_validate_out_ok():
    validate_out(info((2, 5, 4, 64)), _shape())


def test_validate_out_wrong_shape():
    with raises(ValueError, "out:", "(2, 5, 4, 64)", "(2, 5, 4, 32)"):
        validate_out(info((2, 5, 4, 32)), _shape())


def test_validate_out_wrong_dtype():
    with raises(TypeError, "out:", "float16", "same as q", "bfloat16"):
        validate_out(info((2, 5, 4, 64), "bfloat16"), _shape())


def test_validate_out_last_dim_not_contiguous():
    bad = info((2, 5, 4, 64), strides=(5 * 4 * 128, 4 * 128, 128, 2))
    with raises(ValueError, "out:", "stride 1", "got stride 2"):
        validate_out(bad, _shape())


def test_validate_out_alignment_checked_unless_told_not_to():
    validate_out(info((2, 5, 4, 64), ptr=0x1002), _shape())
    bad = info((2, 5, 4, 64), ptr=0x1003)
    with raises(ValueError, "out:", "aligned to 2 bytes", "0x1003"):
        validate_out(bad, _shape())
    validate_out(bad, _shape(), check_pointers=False)


# ---------------------------------------------------------------------- check_compute_capability


@pytest.mark.parametrize("major,minor", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_compute_capability_supported(major, minor):
    assert check_compute_capability(major, minor) == major * 10 + minor


@pytest.mark.parametrize("major,minor", [(7, 0), (7, 5), (6, 1), (5, 2)])
def test_compute_capability_too_old(major, minor):
    with raises(RuntimeError, "device:", ">= 8.0", f"got {major}.{minor}"):
        check_compute_capability(major, minor)


# ----------------------------------------------------------------- public API, NumPy inputs: errors


def test_api_wrong_ndim(rng):
    q, k, v = arrays(rng)
    with raises(ValueError, "q:", "4 dims", "(5, 4, 64)"):
        cuflash2.flash_attn_func(q[0], k, v)
    with raises(ValueError, "k:", "4 dims"):
        cuflash2.flash_attn_func(q, k[None], v)


def test_api_float32_is_a_type_error(rng):
    q, k, v = arrays(rng, dtype=np.float32)
    with raises(TypeError, "q:", "float16 or bfloat16", "float32"):
        cuflash2.flash_attn_func(q, k, v)


def test_api_mixed_dtypes(rng):
    q, k, v = arrays(rng)
    with raises(TypeError, "k:", "float16", "bfloat16"):
        cuflash2.flash_attn_func(q, k.astype(BF16), v)
    with raises(TypeError, "v:", "float16", "bfloat16"):
        cuflash2.flash_attn_func(q, k, v.astype(BF16))


def test_api_kv_shape_mismatch(rng):
    q, k, v = arrays(rng)
    with raises(ValueError, "v:", str(k.shape), str(v[:, :-1].shape)):
        cuflash2.flash_attn_func(q, k, v[:, :-1])


def test_api_batch_mismatch(rng):
    q, k, v = arrays(rng, b=2)
    with raises(ValueError, "k:", "batch 2", "got 1"):
        cuflash2.flash_attn_func(q, k[:1], v[:1])


def test_api_head_dim_mismatch(rng):
    q, _, _ = arrays(rng, d=64)
    _, k, v = arrays(rng, d=32)
    with raises(ValueError, "k:", "head dim 64", "got 32"):
        cuflash2.flash_attn_func(q, k, v)


def test_api_heads_not_divisible(rng):
    q, k, v = arrays(rng, hq=6, hk=4)
    with raises(ValueError, "k:", "(6)", "got 4"):
        cuflash2.flash_attn_func(q, k, v)


@pytest.mark.parametrize("d,fragment", [(260, "head dim 1 to 256"), (0, "head dim 1 to 256")])
def test_api_bad_head_dim(rng, d, fragment):
    q, k, v = arrays(rng, d=d)
    with raises(ValueError, "q:", fragment, f"got {d}"):
        cuflash2.flash_attn_func(q, k, v)


@pytest.mark.parametrize("b,sq,sk", [(0, 5, 7), (2, 0, 7), (2, 0, 0), (0, 0, 0)])
def test_api_zero_size_inputs_give_empty_or_zero_results(rng, b, sq, sk):
    q, k, v = arrays(rng, b=b, sq=sq, sk=sk)
    out, lse = cuflash2.flash_attn_forward(q, k, v)
    assert out.shape == q.shape and lse.shape == (b, q.shape[2], sq)
    grads = cuflash2.flash_attn_backward(np.ones_like(out), q, k, v, out, lse)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and not g.astype(np.float32).any()


@pytest.mark.parametrize("scale", [0, -1, float("nan"), float("inf")])
def test_api_bad_softmax_scale(rng, scale):
    q, k, v = arrays(rng)
    with raises(ValueError, "softmax_scale:", "finite positive", str(float(scale))):
        cuflash2.flash_attn_func(q, k, v, softmax_scale=scale)


def _call_packed(func, q, k, v, **kwargs):
    if func == "flash_attn_func":
        return cuflash2.flash_attn_func(q, k, v, **kwargs)
    if func == "flash_attn_kvpacked_func":
        return cuflash2.flash_attn_kvpacked_func(q, np.stack([k, v], axis=2), **kwargs)
    return cuflash2.flash_attn_qkvpacked_func(np.stack([q, k, v], axis=2), **kwargs)


@pytest.mark.parametrize("func", ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"])
def test_api_dropout_on_every_entry_point(rng, func):
    q, k, v = arrays(rng, sq=7, sk=7, hq=2, hk=2)
    a = _call_packed(func, q, k, v, dropout_p=0.4, dropout_seed=3)
    b = _call_packed(func, q, k, v, dropout_p=0.4, dropout_seed=3)
    np.testing.assert_array_equal(a, b)
    with raises(ValueError, "dropout_p:", "< 1", "1.5"):
        _call_packed(func, q, k, v, dropout_p=1.5)


@pytest.mark.parametrize("kwargs", [
    {"window_size": (3, 0)},
    {"window_size": (2, 1), "causal": True},
    {"softcap": 0.5},
    {"alibi_slopes": np.array([[0.5, 0.25], [1.0, 2.0]], np.float32)},
    {"alibi_slopes": np.array([0.5, 0.25], np.float32), "causal": True, "window_size": (4, -1), "softcap": 1.0},
])
@pytest.mark.parametrize("func", ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"])
def test_api_features_on_every_entry_point(rng, kwargs, func):
    q, k, v = arrays(rng, sq=7, sk=7, hq=2, hk=2)
    out = _call_packed(func, q, k, v, **kwargs)
    ref, _ = reference.attention_naive(q, k, v, **kwargs)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=3e-3)


@pytest.mark.parametrize("kwargs,error,fragments", [
    ({"window_size": (-2, 0)}, ValueError, ("window_size:", ">= -1", "(-2, 0)")),
    ({"window_size": (1, 2, 3)}, TypeError, ("window_size:", "pair of ints")),
    ({"window_size": 4}, TypeError, ("window_size:", "pair of ints", "4")),
    ({"softcap": -1.0}, ValueError, ("softcap:", ">= 0", "-1.0")),
    ({"softcap": float("nan")}, ValueError, ("softcap:", "finite", "nan")),
    ({"softcap": "big"}, TypeError, ("softcap:", "float", "str")),
    ({"alibi_slopes": np.ones(3, np.float32)}, ValueError, ("alibi_slopes:", "(2,) or (2, 2)", "(3,)")),
    ({"alibi_slopes": np.ones(2, np.float64)}, TypeError, ("alibi_slopes:", "float32", "float64")),
    ({"alibi_slopes": [0.5, 0.5]}, TypeError, ("alibi_slopes:", "NumPy array", "list")),
])
def test_api_bad_feature_options(rng, kwargs, error, fragments):
    q, k, v = arrays(rng, sq=7, sk=7, hq=2, hk=2)
    with raises(error, *fragments):
        cuflash2.flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("which", ["k", "v"])
def test_api_numpy_q_needs_numpy_kv(rng, which):
    q, k, v = arrays(rng)
    args = {"k": k, "v": v, which: k.tolist()}
    with raises(TypeError, f"{which}:", "NumPy array", "list"):
        cuflash2.flash_attn_func(q, args["k"], args["v"])


def test_api_unknown_array_type():
    with raises(TypeError, "NumPy/CuPy array", "list"):
        cuflash2.flash_attn_func([[1.0]], [[1.0]], [[1.0]])


def test_api_packed_shapes(rng):
    q, k, v = arrays(rng)
    with raises(ValueError, "kv:", "(batch, seqlen, 2, nheads, headdim)", str(k.shape)):
        cuflash2.flash_attn_kvpacked_func(q, k)
    with raises(ValueError, "kv:", "(batch, seqlen, 2, nheads, headdim)"):
        cuflash2.flash_attn_kvpacked_func(q, np.stack([k, v, v], axis=2))
    with raises(ValueError, "qkv:", "(batch, seqlen, 3, nheads, headdim)"):
        cuflash2.flash_attn_qkvpacked_func(np.stack([k, v], axis=2))


def test_api_out_errors(rng):
    q, k, v = arrays(rng)
    with raises(ValueError, "out:", str(q.shape), "(2, 5, 4, 32)"):
        cuflash2.flash_attn_func(q, k, v, out=np.empty((2, 5, 4, 32), np.float16))
    with raises(TypeError, "out:", "float16", "bfloat16"):
        cuflash2.flash_attn_func(q, k, v, out=np.empty(q.shape, BF16))
    with raises(TypeError, "out:", "NumPy array", "list"):
        cuflash2.flash_attn_func(q, k, v, out=q.tolist())
    strided = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float16)[..., ::2]
    with raises(ValueError, "out:", "stride 1", "got stride 2"):
        cuflash2.flash_attn_func(q, k, v, out=strided)


# --------------------------------------------------------------- public API, NumPy inputs: results


def assert_close_to_naive(out, q, k, v, causal=False, softmax_scale=None, atol=1e-2):
    expected, _ = reference.attention_naive(q, k, v, softmax_scale=softmax_scale, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = np.abs(out.astype(np.float64) - expected).max()
    assert err <= atol, f"max error {err:.3e} > {atol}"


CASES = [  # b, sq, sk, hq, hk, d
    (1, 1, 1, 1, 1, 8),
    (2, 17, 17, 2, 2, 64),
    (1, 33, 65, 4, 1, 40),  # MQA, sq < sk
    (2, 70, 23, 6, 2, 32),  # GQA, sq > sk (fully masked rows when causal)
    (1, 129, 130, 2, 2, 128),  # crosses the 64-row/64-key tiles of the reference
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-sq{}-sk{}-h{}:{}-d{}".format(*c))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_api_numpy_matches_naive(rng, case, causal, dtype):
    b, sq, sk, hq, hk, d = case
    q, k, v = arrays(rng, b, sq, sk, hq, hk, d, dtype)
    out = cuflash2.flash_attn_func(q, k, v, causal=causal)
    atol = 1e-2 if dtype == np.float16 else 3e-2  # bf16 rounds the output to 8 bits of mantissa
    assert_close_to_naive(out, q, k, v, causal=causal, atol=atol)


def test_api_numpy_forward_returns_lse(rng):
    q, k, v = arrays(rng, b=2, sq=9, sk=21, hq=4, hk=2, d=32)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    _, expected = reference.attention_naive(q, k, v, causal=True)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 9)
    np.testing.assert_allclose(lse, expected, rtol=1e-4, atol=1e-4)


def test_api_numpy_causal_fully_masked_rows(rng):
    # sq > sk with a bottom-right causal mask: the first sq - sk rows see no key
    q, k, v = arrays(rng, b=1, sq=10, sk=4, hq=2, hk=2, d=16)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    assert not np.isnan(out.astype(np.float32)).any()
    assert (out[:, :6] == 0).all()
    assert np.isposinf(lse[:, :, :6]).all() and np.isfinite(lse[:, :, 6:]).all()
    assert_close_to_naive(out, q, k, v, causal=True)


def test_api_numpy_softmax_scale(rng):
    q, k, v = arrays(rng, sq=12, sk=12, d=64)
    out = cuflash2.flash_attn_func(q, k, v, softmax_scale=0.3)
    assert_close_to_naive(out, q, k, v, softmax_scale=0.3)
    default = cuflash2.flash_attn_func(q, k, v)
    explicit = cuflash2.flash_attn_func(q, k, v, softmax_scale=1 / 8)
    np.testing.assert_array_equal(default, explicit)


@pytest.mark.parametrize("causal", [False, True])
def test_api_numpy_kvpacked(rng, causal):
    q, k, v = arrays(rng, b=2, sq=11, sk=19, hq=4, hk=2, d=48)
    kv = np.stack([k, v], axis=2)
    out = cuflash2.flash_attn_kvpacked_func(q, kv, causal=causal)
    assert_close_to_naive(out, q, k, v, causal=causal)
    np.testing.assert_array_equal(out, cuflash2.flash_attn_func(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_api_numpy_qkvpacked(rng, causal):
    q, k, v = arrays(rng, b=2, sq=13, sk=13, hq=3, hk=3, d=24)
    qkv = np.stack([q, k, v], axis=2)
    out = cuflash2.flash_attn_qkvpacked_func(qkv, causal=causal)
    assert_close_to_naive(out, q, k, v, causal=causal)
    np.testing.assert_array_equal(out, cuflash2.flash_attn_func(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_api_numpy_seqlen_k_zero(rng, dtype):
    q, k, v = arrays(rng, b=2, sq=5, sk=0, hq=4, hk=2, d=32, dtype=dtype)
    out, lse = cuflash2.flash_attn_forward(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.astype(np.float32) == 0).all()
    assert lse.shape == (2, 4, 5) and lse.dtype == np.float32 and np.isposinf(lse).all()
    assert (cuflash2.flash_attn_func(q, k, v, causal=True).astype(np.float32) == 0).all()


def test_api_numpy_out_argument(rng):
    q, k, v = arrays(rng, b=1, sq=9, sk=14, hq=2, hk=1, d=64)
    out = np.full(q.shape, np.nan, np.float16)
    result = cuflash2.flash_attn_func(q, k, v, causal=True, out=out)
    assert result is out
    assert_close_to_naive(out, q, k, v, causal=True)
    packed = np.full(q.shape, np.nan, np.float16)
    assert cuflash2.flash_attn_kvpacked_func(q, np.stack([k, v], axis=2), causal=True, out=packed) is packed
    np.testing.assert_array_equal(packed, out)


def test_api_numpy_return_attn_probs(rng):
    q, k, v = arrays(rng, b=1, sq=6, sk=9, hq=2, hk=1, d=16)
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (1, 2, 6, 9) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-3)
    causal_mask = reference.visible_mask(6, 9, causal=True)
    assert (probs[..., ~causal_mask] == 0).all()
    assert_close_to_naive(out, q, k, v, causal=True)
