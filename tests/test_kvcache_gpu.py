"""flash_attn_with_kvcache on the GPU against the NumPy path on the same inputs: cache contents after
the append, outputs and LSE; paged caches of odd page sizes, split-KV, GQA decoding, rotary."""

import ml_dtypes
import numpy as np
import pytest

from attention_ref import stable_seed

import cuflash2
from cuflash2.core import replay
from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu

NP = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}

CASES = {
    # name: (batch, seqlen_q, heads, kv_heads, cache_len, new, options)
    "decode-gqa": (3, 1, 8, 2, 300, 1, {}),
    "decode-mqa-splits3": (2, 1, 4, 1, 513, 1, {"num_splits": 3}),
    "decode-nosplit": (2, 1, 4, 2, 200, 1, {"num_splits": 1}),
    "decode-rotary": (2, 1, 4, 2, 100, 1, {"rotary": (32, True)}),
    "chunk-causal": (2, 7, 4, 2, 150, 7, {"causal": True}),
    "chunk-causal-rotary-neox": (2, 5, 4, 4, 90, 5, {"causal": True, "rotary": (64, False)}),
    "prefill-noappend": (2, 40, 4, 2, 128, 0, {"causal": True}),
    "leftpad-batchidx": (2, 3, 4, 2, 64, 2, {"leftpad": True, "batch_idx": True, "causal": True}),
    "leftpad-rotary": (2, 3, 4, 2, 64, 3, {"leftpad": True, "rotary": (32, False), "causal": True}),
    "window-softcap-alibi": (2, 4, 4, 2, 200, 2, {"causal": True, "window": (50, -1), "softcap": 5.0,
                                                   "alibi": True}),
    "paged-1": (2, 1, 8, 2, 96, 1, {"page": 1}),
    "paged-7": (3, 3, 4, 2, 100, 3, {"page": 7, "causal": True}),
    "paged-16-splits": (2, 1, 4, 2, 300, 1, {"page": 16, "num_splits": 5}),
    "paged-256-rotary": (2, 2, 4, 2, 600, 2, {"page": 256, "rotary": (128, True), "causal": True}),
}


