"""flash_attn_varlen_func with block_table (paged K/V, chunked prefill) on the GPU: CuPy and torch,
every sequence against the fp32 reference on its keys gathered from the pages, with FA2's tolerance
rule (2x the naive same-precision error), the LSE, rows no sequence covers, and torch.compile."""

import numpy as np
import pytest

from attention_ref import attention_features_ref, check_fa2_rule, stable_seed
from test_paged_varlen import paged_problem

from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu

# (queries, keys) per sequence: chunked prefill (the chunk's queries after a cached prefix), a
# sequence without queries, one whose chunk is the whole sequence, and a one-token decode.
RAGGED = ([37, 0, 130, 1, 64, 200], [300, 77, 130, 513, 64, 1000])

FEATURES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "causal-gqa4": dict(causal=True, heads=8, heads_kv=2),
    "window": dict(causal=True, window_size=(100, -1)),
    "window-both": dict(causal=False, window_size=(50, 20)),
    "softcap-alibi": dict(causal=True, softcap=5.0, alibi=True),
}


def _dtype(name):
    if name == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float16


def _problem(page_size, head_dim, dtype, feature, lens=RAGGED):
    opts = FEATURES[feature]
    heads, heads_kv = opts.get("heads", 4), opts.get("heads_kv", 2)
    rng = np.random.default_rng(stable_seed(page_size, head_dim, dtype, feature))
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = paged_problem(rng, *lens, page_size, heads, heads_kv, head_dim,
                                                                 _dtype(dtype), extra_q_rows=3)
    slopes = rng.uniform(0.01, 0.3, (len(lens[0]), heads)).astype(np.float32) if opts.get("alibi") else None
    options = dict(causal=opts["causal"], window_size=opts.get("window_size", (-1, -1)),
                   softcap=opts.get("softcap", 0.0), alibi_slopes=slopes)
    return (q, k, v, k_cache, v_cache, table, cu_q, cu_k), options


def _check_sequences(cp, lens, q, k, v, cu_q, cu_k, out, lse, options):
    """Each sequence against the fp32 reference on its packed keys; rows past the last: 0 / +inf."""
    q, k, v = (cp.asarray(x) for x in (q, k, v))
    for b, (sq, sk) in enumerate(zip(*lens)):
        if sq == 0:
            continue
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        slopes = options["alibi_slopes"]
        slopes = None if slopes is None else cp.asarray(slopes[b])
        args = [as_float32(cp, x[None, r]) for x, r in ((q, rq), (k, rk), (v, rk))]
        kw = dict(causal=options["causal"], window=options["window_size"], softcap=options["softcap"], slopes=slopes)
        ref, ref_lse = attention_features_ref(cp, *args, **kw)
        naive, _ = attention_features_ref(cp, *args, **kw, low_precision=np.dtype(q.dtype).name)
        check_fa2_rule(cp, f"out[{b}]", out[None, rq], ref, naive, 2)
        got_lse = cp.asarray(lse[:, rq])[None]
        finite = cp.isfinite(ref_lse)
        assert bool((cp.isfinite(got_lse) == finite).all()), f"LSE +inf pattern of sequence {b}"
        assert float(cp.abs(cp.where(finite, got_lse - ref_lse, 0)).max()) < 2e-3, f"lse[{b}]"
    tail = int(cu_q[-1])
    assert not bool(as_float32(cp, out[tail:]).any()) and bool(cp.isposinf(lse[:, tail:]).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("page_size", [1, 7, 16, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_cupy_paged_varlen_matches_reference(feature, page_size, head_dim, dtype):
    import cupy as cp

    import cuflash2

    arrays, options = _problem(page_size, head_dim, dtype, feature)
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    dev = [cp.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k, table)]
    slopes = None if options["alibi_slopes"] is None else cp.asarray(options["alibi_slopes"])
    out, lse = cuflash2.flash_attn_varlen_forward(*dev[:5], max(RAGGED[0]), max(RAGGED[1]),
                                                  **dict(options, alibi_slopes=slopes), block_table=dev[5])
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    _check_sequences(cp, RAGGED, q, k, v, cu_q, cu_k, out, lse, options)


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_cupy_paged_varlen_matches_non_paged_varlen(page_size):
    """Same keys, paged or packed: the outputs agree to the last bits the tiles allow."""
    import cupy as cp

    import cuflash2

    arrays, options = _problem(page_size, 128, "bf16", "causal")
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = (cp.asarray(x) for x in arrays)
    paged, paged_lse = cuflash2.flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, max(RAGGED[0]),
                                                          max(RAGGED[1]), causal=True, block_table=table)
    packed, packed_lse = cuflash2.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(RAGGED[0]), max(RAGGED[1]),
                                                            causal=True)
    assert float(cp.abs(as_float32(cp, paged) - as_float32(cp, packed)).max()) < 1e-2
    finite = cp.isfinite(packed_lse)
    assert bool((cp.isfinite(paged_lse) == finite).all())
    assert float(cp.abs(cp.where(finite, paged_lse - packed_lse, 0)).max()) < 1e-4


