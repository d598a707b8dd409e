"""JAX integration on the GPU: jit, grad, and agreement with a float32 reference."""

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
