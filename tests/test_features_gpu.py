"""Sliding window, softcap, ALiBi and varlen on the GPU (variant kernels), forward and backward,
against fp32 references with FA2's tolerance rule (2x the naive same-precision error forward, 3x
for gradients)."""

import numpy as np
import pytest

from attention_ref import attention_features_ref, check_fa2_rule, stable_seed
from test_forward_gpu import make_inputs

from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu

FEATURES = {
    "window": dict(window=(37, 11)),
    "window-causal": dict(window=(64, -1), causal=True),
    "window-tiny": dict(window=(0, 0)),
    "window-right-only": dict(window=(-1, 5)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi="heads"),
    "alibi-batch-causal": dict(alibi="batch", causal=True),
    "all": dict(window=(90, 3), softcap=8.0, alibi="heads"),
    "all-causal": dict(window=(200, -1), softcap=2.0, alibi="batch", causal=True),
}
SHAPES = ((113, 203), (203, 113), (1, 257), (300, 300))


def _slopes(cp, kind, batch, heads):
    if kind is None:
        return None
    base = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)  # the ALiBi paper's geometric slopes
    slopes = base if kind == "heads" else np.stack([base * (1 + 0.5 * b) for b in range(batch)])
    return cp.asarray(slopes.astype(np.float32))


def _options(cp, feature, batch, heads):
    f = FEATURES[feature]
    return dict(causal=f.get("causal", False), window_size=f.get("window", (-1, -1)), softcap=f.get("softcap", 0.0),
                alibi_slopes=_slopes(cp, f.get("alibi"), batch, heads))


def _ref(cp, q, k, v, dout, options, low_precision=None):
    f32 = [as_float32(cp, x) for x in (q, k, v)] + ([as_float32(cp, dout)] if dout is not None else [])
    if dout is None:
        f32.append(None)
    return attention_features_ref(cp, *f32, causal=options["causal"], window=options["window_size"],
                                  softcap=options["softcap"], slopes=options["alibi_slopes"],
                                  low_precision=low_precision)


_check = check_fa2_rule


def _check_lse(cp, lse, ref_lse):
    finite = cp.isfinite(ref_lse)
    assert bool((cp.isfinite(lse) == finite).all()), "LSE +inf pattern differs from reference"
    assert float(cp.abs(cp.where(finite, lse - ref_lse, 0)).max()) < 2e-3


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_forward_and_backward(feature, seqlens, head_dim, dtype):
    import cupy as cp

    import cuflash2

    sq, sk = seqlens
    seed = stable_seed(feature, sq, sk, head_dim, dtype)
    q, k, v = make_inputs(cp, 2, sq, sk, 4, 2, head_dim, dtype, seed)
    (dout,) = make_inputs(cp, 2, sq, 1, 4, 1, head_dim, dtype, seed + 1)[:1]
    options = _options(cp, feature, 2, 4)
    out, lse = cuflash2.flash_attn_forward(q, k, v, **options)
    ref = _ref(cp, q, k, v, dout, options)
    naive = _ref(cp, q, k, v, dout, options, low_precision=np.dtype(q.dtype).name)
    _check(cp, "out", out, ref[0], naive[0], 2)
    _check_lse(cp, lse, ref[1])
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **options)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref[2:], naive[2:]):
        _check(cp, name, g, r, n, 3)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 224])
def test_features_long_sequence_window(head_dim):
    """A window far smaller than the sequence: most key blocks are skipped on both sides."""
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 1, 2048, 2048, 2, 1, head_dim, "bf16", head_dim)
    (dout,) = make_inputs(cp, 1, 2048, 1, 2, 1, head_dim, "bf16", 7)[:1]
    options = dict(causal=True, window_size=(256, -1), softcap=0.0, alibi_slopes=None)
    out, lse = cuflash2.flash_attn_forward(q, k, v, **options)
    ref = _ref(cp, q, k, v, dout, options)
    naive = _ref(cp, q, k, v, dout, options, low_precision="bfloat16")
    _check(cp, "out", out, ref[0], naive[0], 2)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **options)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref[2:], naive[2:]):
        _check(cp, name, g, r, n, 3)