def _make(rng, case, head_dim, dtype):
    batch, sq, h, hk, cache_len, new, opts = CASES[case]
    f = NP[dtype]
    q = rng.standard_normal((batch, sq, h, head_dim)).astype(f)
    entries = batch + 2 if opts.get("batch_idx") else batch
    k_cache = rng.standard_normal((entries, cache_len, hk, head_dim)).astype(f)
    v_cache = rng.standard_normal((entries, cache_len, hk, head_dim)).astype(f)
    kwargs = {"causal": opts.get("causal", False), "num_splits": opts.get("num_splits", 0),
              "return_softmax_lse": True}
    if new:
        kwargs["k"] = rng.standard_normal((batch, new, hk, head_dim)).astype(f)
        kwargs["v"] = rng.standard_normal((batch, new, hk, head_dim)).astype(f)
    seqlens = rng.integers(0, cache_len - new + 1, batch).astype(np.int32)
    seqlens[0] = cache_len - new  # one sequence fills its cache exactly
    kwargs["cache_seqlens"] = seqlens
    if opts.get("batch_idx"):
        kwargs["cache_batch_idx"] = rng.permutation(entries)[:batch].astype(np.int32)
    if opts.get("leftpad"):
        kwargs["cache_leftpad"] = np.minimum(seqlens, rng.integers(0, 10, batch)).astype(np.int32)
    if "window" in opts:
        kwargs.update(window_size=opts["window"], softcap=opts["softcap"])
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = rng.uniform(0.01, 0.3, h).astype(np.float32)
    if "rotary" in opts:
        rotary_dim, interleaved = opts["rotary"]
        rotary_dim = min(rotary_dim, head_dim)
        theta = rng.uniform(0, 2 * np.pi, (cache_len + 8, rotary_dim // 2))
        kwargs.update(rotary_cos=np.cos(theta).astype(f), rotary_sin=np.sin(theta).astype(f),
                      rotary_interleaved=interleaved)
    if "page" in opts:
        page = opts["page"]
        per_seq = -(-cache_len // page)
        order = rng.permutation(batch * per_seq + 3)
        table = order[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
        pages_k = rng.standard_normal((batch * per_seq + 3, page, hk, head_dim)).astype(f)
        pages_v = rng.standard_normal((batch * per_seq + 3, page, hk, head_dim)).astype(f)
        kwargs["block_table"] = table
        k_cache, v_cache = pages_k, pages_v
    return q, k_cache, v_cache, kwargs


def _to_gpu(cp, kwargs):
    return {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_numpy_path(case, head_dim, dtype):
    import cupy as cp

    rng = np.random.default_rng(stable_seed(case, head_dim, dtype))
    q, k_cache, v_cache, kwargs = _make(rng, case, head_dim, dtype)
    kc_gpu, vc_gpu = cp.asarray(k_cache), cp.asarray(v_cache)
    out, lse = cuflash2.flash_attn_with_kvcache(cp.asarray(q), kc_gpu, vc_gpu, **_to_gpu(cp, kwargs))
    ref_out, ref_lse = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)  # updates the host caches
    # The append: v bit-exact, k within rounding of the rotary product.
    np.testing.assert_array_equal(cp.asnumpy(vc_gpu).view(np.uint16), v_cache.view(np.uint16))
    k_err = np.abs(cp.asnumpy(as_float32(cp, kc_gpu)) - k_cache.astype(np.float32)).max()
    assert k_err <= 2 * np.abs(k_cache.astype(np.float32)).max() * (2.0 ** -8 if dtype == "bf16" else 2.0 ** -11)
    got = cp.asnumpy(as_float32(cp, out))
    assert not np.isnan(got).any()
    eps = 2.0 ** -8 if dtype == "bf16" else 2.0 ** -11
    err = np.abs(got - ref_out.astype(np.float32)).max()
    assert err <= 4 * eps * max(1.0, np.abs(ref_out.astype(np.float32)).max()), f"out max error {err:.3e}"
    lse_gpu = cp.asnumpy(lse)
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse_gpu) == finite).all()
    assert np.abs(np.where(finite, lse_gpu - ref_lse, 0)).max() < 1e-2


def test_splits_do_not_change_the_answer():
    import cupy as cp

    rng = np.random.default_rng(0)
    q, k_cache, v_cache, kwargs = _make(rng, "decode-gqa", 128, "bf16")
    kwargs.pop("k"), kwargs.pop("v")
    results = []
    for splits in (1, 2, 7, 0):
        out, lse = cuflash2.flash_attn_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache),
                                                    **_to_gpu(cp, {**kwargs, "num_splits": splits}))
        results.append((cp.asnumpy(as_float32(cp, out)), cp.asnumpy(lse)))
    for out, lse in results[1:]:
        assert np.abs(out - results[0][0]).max() < 1e-2
        assert np.abs(lse - results[0][1]).max() < 1e-4


def test_bad_device_values_stay_in_bounds():
    """Out-of-range cache_seqlens and page ids are clamped or skipped: no fault, nothing written
    outside the cache (checked with sentinel pages)."""
    import cupy as cp

    rng = np.random.default_rng(1)
    q = cp.asarray(rng.standard_normal((2, 1, 4, 64)).astype(np.float16))
    pages = cp.full((6, 8, 2, 64), 7.0, dtype=cp.float16)
    table = cp.asarray(np.array([[0, 1, 99], [2, -5, 3]], np.int32))  # 99 and -5 are not pages
    k_new = cp.ones((2, 1, 2, 64), dtype=cp.float16)
    seqlens = cp.asarray(np.array([1000, 10], np.int32))  # 1000 is past the cache (24 rows)
    out = cuflash2.flash_attn_with_kvcache(q, pages, pages, k_new, k_new, cache_seqlens=seqlens, block_table=table)
    cp.cuda.Device().synchronize()
    assert not bool(cp.isnan(as_float32(cp, out)).any())
    assert bool((pages[4:] == 7).all())  # pages 4 and 5 are in no table: untouched


