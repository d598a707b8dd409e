"""JAX integration on the GPU: jit, grad, varlen and dropout, against float32 references and the CuPy path."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def reference(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    sq, sk = q.shape[1], k.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + sk - sq, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 1])
def test_jit_and_grad_match_reference(causal, heads_kv):
    import cuflash2

    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(1), 4)
    # seqlen_q < seqlen_k: every causal row sees a key, so the plain softmax reference has no NaN rows
    q = jax.random.normal(kq, (2, 97, 4, 64), dtype=jnp.bfloat16)
    k = jax.random.normal(kk, (2, 131, heads_kv, 64), dtype=jnp.bfloat16)
    v = jax.random.normal(kv, (2, 131, heads_kv, 64), dtype=jnp.bfloat16)
    weight = jax.random.normal(kg, q.shape, dtype=jnp.float32)

    def loss(q, k, v):
        return (cuflash2.flash_attn_func(q, k, v, causal=causal).astype(jnp.float32) * weight).sum()

    def loss_ref(q, k, v):
        return (reference(q, k, v, causal) * weight).sum()

    out = jax.jit(lambda q, k, v: cuflash2.flash_attn_func(q, k, v, causal=causal))(q, k, v)
    ref = reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal)
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 2e-2
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, r in zip(grads, grads_ref):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.abs(g.astype(jnp.float32) - r).max()) < 5e-2 * max(1.0, float(jnp.abs(r).max()))


# ---- varlen -------------------------------------------------------------------------------------

# Ragged sequences: an empty one (no queries), one without keys, one with more queries than keys
# (its first causal rows see no key: out 0, LSE +inf).
VARLEN_Q, VARLEN_K = [37, 0, 130, 5, 64], [50, 9, 100, 0, 64]


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _packed(key, lengths, heads, dtype=jnp.bfloat16):
    return jax.random.normal(key, (int(sum(lengths)), heads, 64), dtype=jnp.float32).astype(dtype)


def sequence_reference(q, k, v, causal):
    """float32 (out, lse) of one packed sequence (total, heads, dim), with FA2's convention for rows
    that see no key (out 0, LSE +inf); differentiable without NaN."""
    heads, sq, sk = q.shape[1], q.shape[0], k.shape[0]
    if sk == 0:
        return jnp.zeros(q.shape, jnp.float32), jnp.full((heads, sq), jnp.inf)
    group = heads // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + sk - sq, s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))  # softmax is shift-invariant
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("hqk,khd->qhd", p / jnp.where(total > 0, total, 1.0), v)
    lse = jnp.where(total[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(total[..., 0], 1e-30)), jnp.inf)
    return out, lse


def varlen_reference(q, k, v, lens_q, lens_k, causal):
    """Packed float32 (out, lse) computed one sequence at a time (every row inside a sequence)."""
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    parts = [sequence_reference(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal)
             for b in range(len(lens_q))]
    return jnp.concatenate([o for o, _ in parts]), jnp.concatenate([lse for _, lse in parts], axis=1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_varlen_jit_and_grad_match_per_sequence_reference(causal, heads_kv):
    import cuflash2

    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(2), 4)
    q, k, v = _packed(kq, VARLEN_Q, 4), _packed(kk, VARLEN_K, heads_kv), _packed(kv, VARLEN_K, heads_kv)
    cu_q, cu_k = _cu(VARLEN_Q), _cu(VARLEN_K)
    weight = jax.random.normal(kg, q.shape, dtype=jnp.float32)
    max_q, max_k = max(VARLEN_Q), max(VARLEN_K)

    def attention(q, k, v, cu_q, cu_k):
        return cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)

    def loss(q, k, v, cu_q, cu_k):
        return (attention(q, k, v, cu_q, cu_k).astype(jnp.float32) * weight).sum()

    def loss_ref(q, k, v):
        return (varlen_reference(q, k, v, VARLEN_Q, VARLEN_K, causal)[0] * weight).sum()

    out_jit = jax.jit(attention)(q, k, v, cu_q, cu_k)  # cu_seqlens traced: clamped, outputs pre-filled
    out, lse, probs = cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                      return_attn_probs=True)  # checked on the host
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, q.shape[0])
    assert probs.shape == (len(VARLEN_Q), 4, max_q, max_k)
    np.testing.assert_array_equal(np.asarray(out_jit), np.asarray(out))
    ref, ref_lse = varlen_reference(*(x.astype(jnp.float32) for x in (q, k, v)), VARLEN_Q, VARLEN_K, causal)
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 2e-2
    finite = jnp.isfinite(ref_lse)
    assert bool((jnp.isfinite(lse) == finite).all()), "LSE +inf pattern differs from the reference"
    assert float(jnp.abs(jnp.where(finite, lse - ref_lse, 0.0)).max()) < 2e-3
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu_q, cu_k)
    grads_ref = jax.grad(loss_ref, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, r in zip(grads, grads_ref):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.abs(g.astype(jnp.float32) - r).max()) < 5e-2 * max(1.0, float(jnp.abs(r).max()))


@pytest.mark.parametrize("heads_kv", [2, 1])  # 1: GQA (fp32 dK/dV scratch over the unused rows too)
def test_varlen_rows_past_the_last_sequence_are_zero(heads_kv):
    import cuflash2

    kq, kk = jax.random.split(jax.random.PRNGKey(3))
    q, k = _packed(kq, [50], 2), _packed(kk, [70], heads_kv)
    cu_q, cu_k = _cu([20, 10]), _cu([30, 25])  # rows 30.. of q and 55.. of k belong to no sequence

    def loss(q, k, v, cu_q, cu_k):
        return cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 30, causal=True).astype(jnp.float32).sum()

    for run in (lambda f: f, jax.jit):  # eager (values checked on the host) and traced
        out = run(lambda q, k, cu_q, cu_k: cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 20, 30,
                                                                           causal=True))(q, k, cu_q, cu_k)
        assert not bool(out[30:].astype(jnp.float32).any())
        dq, dk, dv = run(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k, cu_q, cu_k)
        for g, start in ((dq, 30), (dk, 55), (dv, 55)):
            assert not bool(g[start:].astype(jnp.float32).any())
            assert bool(g[:start].astype(jnp.float32).any())
    _, lse, _ = cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 20, 30, causal=True, return_attn_probs=True)
    assert bool(jnp.isposinf(lse[:, 30:]).all())


def test_varlen_packed_functions_match_unpacked():
    import cuflash2

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(4), 3)
    lengths = [17, 200, 1]
    q, k, v = (_packed(key, lengths, 4, jnp.float16) for key in (kq, kk, kv))
    cu = _cu(lengths)
    expected = cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True)
    kvpacked = jax.jit(lambda q, kv, cu: cuflash2.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 200, 200,
                                                                                   causal=True))
    qkvpacked = jax.jit(lambda qkv, cu: cuflash2.flash_attn_varlen_qkvpacked_func(qkv, cu, 200, causal=True))
    np.testing.assert_array_equal(np.asarray(kvpacked(q, jnp.stack([k, v], axis=1), cu)), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(qkvpacked(jnp.stack([q, k, v], axis=1), cu)), np.asarray(expected))


def test_varlen_bad_cu_seqlens_raise_before_any_launch():
    import cuflash2

    q = jnp.zeros((10, 2, 64), jnp.bfloat16)
    good = _cu([4, 6])
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32, got int16"):
        cuflash2.flash_attn_varlen_func(q, q, q, good.astype(jnp.int16), good, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing values"):
        cuflash2.flash_attn_varlen_func(q, q, q, good, jnp.asarray([0, 7, 6], jnp.int32), 6, 7)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected sequences of at most max_seqlen = 5"):
        cuflash2.flash_attn_varlen_func(q, q, q, good, good, 5, 6)


# ---- dropout ------------------------------------------------------------------------------------

def _to_cupy(cp, *arrays):
    return [cp.asarray(np.asarray(x)) for x in arrays]


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_cupy_path_and_masked_reference(causal):
    """Under jit, out and gradients equal the CuPy path's for the same seed (same kernels, same
    arguments), and meet FA2's tolerance rule against an fp32 reference that applies the mask."""
    cp = pytest.importorskip("cupy")
    from attention_ref import attention_features_ref, check_fa2_rule

    import cuflash2
    from cuflash2 import dropout
    from cuflash2.materialize import as_float32

    p, seed = 0.17, 1234
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(5), 4)
    q = jax.random.normal(kq, (2, 150, 4, 64), dtype=jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 211, 2, 64), dtype=jnp.float32).astype(jnp.bfloat16) for key in (kk, kv))
    dout = jax.random.normal(kg, q.shape, dtype=jnp.float32).astype(jnp.bfloat16)
    options = {"causal": causal, "dropout_p": p, "dropout_seed": seed, "deterministic": True}

    def attention(q, k, v):
        return cuflash2.flash_attn_func(q, k, v, **options)

    out, vjp = jax.vjp(jax.jit(attention), q, k, v)
    grads = jax.jit(vjp)(dout)
    qc, kc, vc, dc = _to_cupy(cp, q, k, v, dout)
    kw = {"causal": causal, "dropout_p": p, "dropout_seed": seed}
    out_c, lse_c = cuflash2.flash_attn_forward(qc, kc, vc, **kw)
    grads_c = cuflash2.flash_attn_backward(dc, qc, kc, vc, out_c, lse_c, deterministic=True, **kw)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), cp.asnumpy(out_c).view(np.uint16))
    for g, gc in zip(grads, grads_c):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), cp.asnumpy(gc).view(np.uint16))
    keep = dropout.keep_mask(cp, seed, 0, 2, 4, 150, 211, p)
    f32 = [as_float32(cp, x) for x in (qc, kc, vc, dc)]
    ref_kw = {"causal": causal, "keep": keep, "rescale": dropout.rescale(p)}
    ref = attention_features_ref(cp, *f32, **ref_kw)
    naive = attention_features_ref(cp, *f32, **ref_kw, low_precision="bfloat16")
    check_fa2_rule(cp, "out", cp.asarray(np.asarray(out)), ref[0], naive[0], 2)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref[2:], naive[2:]):
        check_fa2_rule(cp, name, cp.asarray(np.asarray(g)), r, n, 3)