def test_plain_options_use_the_plain_kernels():
    """window (-1, -1) / softcap 0 / no ALiBi select the plain kernels, and the variant kernels
    give the same answer as the plain ones when the window covers everything."""
    import cupy as cp

    import cuflash2

    q, k, v = make_inputs(cp, 2, 300, 300, 4, 4, 128, "bf16", 5)
    plain, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
    wide, lse_wide = cuflash2.flash_attn_forward(q, k, v, causal=True, window_size=(10**6, -1))
    assert float(cp.abs(as_float32(cp, plain) - as_float32(cp, wide)).max()) < 1e-2
    assert float(cp.abs(lse - lse_wide).max()) < 1e-4


# ---- varlen -------------------------------------------------------------------------------------

def _packed(cp, lengths, heads, head_dim, dtype, seed):
    (x,) = make_inputs(cp, 1, int(sum(lengths)), 1, heads, 1, head_dim, dtype, seed)[:1]
    return x[0]


def _cu(cp, lengths):
    return cp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


VARLEN_CASES = {
    "mixed": ([1, 130, 0, 77, 256], [5, 100, 9, 77, 300]),
    "equal": ([128, 128], [128, 128]),
    "empty-keys": ([10, 20], [0, 33]),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("feature", ["plain", "causal", "window-causal", "all"])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_per_sequence_reference(case, feature, head_dim, dtype):
    import cupy as cp

    import cuflash2

    lens_q, lens_k = VARLEN_CASES[case]
    batch, heads, heads_kv = len(lens_q), 4, 2
    seed = stable_seed(case, feature, head_dim, dtype)
    q = _packed(cp, lens_q, heads, head_dim, dtype, seed)
    k = _packed(cp, lens_k, heads_kv, head_dim, dtype, seed + 1)
    v = _packed(cp, lens_k, heads_kv, head_dim, dtype, seed + 2)
    dout = _packed(cp, lens_q, heads, head_dim, dtype, seed + 3)
    cu_q, cu_k = _cu(cp, lens_q), _cu(cp, lens_k)
    options = (dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None) if feature == "plain" else
               dict(causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None) if feature == "causal" else
               _options(cp, feature, batch, heads))
    out, lse = cuflash2.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    grads = cuflash2.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                **options)
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    for b in range(batch):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:
            continue
        seq_opts = dict(options)
        if options["alibi_slopes"] is not None and options["alibi_slopes"].ndim == 2:
            seq_opts["alibi_slopes"] = options["alibi_slopes"][b]
        args = [x[None, r] for x, r in ((q, rq), (k, rk), (v, rk))]
        d_b = dout[None, rq]
        if lens_k[b] == 0:  # no keys: out 0, lse +inf, zero gradients
            assert not bool(as_float32(cp, out[rq]).any()) and bool(cp.isposinf(lse[:, rq]).all())
            assert not bool(as_float32(cp, grads[0][rq]).any())
            continue
        ref = _ref(cp, *args, d_b, seq_opts)
        naive = _ref(cp, *args, d_b, seq_opts, low_precision=np.dtype(q.dtype).name)
        _check(cp, f"out[{b}]", out[None, rq], ref[0], naive[0], 2)
        _check_lse(cp, lse[None, :, rq], ref[1])
        for name, g, r, n in zip(("dq", "dk", "dv"), (grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]),
                                 ref[2:], naive[2:]):
            _check(cp, f"{name}[{b}]", g, r, n, 3)