def test_kvcache_with_torch_tensors():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([10, 63], dtype=torch.int32, device="cuda")
    out = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    torch.testing.assert_close(k_cache[0, 10], k[0, 0], atol=0, rtol=0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:1].transpose(1, 2), k_cache[:1, :11].transpose(1, 2), v_cache[:1, :11].transpose(1, 2), enable_gqa=True)
    torch.testing.assert_close(out[:1].float(), ref.transpose(1, 2).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("seqlens_kind", ["array", "int", "none"])
def test_decode_loop_reuses_its_plan(seqlens_kind):
    """A decoding loop: the same call signature every step with new q/k/v buffers and new lengths.
    The launch plan is built once and reused; every step must match the NumPy path (no stale
    address or length from an earlier step)."""
    import cupy as cp

    from cuflash2.core import replay

    rng = np.random.default_rng(5)
    batch, h, hk, d, cache_len = 2, 8, 2, 128, 40
    f = NP["bf16"]
    k_cache = rng.standard_normal((batch, cache_len, hk, d)).astype(f)
    v_cache = rng.standard_normal((batch, cache_len, hk, d)).astype(f)
    k_gpu, v_gpu = cp.asarray(k_cache), cp.asarray(v_cache)
    plans_before = len(replay.RECORDINGS.entries)
    for step in range(4):
        q = rng.standard_normal((batch, 1, h, d)).astype(f)
        kwargs = {"return_softmax_lse": True}
        if seqlens_kind != "none":  # append one token per step at a growing length
            length = 30 + step
            kwargs["k"] = rng.standard_normal((batch, 1, hk, d)).astype(f)
            kwargs["v"] = rng.standard_normal((batch, 1, hk, d)).astype(f)
            kwargs["cache_seqlens"] = (length if seqlens_kind == "int"
                                       else np.array([length, length - 7], np.int32))
        ref_out, ref_lse = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        out, lse = cuflash2.flash_attn_with_kvcache(cp.asarray(q), k_gpu, v_gpu, **_to_gpu(cp, kwargs))
        np.testing.assert_array_equal(cp.asnumpy(k_gpu).view(np.uint16), k_cache.view(np.uint16))
        assert np.abs(cp.asnumpy(as_float32(cp, out)) - as_float32(np, ref_out)).max() < 2e-2
        assert np.abs(cp.asnumpy(lse) - ref_lse).max() < 1e-2
    assert len(replay.RECORDINGS.entries) - plans_before <= 1  # one signature, one plan


FAST_CASES = {
    # name: (batch, heads, kv_heads, cache_len, options)
    "split": (1, 8, 2, 700, {"num_splits": 0}),
    "nosplit-lse": (3, 4, 4, 90, {"num_splits": 1, "return_softmax_lse": True}),
    "append-rotary-fp32": (2, 8, 2, 300, {"append": True, "rotary": True}),
    "paged-append-lse": (2, 4, 1, 200, {"append": True, "page": 5, "return_softmax_lse": True}),
    "alibi-window-leftpad": (2, 4, 2, 150, {"alibi": True, "window": (40, 0), "leftpad": True}),
}


class _Framework:
    """asarray (from NumPy), copy, to_host (bf16 as its bits) and sync for CuPy or torch."""

    def __init__(self, name):
        if name == "torch":
            torch = pytest.importorskip("torch")
            self.asarray = lambda a: (torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
                                      if a.dtype == NP["bf16"] else torch.from_numpy(a).cuda())
            self.copy = lambda t: t.clone()
            self.to_host = lambda t: (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).cpu().numpy()
            self.sync = torch.cuda.synchronize
        else:
            import cupy as cp

            self.asarray, self.copy = cp.asarray, lambda a: a.copy()
            self.to_host = lambda a: cp.asnumpy(a.view(cp.uint16) if a.dtype == NP["bf16"] else a)
            self.sync = cp.cuda.Device().synchronize


def _fast_case_inputs(fw, rng, case):
    """(k_cache, v_cache, kwargs of step i) for FAST_CASES[case], arrays of framework fw."""
    batch, h, hk, cache_len, opts = FAST_CASES[case]
    f, d = NP["bf16"], 128
    entries, table, rows = batch, None, cache_len
    if "page" in opts:
        per_seq = -(-cache_len // opts["page"])
        entries, rows = batch * per_seq + 2, opts["page"]
        table = fw.asarray(rng.permutation(entries)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32))
    k_cache = fw.asarray(rng.standard_normal((entries, rows, hk, d)).astype(f))
    v_cache = fw.asarray(rng.standard_normal((entries, rows, hk, d)).astype(f))
    fixed = {"num_splits": opts.get("num_splits", 0), "return_softmax_lse": opts.get("return_softmax_lse", False),
             "block_table": table, "window_size": opts.get("window", (-1, -1))}
    if opts.get("rotary"):  # contiguous fp32 tables are used as given (no per-call conversion)
        theta = rng.uniform(0, 2 * np.pi, (cache_len + 8, 32))
        fixed.update(rotary_cos=fw.asarray(np.cos(theta).astype(np.float32)),
                     rotary_sin=fw.asarray(np.sin(theta).astype(np.float32)))
    if opts.get("alibi"):
        fixed["alibi_slopes"] = fw.asarray(rng.uniform(0.01, 0.3, h).astype(np.float32))
    if opts.get("leftpad"):
        fixed["cache_leftpad"] = fw.asarray(np.array([3, 0] * batch, np.int32)[:batch])

    def step_kwargs(step):
        kwargs = dict(fixed, q=fw.asarray(rng.standard_normal((batch, 1, h, d)).astype(f)))
        kwargs["cache_seqlens"] = fw.asarray(np.array([cache_len - 10 - step - 3 * b for b in range(batch)], np.int32))
        if opts.get("append"):
            kwargs["k"] = fw.asarray(rng.standard_normal((batch, 1, hk, d)).astype(f))
            kwargs["v"] = fw.asarray(rng.standard_normal((batch, 1, hk, d)).astype(f))
        return kwargs
    return k_cache, v_cache, step_kwargs


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("case", list(FAST_CASES))
def test_decode_steps_take_the_fast_path(case, framework):
    """A decoding loop after its first step replays its recorded launches (no validation or planning):
    outputs, LSEs and cache contents bit-identical to the full path on copies of the same cache."""
    from cuflash2 import kvcache
    from cuflash2.core import replay

    fw = _Framework(framework)
    rng = np.random.default_rng(stable_seed(case, framework))
    k_cache, v_cache, step_kwargs = _fast_case_inputs(fw, rng, case)
    k_full, v_full = fw.copy(k_cache), fw.copy(v_cache)
    replay.clear()
    steps = 5
    try:
        for step in range(steps):
            kwargs = step_kwargs(step)
            q = kwargs.pop("q")
            fast = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
            kvcache.FAST_STEPS = False
            full = cuflash2.flash_attn_with_kvcache(q, k_full, v_full, **kwargs)
            kvcache.FAST_STEPS = True
            fw.sync()
            fast, full = (fast, full) if isinstance(fast, tuple) else ((fast,), (full,))
            assert type(fast[0]) is type(q)
            for a, b in zip(fast, full):
                np.testing.assert_array_equal(fw.to_host(a), fw.to_host(b))
            np.testing.assert_array_equal(fw.to_host(k_cache), fw.to_host(k_full))
            np.testing.assert_array_equal(fw.to_host(v_cache), fw.to_host(v_full))
    finally:
        kvcache.FAST_STEPS = True
    (step_obj,) = replay.KVCACHE_STEPS.entries.values()
    assert step_obj.calls == steps - 1  # every step after the first


def test_fast_path_leaves_bad_calls_to_the_full_path():
    """A misaligned view with a known signature does not replay the aligned step: the full path
    runs it with narrower accesses, to the aligned input's result; a Python-int cache_seqlens never
    takes the fast path."""
    import cupy as cp

    from cuflash2 import kvcache
    from cuflash2.core import replay

    replay.clear()
    rng = np.random.default_rng(5)
    q = cp.asarray(rng.standard_normal((1, 1, 4, 64)).astype(np.float16))
    k_cache = cp.asarray(rng.standard_normal((1, 64, 2, 64)).astype(np.float16))
    seqlens = cp.full((1,), 10, dtype=cp.int32)
    expected = cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=seqlens)
    assert len(replay.KVCACHE_STEPS.entries) == 1
    buffer = cp.zeros(4 * 64 + 4, dtype=cp.float16)
    shifted = buffer[4:].reshape(1, 1, 4, 64)  # same shape and strides, 8-byte aligned
    shifted[...] = q
    out = cuflash2.flash_attn_with_kvcache(shifted, k_cache, k_cache, cache_seqlens=seqlens)
    assert cp.array_equal(out, expected)
    replay.clear()
    cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=10)
    assert not replay.KVCACHE_STEPS.entries