def test_dropout_seed_reproducible_and_keep_rate():
    import cuflash2
    from cuflash2 import dropout

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(6), 3)
    q, k, v = (jax.random.normal(key, (2, 256, 4, 64), dtype=jnp.float32).astype(jnp.bfloat16)
               for key in (kq, kk, kv))

    def grads(seed):
        def loss(q, k, v):
            out = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, dropout_seed=seed)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    a, b, c = grads(3), grads(3), grads(4)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(a[0]) != float(c[0])
    out, _, probs = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True, dropout_seed=5)
    dropped = float((probs < 0).mean())
    expected = dropout.effective_dropout(0.3)
    assert abs(dropped - expected) < 5 * np.sqrt(expected * (1 - expected) / probs.size)
    keep = dropout.keep_mask(np, 5, 0, 2, 4, 256, 256, 0.3)
    np.testing.assert_array_equal(np.asarray(probs) >= 0, keep)
    manual = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(probs > 0, probs, 0) / (1 - expected), v.astype(jnp.float32))
    assert float(jnp.abs(manual - out.astype(jnp.float32)).max()) < 2e-2
    with pytest.raises(ValueError, match="dropout_seed: expected an int under jax.jit"):  # would repeat its mask
        jax.jit(lambda q: cuflash2.flash_attn_func(q, k, v, dropout_p=0.3))(q)


