"""`causal` and `deterministic` must be bools at every public entry point (CPU: the NumPy path)."""

import numpy as np
import pytest

import cuflash2
from cuflash2.problem.tensors import check_bool


def _qkv(seqlen=16, heads=2, dim=32):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, seqlen, heads, dim)).astype(np.float16) for _ in range(3))


def _varlen(seqlen=16, heads=2, dim=32):
    q, k, v = (x[0] for x in _qkv(seqlen, heads, dim))
    cu = np.array([0, 7, seqlen], dtype=np.int32)
    return q, k, v, cu


def test_check_bool_accepts_bools_and_numpy_bools():
    assert check_bool("causal", True) is True
    assert check_bool("causal", False) is False
    assert check_bool("causal", np.bool_(True)) is True


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0, [True]])
def test_check_bool_rejects_other_types(value):
    with pytest.raises(TypeError, match=rf"^causal: expected bool, got {type(value).__name__}$"):
        check_bool("causal", value)


def _calls():
    q, k, v = _qkv()
    out, lse = cuflash2.flash_attn_forward(q, k, v)
    dout = np.ones_like(q)
    vq, vk, vv, cu = _varlen()
    vout, vlse = cuflash2.flash_attn_varlen_forward(vq, vk, vv, cu, cu, 9, 9)
    return {
        "flash_attn_func": (lambda **o: cuflash2.flash_attn_func(q, k, v, **o), ("causal", "deterministic")),
        "flash_attn_kvpacked_func": (lambda **o: cuflash2.flash_attn_kvpacked_func(q, np.stack([k, v], 2), **o),
                                     ("causal", "deterministic")),
        "flash_attn_qkvpacked_func": (lambda **o: cuflash2.flash_attn_qkvpacked_func(np.stack([q, k, v], 2), **o),
                                      ("causal", "deterministic")),
        "flash_attn_forward": (lambda **o: cuflash2.flash_attn_forward(q, k, v, **o), ("causal",)),
        "attention_probs": (lambda **o: cuflash2.attention_probs(q, k, lse, **o), ("causal",)),
        "flash_attn_backward": (lambda **o: cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **o),
                                ("causal", "deterministic")),
        "flash_attn_varlen_func": (lambda **o: cuflash2.flash_attn_varlen_func(vq, vk, vv, cu, cu, 9, 9, **o),
                                   ("causal", "deterministic")),
        "flash_attn_varlen_kvpacked_func": (lambda **o: cuflash2.flash_attn_varlen_kvpacked_func(
            vq, np.stack([vk, vv], 1), cu, cu, 9, 9, **o), ("causal", "deterministic")),
        "flash_attn_varlen_qkvpacked_func": (lambda **o: cuflash2.flash_attn_varlen_qkvpacked_func(
            np.stack([vq, vk, vv], 1), cu, 9, **o), ("causal", "deterministic")),
        "flash_attn_varlen_forward": (lambda **o: cuflash2.flash_attn_varlen_forward(vq, vk, vv, cu, cu, 9, 9, **o),
                                      ("causal",)),
        "varlen_attention_probs": (lambda **o: cuflash2.varlen_attention_probs(vq, vk, vlse, cu, cu, 9, 9, **o),
                                   ("causal",)),
        "flash_attn_varlen_backward": (lambda **o: cuflash2.flash_attn_varlen_backward(
            np.ones_like(vq), vq, vk, vv, vout, vlse, cu, cu, 9, 9, **o), ("causal", "deterministic")),
        "flash_attn_with_kvcache": (lambda **o: cuflash2.flash_attn_with_kvcache(q, k, v, **o), ("causal",)),
    }


CASES = [(name, flag) for name, flags in [
    ("flash_attn_func", ("causal", "deterministic")), ("flash_attn_kvpacked_func", ("causal", "deterministic")),
    ("flash_attn_qkvpacked_func", ("causal", "deterministic")), ("flash_attn_forward", ("causal",)),
    ("attention_probs", ("causal",)), ("flash_attn_backward", ("causal", "deterministic")),
    ("flash_attn_varlen_func", ("causal", "deterministic")), ("flash_attn_varlen_forward", ("causal",)),
    ("flash_attn_varlen_kvpacked_func", ("causal", "deterministic")),
    ("flash_attn_varlen_qkvpacked_func", ("causal", "deterministic")),
    ("varlen_attention_probs", ("causal",)), ("flash_attn_varlen_backward", ("causal", "deterministic")),
    ("flash_attn_with_kvcache", ("causal",))] for flag in flags]


@pytest.mark.parametrize("name,flag", CASES)
@pytest.mark.parametrize("value", [1, "true"])
def test_public_functions_reject_non_bool_flags(name, flag, value):
    call, flags = _calls()[name]
    assert flag in flags
    with pytest.raises(TypeError, match=rf"{flag}: expected bool, got {type(value).__name__}"):
        call(**{flag: value})


@pytest.mark.parametrize("name", sorted({name for name, _ in CASES}))
def test_public_functions_accept_bools(name):
    call, flags = _calls()[name]
    for flag in flags:
        call(**{flag: True})
        call(**{flag: np.bool_(False)})


def test_every_public_function_with_a_flag_is_covered():
    import inspect

    with_flags = {name for name in cuflash2.__all__
                  if {"causal", "deterministic"} & set(inspect.signature(getattr(cuflash2, name)).parameters)}
    assert with_flags == {name for name, _ in CASES}