@pytest.mark.parametrize("group,head_dim,splits", [(16, 120, 40), (8, 40, 128), (16, 248, 20), (1, 64, 9),
                                                   (4, 128, 100)])
def test_decoding_kernel_groups_many_splits_and_padded_head_dims(group, head_dim, splits):
    """The decoding kernel with GQA groups of 1-16 rows (rows 8-15 of its merge), head dims that
    are not a bucket's width (padded columns), and 9-128 splits (every lane and group of the
    combine kernel), against the NumPy path; one sequence has fewer keys than the splits need."""
    import cupy as cp

    rng = np.random.default_rng(stable_seed(group, head_dim, splits))
    hk, cache_len = 2, 128 * 256  # 256 key blocks of 128: up to 128 splits of 2
    f = NP["fp16"]
    q = rng.standard_normal((2, 1, hk * group, head_dim)).astype(f)
    k_cache = rng.standard_normal((2, cache_len, hk, head_dim)).astype(f)
    v_cache = rng.standard_normal((2, cache_len, hk, head_dim)).astype(f)
    kwargs = {"cache_seqlens": np.array([cache_len, 300], np.int32), "num_splits": splits,
              "return_softmax_lse": True}
    out, lse = cuflash2.flash_attn_with_kvcache(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache),
                                                **_to_gpu(cp, kwargs))
    ref_out, ref_lse = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    err = np.abs(cp.asnumpy(out).astype(np.float32) - ref_out.astype(np.float32)).max()
    assert err <= 4 * 2.0 ** -11 * max(1.0, np.abs(ref_out.astype(np.float32)).max()), f"out max error {err:.3e}"
    assert np.abs(cp.asnumpy(lse) - ref_lse).max() < 1e-3