def test_varlen_features_and_dropout_match_cupy_path():
    """Varlen with every feature (window, softcap, per-sequence ALiBi, dropout, GQA, an empty
    sequence) under jit: out and gradients equal the CuPy path's bit for bit."""
    cp = pytest.importorskip("cupy")
    import cuflash2

    lengths = [7, 130, 0, 64]
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(7), 4)
    q, dout = _packed(kq, lengths, 4, jnp.float16), _packed(kg, lengths, 4, jnp.float16)
    k, v = _packed(kk, lengths, 2, jnp.float16), _packed(kv, lengths, 2, jnp.float16)
    cu = _cu(lengths)
    slopes = jnp.linspace(0.05, 0.6, 16, dtype=jnp.float32).reshape(4, 4)
    kw = {"causal": True, "window_size": (40, -1), "softcap": 5.0, "dropout_p": 0.25, "dropout_seed": 21}

    def attention(q, k, v, cu, slopes):
        return cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, alibi_slopes=slopes, deterministic=True,
                                               **kw)

    out, vjp = jax.vjp(lambda q, k, v: jax.jit(attention)(q, k, v, cu, slopes), q, k, v)
    grads = jax.jit(vjp)(dout)
    qc, kc, vc, dc, cu_c, slopes_c = _to_cupy(cp, q, k, v, dout, cu, slopes)
    out_c, lse_c = cuflash2.flash_attn_varlen_forward(qc, kc, vc, cu_c, cu_c, 130, 130, alibi_slopes=slopes_c, **kw)
    grads_c = cuflash2.flash_attn_varlen_backward(dc, qc, kc, vc, out_c, lse_c, cu_c, cu_c, 130, 130,
                                                  alibi_slopes=slopes_c, deterministic=True, **kw)
    np.testing.assert_array_equal(np.asarray(out), cp.asnumpy(out_c))
    for g, gc in zip(grads, grads_c):
        np.testing.assert_array_equal(np.asarray(g), cp.asnumpy(gc))
