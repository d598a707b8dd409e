"""JAX path without a GPU: validation, tracing under jit/grad (shapes, the static arguments the
callbacks get) and the device-side clamping of traced cu_seqlens. Nothing here launches a kernel;
skipped where JAX is not installed."""

import numpy as np
import pytest

import cuflash2

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax_ops = pytest.importorskip("cuflash2.frameworks.jax_adapter")


def _callbacks(fn, *args):
    """The functools.partial of every buffer_callback in the traced computation, in order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "buffer_callback":
                found.append(eqn.params["callback"])
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _varlen_inputs():
    q = jnp.zeros((100, 4, 64), jnp.bfloat16)
    k = jnp.zeros((90, 2, 64), jnp.bfloat16)
    return q, k, _cu([40, 0, 60]), _cu([30, 30, 30])


def test_varlen_traces_under_jit_and_grad():
    q, k, cu_q, cu_k = _varlen_inputs()

    def attention(q, k, v, cu_q, cu_k):
        return jax_ops.varlen_forward(q, k, v, cu_q, cu_k, 60, 30, None, True, (-1, -1), 0.0, None, False)

    out, lse = jax.eval_shape(jax.jit(attention), q, k, k, cu_q, cu_k)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (4, 100), jnp.float32)

    def loss(q, k, v, cu_q, cu_k):
        return attention(q, k, v, cu_q, cu_k)[0].astype(jnp.float32).sum()

    grads = jax.eval_shape(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, k, cu_q, cu_k)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype)]


def test_varlen_packed_functions_trace():
    q, k, cu_q, cu_k = _varlen_inputs()
    kv = jax.eval_shape(lambda q, kv: cuflash2.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 60, 30), q,
                        jnp.stack([k, k], axis=1))
    assert kv.shape == q.shape
    qkv = jax.eval_shape(lambda qkv: cuflash2.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 60),
                         jnp.stack([q, q, q], axis=1))
    assert qkv.shape == q.shape


def test_varlen_prefills_outputs_unless_cu_seqlens_were_checked():
    q, k, cu_q, cu_k = _varlen_inputs()

    def call(cu_q, cu_k):
        return lambda q: cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 60, 30)

    traced = _callbacks(lambda q, cu_q, cu_k: call(cu_q, cu_k)(q), q, cu_q, cu_k)
    covering = _callbacks(call(cu_q, cu_k), q)  # concrete: checked on the host, every row covered
    short = _callbacks(call(_cu([40, 0, 50]), cu_k), q)  # rows 90.. of q in no sequence
    assert [c.keywords["problem"].prefill for c in traced + covering + short] == [True, False, True]
    problem = covering[0].keywords["problem"]
    assert (problem.shape.batch, problem.shape.seqlen_q, problem.shape.seqlen_k) == (3, 60, 30)
    assert (problem.total_q, problem.total_k) == (100, 90)


def test_traced_cu_seqlens_are_clamped_into_the_packed_tensors():
    def clamp(cu):
        return jax_ops._checked_cu_seqlens("cu_seqlens_q", cu, 10, 5, 3)[0]

    clamped = jax.jit(clamp)(jnp.asarray([3, 12, 7, -4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(clamped), [3, 10, 10, 10])


def test_dropout_backward_gets_the_forward_seed():
    q = jnp.zeros((2, 50, 4, 64), jnp.float16)

    def loss(q):
        return cuflash2.flash_attn_func(q, q, q, dropout_p=0.2, causal=True, dropout_seed=77).astype(jnp.float32).sum()

    forward, backward = _callbacks(jax.grad(loss), q)
    assert forward.keywords["options"] == backward.keywords["options"]
    assert forward.keywords["options"][3] == (0.2, 77, 0)
    seeded = _callbacks(lambda q: cuflash2.flash_attn_func(q, q, q, dropout_p=0.2, dropout_seed=9), q)
    assert seeded[0].keywords["options"][3] == (0.2, 9, 0)


def test_plain_call_has_no_dropout():
    q = jnp.zeros((1, 8, 2, 64), jnp.float16)
    (forward,) = _callbacks(lambda q: cuflash2.flash_attn_func(q, q, q), q)
    assert forward.keywords["options"] == ((-1, -1), 0.0, None, (0.0, 0, 0))


def _raises(error, match, fn):
    with pytest.raises(error, match=match):
        fn()


def test_varlen_errors_name_the_argument():
    q, k, cu_q, cu_k = _varlen_inputs()
    f = cuflash2.flash_attn_varlen_func
    _raises(TypeError, "cu_seqlens_q: expected a JAX int32 array like q, got ndarray",
            lambda: f(q, k, k, np.asarray(cu_q), cu_k, 60, 30))
    _raises(TypeError, "cu_seqlens_k: expected dtype int32, got int16", lambda: f(q, k, k, cu_q, cu_k.astype(jnp.int16),
                                                                                 60, 30))
    _raises(ValueError, r"cu_seqlens_q: expected shape \(batch \+ 1,\)", lambda: f(q, k, k, cu_q[None], cu_k, 60, 30))
    _raises(ValueError, "cu_seqlens_k: expected 4 entries", lambda: f(q, k, k, cu_q, cu_k[:3], 60, 30))
    _raises(ValueError, "cu_seqlens_q: expected non-decreasing values",
            lambda: f(q, k, k, jnp.asarray([0, 50, 40, 100], jnp.int32), cu_k, 60, 30))
    _raises(ValueError, "cu_seqlens_q: expected sequences of at most max_seqlen = 50, got one of 60",
            lambda: f(q, k, k, cu_q, cu_k, 50, 30))
    _raises(ValueError, "cu_seqlens_k: expected the last entry <= 90",
            lambda: f(q, k, k, cu_q, jnp.asarray([0, 30, 60, 91], jnp.int32), 60, 31))
    _raises(TypeError, "max_seqlen_q: expected an int, got float", lambda: f(q, k, k, cu_q, cu_k, 60.0, 30))
    _raises(ValueError, r"q: expected 3 dims \(total_seqlen, nheads, headdim\)",
            lambda: f(q[None], k, k, cu_q, cu_k, 60, 30))
    _raises(ValueError, r"alibi_slopes: expected shape \(4,\) or \(3, 4\), got \(2, 4\)",
            lambda: f(q, k, k, cu_q, cu_k, 60, 30, alibi_slopes=jnp.zeros((2, 4), jnp.float32)))
    _raises(TypeError, "out: JAX arrays are immutable", lambda: f(q, k, k, cu_q, cu_k, 60, 30, out=q))


def test_traced_calls_reject_what_needs_concrete_arrays():
    q, k, cu_q, cu_k = _varlen_inputs()
    _raises(NotImplementedError, "return_attn_probs: with JAX arrays it needs concrete arrays",
            lambda: jax.jit(lambda q: cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 60, 30,
                                                                      return_attn_probs=True))(q))
    dense = q.reshape(1, 100, 4, 64)
    _raises(NotImplementedError, "return_attn_probs: with JAX arrays it needs concrete arrays",
            lambda: jax.jit(lambda q: cuflash2.flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True))(dense))
    _raises(TypeError, "dropout_seed: expected an int",
            lambda: jax.jit(lambda q, s: cuflash2.flash_attn_func(q, q, q, dropout_p=0.1, dropout_seed=s))(dense, 3))


def test_static_flags_and_array_types_are_checked_before_tracing_further():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="causal: expected a Python bool"):
        jax.make_jaxpr(lambda q, c: cuflash2.flash_attn_func(q, q, q, causal=c))(q, True)
    with pytest.raises(TypeError, match="k: expected a JAX array like q, got ndarray"):
        jax.make_jaxpr(lambda q: cuflash2.flash_attn_func(q, np.zeros((1, 16, 2, 64), np.float16), q))(q)
    with pytest.raises(ValueError, match="dropout_seed: expected an int under jax.jit"):
        jax.make_jaxpr(lambda q: cuflash2.flash_attn_func(q, q, q, dropout_p=0.1))(q)
    with pytest.raises(TypeError, match="out: JAX arrays are immutable"):
        cuflash2.flash_attn_func(q, q, q, out=q)
    vq, vk, cu_q, cu_k = _varlen_inputs()
    with pytest.raises(TypeError, match="out: JAX arrays are immutable"):
        cuflash2.flash_attn_varlen_func(vq, vk, vk, cu_q, cu_k, 60, 30, out=vq)
    with pytest.raises(TypeError, match="deterministic: expected a Python bool"):
        jax.make_jaxpr(lambda q, k, d: cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 60, 30,
                                                                        deterministic=d))(vq, vk, False)


# ---- paged varlen (block_table; forward only) ----------------------------------------------------

def _paged_inputs():
    q = jnp.zeros((100, 4, 64), jnp.bfloat16)
    k_cache = jnp.zeros((12, 16, 2, 64), jnp.bfloat16)
    table = jnp.asarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    return q, k_cache, _cu([40, 0, 60]), _cu([64, 5, 60]), table


def test_paged_varlen_traces_under_jit_with_its_static_problem():
    q, k_cache, cu_q, cu_k, table = _paged_inputs()

    def attention(q, k, v, cu_q, cu_k, table):
        return cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 60, 64, causal=True, block_table=table)

    out = jax.eval_shape(jax.jit(attention), q, k_cache, k_cache, cu_q, cu_k, table)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    traced = _callbacks(jax.jit(attention), q, k_cache, k_cache, cu_q, cu_k, table)
    concrete = _callbacks(lambda q: attention(q, k_cache, k_cache, cu_q, cu_k, table), q)
    problems = [c.keywords["problem"] for c in traced + concrete]
    assert [p.prefill for p in problems] == [True, False]  # concrete cu_seqlens cover every row of q
    assert problems[1].cache_shape == (12, 16, 2, 64) and problems[1].table_shape == (3, 4)
    assert (problems[1].shape.seqlen_q, problems[1].shape.seqlen_k, problems[1].total_q) == (60, 64, 100)


def test_paged_varlen_checks_and_no_backward():
    q, k_cache, cu_q, cu_k, table = _paged_inputs()
    with pytest.raises(ValueError, match="block_table: expected at most 4 pages x 16 rows = 64 keys per sequence, "
                                         "got sequence 0 with 65 keys"):
        cuflash2.flash_attn_varlen_func(q, k_cache, k_cache, cu_q, _cu([65, 5, 60]), 60, 65, block_table=table)
    with pytest.raises(TypeError, match="block_table: expected dtype int32"):
        jax.eval_shape(lambda t: cuflash2.flash_attn_varlen_func(q, k_cache, k_cache, cu_q, cu_k, 60, 64,
                                                                 block_table=t), table.astype(jnp.float32))
    with pytest.raises(ValueError, match="dropout_p: expected 0.0 with block_table"):
        cuflash2.flash_attn_varlen_func(q, k_cache, k_cache, cu_q, cu_k, 60, 64, dropout_p=0.1, block_table=table)

    def loss(q):
        out = cuflash2.flash_attn_varlen_func(q, k_cache, k_cache, cu_q, cu_k, 60, 64, block_table=table)
        return out.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="block_table: flash_attn_varlen_func with paged K/V has no backward"):
        jax.eval_shape(jax.grad(loss), q)