def test_cupy_paged_varlen_equals_numpy_path_and_probs():
    import cupy as cp

    import cuflash2

    lens = ([5, 0, 30], [40, 3, 30])
    arrays, options = _problem(3, 64, "fp16", "causal", lens)
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    host = cuflash2.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 30, 40, causal=True, block_table=table,
                                           return_attn_probs=True)
    dev = cuflash2.flash_attn_varlen_func(*(cp.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k)), 30, 40,
                                          causal=True, block_table=cp.asarray(table), return_attn_probs=True)
    assert float(np.abs(cp.asnumpy(dev[0]).astype(np.float32) - host[0].astype(np.float32)).max()) < 2e-3
    finite = np.isfinite(host[1])
    assert np.array_equal(np.isfinite(cp.asnumpy(dev[1])), finite)
    assert float(np.abs(np.where(finite, cp.asnumpy(dev[1]) - host[1], 0)).max()) < 1e-3
    assert float(np.abs(cp.asnumpy(dev[2]) - host[2]).max()) < 2e-3


def test_out_of_range_page_ids_read_as_empty_keys_on_the_gpu():
    """Page ids outside the cache are not checked on the host (no extra sync): the kernel reads zeros
    there instead of memory outside the cache, and nothing is written outside the output."""
    import cupy as cp

    import cuflash2

    arrays, _ = _problem(16, 64, "bf16", "causal", ([8], [40]))
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = (cp.asarray(x) for x in arrays)
    table[0, 1] = 10 ** 6
    table[0, 2] = -5
    out, lse = cuflash2.flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, 8, 40, causal=True,
                                                  block_table=table)
    assert bool(cp.isfinite(as_float32(cp, out)).all()) and bool(cp.isfinite(lse[:, :8]).all())


# ---- torch ---------------------------------------------------------------------------------------------

def _as_torch(torch, x, dtype):
    t = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda()
    return t.view(torch.bfloat16 if dtype == "bf16" else torch.float16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 7, 16, 256])