def test_fast_path_refuses_converted_inputs():
    """Calls whose inputs the full path copies or converts (fp16 rotary tables, a q with a strided
    last dim) never get a fast-path step, and still compute the same as a contiguous call."""
    import cupy as cp

    from cuflash2 import kvcache
    from cuflash2.core import replay

    rng = np.random.default_rng(11)
    f = NP["bf16"]
    k_cache = cp.asarray(rng.standard_normal((1, 64, 2, 64)).astype(f))
    seqlens = cp.full((1,), 50, dtype=cp.int32)
    theta = rng.uniform(0, 6.28, (80, 16))
    cos16, sin16 = cp.asarray(np.cos(theta).astype(np.float16)), cp.asarray(np.sin(theta).astype(np.float16))
    q = cp.asarray(rng.standard_normal((1, 1, 4, 64)).astype(f))
    replay.clear()
    for _ in range(2):
        cuflash2.flash_attn_with_kvcache(q, k_cache, k_cache, rotary_cos=cos16, rotary_sin=sin16, cache_seqlens=seqlens)
    assert not replay.KVCACHE_STEPS.entries
    wide = cp.asarray(rng.standard_normal((1, 1, 4, 128)).astype(f))
    strided = wide[..., ::2]  # last stride 2: the full path copies it
    results = [cuflash2.flash_attn_with_kvcache(strided, k_cache, k_cache, cache_seqlens=seqlens) for _ in range(2)]
    assert not replay.KVCACHE_STEPS.entries
    contiguous = cuflash2.flash_attn_with_kvcache(cp.ascontiguousarray(strided), k_cache, k_cache,
                                                  cache_seqlens=seqlens)
    for r in results:
        np.testing.assert_array_equal(cp.asnumpy(r.view(cp.uint16)), cp.asnumpy(contiguous.view(cp.uint16)))


