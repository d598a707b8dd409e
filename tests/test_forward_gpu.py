"""Forward kernel on the GPU against fp32 references, with FA2's tolerance rule."""


import ml_dtypes
import numpy as np
import pytest

from attention_ref import attention_ref, stable_seed

from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu

HEAD_DIMS = (8, 16, 32, 40, 64, 72, 80, 96, 128, 136, 160, 192, 224, 256)
SEQLENS = ((1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (127, 513), (513, 127),
           (1023, 1024), (1024, 1023), (2048, 2048))
NP_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def make_inputs(cp, batch, sq, sk, heads, heads_kv, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    shapes = ((batch, sq, heads, head_dim), (batch, sk, heads_kv, head_dim), (batch, sk, heads_kv, head_dim))
    return [cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(NP_DTYPES[dtype])) for s in shapes]


def check_forward(cp, q, k, v, causal, softmax_scale=None):
    import cuflash2

    out, lse = cuflash2.flash_attn_forward(q, k, v, softmax_scale=softmax_scale, causal=causal)
    q32, k32, v32 = (as_float32(cp, x) for x in (q, k, v))
    ref, ref_lse = attention_ref(cp, q32, k32, v32, causal, softmax_scale)
    naive, _ = attention_ref(cp, q32, k32, v32, causal, softmax_scale, low_precision=np.dtype(q.dtype).name)
    out32 = as_float32(cp, out)
    assert not bool(cp.isnan(out32).any()), "NaN in output"
    err = float(cp.abs(out32 - ref).max())
    naive_err = float(cp.abs(naive - ref).max())
    assert err <= 2 * naive_err + 1e-5, f"max error {err:.3e} > 2 x naive {naive_err:.3e}"
    finite = cp.isfinite(ref_lse)
    assert bool((cp.isfinite(lse) == finite).all()), "LSE +inf pattern differs from reference"
    lse_err = float(cp.abs(cp.where(finite, lse - ref_lse, 0)).max())
    assert lse_err <= 1e-3 * max(1.0, float(cp.abs(cp.where(finite, ref_lse, 0)).max())), f"LSE error {lse_err}"
    return out, lse


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_matches_reference(head_dim, seqlens, causal, dtype):
    import cupy as cp

    sq, sk = seqlens
    seed = stable_seed(head_dim, sq, sk, causal, dtype)
    q, k, v = make_inputs(cp, 1 if sq * sk > 1 << 20 else 2, sq, sk, 4, 4, head_dim, dtype, seed)
    check_forward(cp, q, k, v, causal)


@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_gqa_mqa(heads, heads_kv, causal, head_dim):
    import cupy as cp

    q, k, v = make_inputs(cp, 2, 173, 301, heads, heads_kv, head_dim, "bf16", heads * 7 + heads_kv)
    check_forward(cp, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_large_batch_and_custom_scale(causal):
    import cupy as cp

    q, k, v = make_inputs(cp, 48, 97, 131, 2, 2, 64, "fp16", 5)
    check_forward(cp, q, k, v, causal, softmax_scale=0.3)


def test_forward_strided_views():
    """Row/head/batch strides are passed to the kernel; a non-unit last stride is copied."""
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 130, 150, 4, 4, 64, "bf16", 11)
    qkv = cp.concatenate([q[:, :130], k[:, :130], v[:, :130]], axis=2).reshape(2, 130, 3, 4, 64)
    out = cuflash2.flash_attn_qkvpacked_func(qkv, causal=True)
    expected = cuflash2.flash_attn_func(*(cp.ascontiguousarray(qkv[:, :, i]) for i in range(3)), causal=True)
    assert bool((out == expected).all())
    q_t = cp.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # last stride != 1
    assert bool((cuflash2.flash_attn_func(q_t, k, v) == cuflash2.flash_attn_func(q, k, v)).all())


def test_forward_is_deterministic():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 1000, 1000, 4, 2, 128, "bf16", 3)
    first = cuflash2.flash_attn_func(q, k, v, causal=True)
    for _ in range(5):
        assert bool((cuflash2.flash_attn_func(q, k, v, causal=True) == first).all())


def test_nan_does_not_leak_across_heads():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 300, 300, 4, 4, 64, "bf16", 9)
    k_host = cp.asnumpy(k)
    k_host[1, 17, 2, 5] = np.nan
    k = cp.asarray(k_host)
    out = as_float32(cp, cuflash2.flash_attn_func(q, k, v))
    poisoned = cp.zeros(out.shape, dtype=bool)
    poisoned[1, :, 2, :] = True
    assert bool(cp.isnan(out[1, :, 2]).all())
    assert not bool(cp.isnan(out[~poisoned]).any())


def test_fully_masked_rows_give_zero_and_inf_lse():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 1, 200, 50, 2, 2, 64, "bf16", 4)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    assert bool((as_float32(cp, out[:, :150]) == 0).all())
    assert bool(cp.isinf(lse[:, :, :150]).all()) and bool((lse[:, :, :150] > 0).all())
    assert bool(cp.isfinite(lse[:, :, 150:]).all())


def test_out_argument_and_zero_length_keys():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 1, 64, 80, 2, 2, 64, "bf16", 8)
    out = cp.empty(q.shape, dtype=q.dtype)
    out.view(cp.uint16).fill(0x40E0)  # 7.0 in bf16: a sentinel the kernel must overwrite
    result = cuflash2.flash_attn_func(q, k, v, out=out)
    assert result is out
    assert bool((out == cuflash2.flash_attn_func(q, k, v)).all())
    out0, lse0 = cuflash2.flash_attn_forward(q, k[:, :0], v[:, :0])
    assert bool((as_float32(cp, out0) == 0).all()) and bool(cp.isinf(lse0).all())


def test_return_attn_probs_rows_sum_to_one():
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 1, 33, 47, 2, 1, 32, "fp16", 2)
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs.shape == (1, 2, 33, 47)
    assert float(cp.abs(probs.sum(-1) - 1).max()) < 1e-3


def test_torch_roundtrip_on_side_stream():
    torch = pytest.importorskip("torch")
    import cuflash2

    q, k, v = (torch.randn(2, 257, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=True
    ).transpose(1, 2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = cuflash2.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_jax_roundtrip():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    import cuflash2

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, 129, 2, 64), dtype=jnp.float16) for key in keys)
    out = cuflash2.flash_attn_func(q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == jnp.float16
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) / 8.0
    ref = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 1e-2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("seqlens", [(2048, 2048), (2304, 2304), (1024, 2304)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_causal_head_dim_256_tiles_on_both_sides_of_the_short_limit(seqlens, dtype):
    """Causal head dim 256 switches tiles at FWD_SHORT_SEQLEN (the longer of the two lengths; 64x64
    on sm_90 up to it, 128x64 beyond): both tiles, in the grouped grid order, against the reference."""
    import cupy as cp

    sq, sk = seqlens
    q, k, v = make_inputs(cp, 1, sq, sk, 3, 3, 256, dtype, stable_seed("short-limit", sq, sk, dtype))
    check_forward(cp, q, k, v, True)