@pytest.mark.parametrize("feature", ["causal", "causal-gqa4", "window", "softcap-alibi"])
def test_torch_paged_varlen_matches_cupy_path(feature, page_size, dtype):
    """torch runs the same kernel as the CuPy path (checked against the reference above): the same
    bits, output and LSE."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    import cuflash2

    arrays, options = _problem(page_size, 128, dtype, feature)
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    max_q, max_k = max(RAGGED[0]), max(RAGGED[1])
    slopes = options["alibi_slopes"]
    kw = dict(causal=options["causal"], window_size=options["window_size"], softcap=options["softcap"])
    want, want_lse = cuflash2.flash_attn_varlen_forward(*(cp.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k)),
                                                        max_q, max_k, **kw, block_table=cp.asarray(table),
                                                        alibi_slopes=None if slopes is None else cp.asarray(slopes))
    tq, tk, tv = (_as_torch(torch, x, dtype) for x in (q, k_cache, v_cache))
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table))
    t_slopes = None if slopes is None else torch.from_numpy(slopes).cuda()
    with torch.inference_mode():
        out = cuflash2.flash_attn_varlen_func(tq, tk, tv, t_cu_q, t_cu_k, max_q, max_k, **kw, alibi_slopes=t_slopes,
                                              block_table=t_table)
        _, lse = cuflash2.flash_attn_varlen_forward(tq, tk, tv, t_cu_q, t_cu_k, max_q, max_k, **kw,
                                                    alibi_slopes=t_slopes, block_table=t_table)
    assert isinstance(out, torch.Tensor) and out.shape == tq.shape and out.dtype == tq.dtype
    np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy(), cp.asnumpy(want).view(np.int16))
    np.testing.assert_array_equal(lse.cpu().numpy(), cp.asnumpy(want_lse))


def test_torch_requires_grad_is_refused_and_no_grad_runs():
    torch = pytest.importorskip("torch")
    import cuflash2

    arrays, _ = _problem(16, 64, "bf16", "causal", ([8, 3], [40, 3]))
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    tq, tk, tv = (_as_torch(torch, x, "bf16") for x in (q, k_cache, v_cache))
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table))
    tq.requires_grad_()
    with pytest.raises(RuntimeError, match="block_table has no backward"):
        cuflash2.flash_attn_varlen_func(tq, tk, tv, t_cu_q, t_cu_k, 8, 40, causal=True, block_table=t_table)
    with torch.no_grad():
        out = cuflash2.flash_attn_varlen_func(tq, tk, tv, t_cu_q, t_cu_k, 8, 40, causal=True, block_table=t_table)
    assert out.grad_fn is None and bool(torch.isfinite(out.float()).all())


def test_torch_compile_fullgraph_paged_varlen():
    torch = pytest.importorskip("torch")
    import cuflash2

    arrays, options = _problem(7, 64, "bf16", "causal-gqa4")
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    tq, tk, tv = (_as_torch(torch, x, "bf16") for x in (q, k_cache, v_cache))
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table))

    def step(q, k_cache, v_cache, cu_q, cu_k, table):
        out = cuflash2.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(RAGGED[0]), max(RAGGED[1]),
                                              causal=True, block_table=table)
        return out * 2

    with torch.no_grad():
        eager = step(tq, tk, tv, t_cu_q, t_cu_k, t_table)
        compiled = torch.compile(step, fullgraph=True)(tq, tk, tv, t_cu_q, t_cu_k, t_table)
    assert torch.equal(compiled, eager)


def test_torch_opcheck_paged_varlen_op():
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks import torch_adapter as torch_ops

    arrays, _ = _problem(16, 64, "fp16", "causal", ([8, 3], [40, 3]))
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    tq, tk, tv = (_as_torch(torch, x, "fp16") for x in (q, k_cache, v_cache))
    t_cu_q, t_cu_k, t_table = (torch.from_numpy(x).cuda() for x in (cu_q, cu_k, table))
    torch.library.opcheck(torch_ops._flash_attn_varlen_paged_fwd,
                          (tq, tk, tv, t_cu_q, t_cu_k, t_table, 8, 40, 0.125, True, -1, -1, 0.0, None),
                          test_utils=("test_schema", "test_faketensor"))


# ---- JAX -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("jit", [False, True])
def test_jax_paged_varlen_matches_cupy_path(jit, page_size):
    """Eager (cu_seqlens checked on the host) and under jax.jit (traced cu_seqlens, outputs prefilled):
    the same kernel as the CuPy path, the same bits."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    import cupy as cp

    import cuflash2

    arrays, _ = _problem(page_size, 128, "bf16", "softcap-alibi")
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = arrays
    max_q, max_k = max(RAGGED[0]), max(RAGGED[1])
    kw = dict(causal=True, window_size=(300, -1), softcap=5.0)
    want, want_lse = cuflash2.flash_attn_varlen_forward(*(cp.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k)),
                                                        max_q, max_k, **kw, block_table=cp.asarray(table))

    def call(q, k, v, cu_q, cu_k, table):
        return cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw, block_table=table)

    args = [jnp.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k, table)]
    out = (jax.jit(call) if jit else call)(*args)
    np.testing.assert_array_equal(np.asarray(out).view(np.int16), cp.asnumpy(want).view(np.int16))
    if not jit:  # eager: the LSE through the probabilities' companion output
        _, lse, _ = cuflash2.flash_attn_varlen_func(*args[:5], max_q, max_k, **kw, block_table=args[5],
                                                    return_attn_probs=True)
        np.testing.assert_array_equal(np.asarray(lse), cp.asnumpy(want_lse))