@pytest.mark.parametrize("heads_kv", [2, 1])  # 1: GQA, whose fp32 dK/dV scratch covers unused rows too
def test_varlen_rows_past_the_last_sequence_are_zero(heads_kv):
    import cupy as cp

    import cuflash2

    q = _packed(cp, [50], 2, 64, "bf16", 1)
    k = _packed(cp, [70], heads_kv, 64, "bf16", 2)
    cu_q, cu_k = _cu(cp, [20, 10]), _cu(cp, [30, 25])  # rows 30.. of q and 55.. of k unused
    out, lse = cuflash2.flash_attn_varlen_forward(q, k, k, cu_q, cu_k, 20, 30, causal=True)
    assert not bool(as_float32(cp, out[30:]).any()) and bool(cp.isposinf(lse[:, 30:]).all())
    dq, dk, dv = cuflash2.flash_attn_varlen_backward(q, q, k, k, out, lse, cu_q, cu_k, 20, 30, causal=True)
    for g, start in ((dq, 30), (dk, 55), (dv, 55)):
        assert not bool(as_float32(cp, g[start:]).any())


def test_varlen_torch_autograd_matches_dense():
    torch = pytest.importorskip("torch")
    import cuflash2

    lengths = [33, 200, 1]
    heads, d = 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lengths), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(sum(lengths), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(sum(lengths), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    out = cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                          window_size=(16, -1))
    out.float().square().sum().backward()
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        qb, kb, vb = (x.detach()[sl][None].clone().requires_grad_() for x in (q, k, v))
        ob = cuflash2.flash_attn_func(qb, kb, vb, causal=True, window_size=(16, -1))
        ob.float().square().sum().backward()
        torch.testing.assert_close(out[sl].detach(), ob[0].detach(), atol=2e-2, rtol=0)
        for g, gb in ((q.grad, qb.grad), (k.grad, kb.grad), (v.grad, vb.grad)):
            torch.testing.assert_close(g[sl], gb[0], atol=5e-2, rtol=5e-2)
        start += n


def test_features_torch_autograd_and_compile():
    torch = pytest.importorskip("torch")
    import cuflash2

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.float16, generator=gen, requires_grad=True)
               for _ in range(3))
    slopes = torch.rand(4, device="cuda", dtype=torch.float32, generator=gen)
    options = dict(causal=True, window_size=(40, -1), softcap=3.0, alibi_slopes=slopes)

    def loss(fn):
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v, **options).float().square().sum().backward()
        return [x.grad.clone() for x in (q, k, v)]

    eager = loss(cuflash2.flash_attn_func)
    compiled = loss(torch.compile(cuflash2.flash_attn_func, fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    import cupy as cp

    ref = attention_features_ref(cp, *(cp.from_dlpack(x.detach().float()) for x in (q, k, v)), None, causal=True,
                                 window=(40, -1), softcap=3.0, slopes=cp.from_dlpack(slopes))[0]
    out = cuflash2.flash_attn_func(q, k, v, **options)
    torch.testing.assert_close(out.float(), torch.from_dlpack(ref), atol=2e-3, rtol=0)


def test_features_jax_jit_and_grad():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash2

    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (2, 130, 4, 64), jnp.float32).astype(jnp.bfloat16)
               for kk in jax.random.split(key, 3))
    slopes = jnp.linspace(0.1, 0.8, 4, dtype=jnp.float32)

    def loss(q, k, v):
        out = cuflash2.flash_attn_func(q, k, v, causal=True, window_size=(20, -1), softcap=4.0, alibi_slopes=slopes)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(float(value))
    for g in grads:
        assert bool(jnp.isfinite(g.astype(jnp.float32)).all())
    import cupy as cp

    q_c, k_c, v_c = (cp.asarray(np.asarray(x)) for x in (q, k, v))
    out_c = cuflash2.flash_attn_func(q_c, k_c, v_c, causal=True, window_size=(20, -1), softcap=4.0,
                                     alibi_slopes=cp.asarray(np.asarray(slopes)))
    expected = float(cp.sum(as_float32(cp, out_c) ** 2))
    assert abs(float(value) - expected) <= 1e-3 * abs(expected)