@pytest.mark.parametrize("page", [None, 16])
def test_cache_overflow_is_an_error_in_checked_mode(monkeypatch, page):
    """Device cache_seqlens are checked against the cache (block_table's pages when paged) only in
    checked mode (one read-back per call); ints always. In range, both modes give the same output."""
    import cupy as cp

    from cuflash2 import kvcache

    rng = np.random.default_rng(3)
    q = cp.asarray(rng.standard_normal((2, 1, 4, 64)).astype(np.float16))
    k_new, v_new = (cp.asarray(rng.standard_normal((2, 1, 2, 64)).astype(np.float16)) for _ in range(2))
    k_cache, v_cache = (cp.asarray(rng.standard_normal((2, 64, 2, 64)).astype(np.float16)) for _ in range(2))
    kwargs, rows = {}, 64
    if page:
        k_cache, v_cache = (x.reshape(-1, page, 2, 64) for x in (k_cache, v_cache))
        kwargs["block_table"] = cp.arange(6, dtype=cp.int32).reshape(2, 3)  # 3 pages: 48 rows a sequence
        rows = 48
    name = "block_table" if page else "k_cache"
    over = cp.asarray(np.array([rows, 3], np.int32))
    fine = cp.asarray(np.array([rows - 1, 3], np.int32))
    unchecked = cuflash2.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k_new, v_new, cache_seqlens=fine,
                                                 **kwargs)
    with pytest.raises(ValueError, match=f"{name}: expected cache_seqlens"):
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=rows, **kwargs)
    monkeypatch.setattr(kvcache, "CHECK_CACHE_BOUNDS", True)
    with pytest.raises(ValueError, match=f"{name}: expected cache_seqlens.*got {rows + 1} for sequence 0"):
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=over, **kwargs)
    checked = cuflash2.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k_new, v_new, cache_seqlens=fine,
                                               **kwargs)
    assert cp.array_equal(checked, unchecked)


@pytest.mark.parametrize("head_dim", [100, 59])
def test_fast_path_split_kv_at_head_dims_not_multiple_of_8(head_dim):
    """The decoding step's fast path lays out the split-KV partial rows as the kernels write them
    (padded to 8 columns): its second call equals the first (full path) and the NumPy path."""
    import cupy as cp

    from cuflash2 import kvcache

    replay.clear()
    rng = np.random.default_rng(head_dim)
    q = rng.standard_normal((1, 1, 8, head_dim)).astype(np.float16)
    k_cache = rng.standard_normal((1, 512, 2, head_dim)).astype(np.float16)
    v_cache = rng.standard_normal((1, 512, 2, head_dim)).astype(np.float16)
    lengths = np.array([500], np.int32)
    args = [cp.asarray(x) for x in (q, k_cache, v_cache)]
    first = cuflash2.flash_attn_with_kvcache(*args, cache_seqlens=cp.asarray(lengths), num_splits=4)
    second = cuflash2.flash_attn_with_kvcache(*args, cache_seqlens=cp.asarray(lengths), num_splits=4)
    assert cp.array_equal(first, second)
    expected = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    assert np.abs(cp.asnumpy(second).astype(np.float32) - expected.astype(np.float32)).max() < 2e-3
