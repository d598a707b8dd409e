"""flash_attn_with_kvcache on the CPU path (NumPy): semantics against independent computations,
validation errors, and the split-KV heuristic. CPU only."""

import ml_dtypes
import numpy as np
import pytest

import cuflash2
from cuflash2 import reference
from cuflash2.families.mma_sync.kvcache_launches import num_splits_heuristic


def _rng(seed):
    return np.random.default_rng(seed)


def _data(rng, b=3, sq=2, h=4, hk=2, d=32, cache_len=24, new=3, dtype=np.float16):
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k_cache = rng.standard_normal((b, cache_len, hk, d)).astype(dtype)
    v_cache = rng.standard_normal((b, cache_len, hk, d)).astype(dtype)
    k = rng.standard_normal((b, new, hk, d)).astype(dtype)
    v = rng.standard_normal((b, new, hk, d)).astype(dtype)
    return q, k_cache, v_cache, k, v


def _to_pages(cache, page_size, rng):
    """A paged copy of a (b, s, hk, d) cache with shuffled pages, and its block table."""
    b, s, hk, d = cache.shape
    per_seq = -(-s // page_size)
    padded = np.zeros((b, per_seq * page_size, hk, d), cache.dtype)
    padded[:, :s] = cache
    order = rng.permutation(b * per_seq)
    pages = np.zeros((b * per_seq + 2, page_size, hk, d), cache.dtype)  # two spare pages
    table = np.zeros((b, per_seq), np.int32)
    for i in range(b):
        for p in range(per_seq):
            table[i, p] = order[i * per_seq + p]
            pages[table[i, p]] = padded[i, p * page_size:(p + 1) * page_size]
    return pages, table


@pytest.mark.parametrize("causal", [False, True])
def test_append_then_attend_matches_dense_attention(causal):
    rng = _rng(0)
    q, k_cache, v_cache, k, v = _data(rng)
    seqlens = np.array([5, 0, 21], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    out, lse = cuflash2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                                                return_softmax_lse=True)
    for b, n in enumerate(seqlens):
        end = n + k.shape[1]
        np.testing.assert_array_equal(kc[b, n:end], k[b])  # appended in place
        np.testing.assert_array_equal(vc[b, n:end], v[b])
        np.testing.assert_array_equal(kc[b, :n], k_cache[b, :n])  # the rest untouched
        np.testing.assert_array_equal(kc[b, end:], k_cache[b, end:])
        keys = np.concatenate([k_cache[b, :n], k[b]])[None]
        values = np.concatenate([v_cache[b, :n], v[b]])[None]
        ref, ref_lse = reference.attention_naive(q[b:b + 1], keys, values, causal=causal)
        np.testing.assert_allclose(out[b].astype(np.float64), ref[0], atol=2e-3)
        np.testing.assert_allclose(lse[b], ref_lse[0], atol=1e-4)


@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_paged_cache_matches_contiguous_cache(page_size):
    rng = _rng(page_size)
    q, k_cache, v_cache, k, v = _data(rng, cache_len=20)
    seqlens = np.array([4, 12, 0], np.int32)
    pages_k, table = _to_pages(k_cache, page_size, _rng(7))
    pages_v, _ = _to_pages(v_cache, page_size, _rng(7))
    kc, vc = k_cache.copy(), v_cache.copy()
    dense = cuflash2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)
    paged = cuflash2.flash_attn_with_kvcache(q, pages_k, pages_v, k, v, cache_seqlens=seqlens, block_table=table,
                                             causal=True)
    np.testing.assert_array_equal(paged, dense)
    for b in range(3):  # the new rows landed in the right pages
        rows = np.arange(seqlens[b], seqlens[b] + k.shape[1])
        np.testing.assert_array_equal(pages_k[table[b, rows // page_size], rows % page_size], k[b])


def _rotate_complex(x, cos, sin, positions, interleaved):
    """Rotary embedding through complex multiplication (independent of the library's code)."""
    x = x.astype(np.float64)
    half = cos.shape[1]
    angle = np.arctan2(sin[positions], cos[positions])[:, None, :]
    if interleaved:
        z = x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]
    else:
        z = x[..., :half] + 1j * x[..., half:2 * half]
    z = z * np.exp(1j * angle)
    out = x.copy()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_on_new_keys_and_queries(interleaved, causal):
    rng = _rng(3)
    q, k_cache, v_cache, k, v = _data(rng, b=2, sq=3, new=3, d=32)
    rotary_dim = 16
    theta = rng.uniform(0, 2 * np.pi, (64, rotary_dim // 2))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    seqlens = np.array([6, 10], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    out = cuflash2.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                           causal=causal, rotary_interleaved=interleaved)
    for b, n in enumerate(seqlens):
        rows = np.arange(n, n + 3)
        expected_k = _rotate_complex(k[b], cos, sin, rows, interleaved)
        np.testing.assert_allclose(kc[b, rows].astype(np.float64), expected_k, atol=4e-3)
        positions = rows if causal else np.full(3, n)
        q_rot = _rotate_complex(q[b], cos, sin, positions, interleaved).astype(q.dtype)
        keys, values = kc[b:b + 1, :n + 3], vc[b:b + 1, :n + 3]
        ref, _ = reference.attention_naive(q_rot[None], keys, values, causal=causal)
        np.testing.assert_allclose(out[b].astype(np.float64), ref[0], atol=3e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_rotary_positions_are_absolute_cache_rows_under_leftpad(causal):
    """flash-attn's convention: with cache_leftpad, new key i of sequence b still sits at rotary
    position cache_seqlens[b] + i (its cache row), not counted from the left pad."""
    rng = _rng(13)
    q, k_cache, v_cache, k, v = _data(rng, b=2, sq=3, new=3, d=32)
    theta = rng.uniform(0, 2 * np.pi, (64, 8))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    seqlens, leftpad = np.array([6, 10], np.int32), np.array([4, 7], np.int32)
    kc, vc = k_cache.copy(), v_cache.copy()
    out = cuflash2.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                           cache_leftpad=leftpad, causal=causal)
    for b, n in enumerate(seqlens):
        rows = np.arange(n, n + 3)
        np.testing.assert_allclose(kc[b, rows].astype(np.float64), _rotate_complex(k[b], cos, sin, rows, True),
                                   atol=4e-3)
        positions = rows if causal else np.full(3, n)
        q_rot = _rotate_complex(q[b], cos, sin, positions, True).astype(q.dtype)
        keys, values = kc[b:b + 1, leftpad[b]:n + 3], vc[b:b + 1, leftpad[b]:n + 3]
        ref, _ = reference.attention_naive(q_rot[None], keys, values, causal=causal)
        np.testing.assert_allclose(out[b].astype(np.float64), ref[0], atol=3e-3)


def test_leftpad_and_batch_idx():
    rng = _rng(4)
    q, k_cache, v_cache, _, _ = _data(rng, b=2, cache_len=16)
    big_k = rng.standard_normal((5, 16, 2, 32)).astype(np.float16)
    big_v = rng.standard_normal((5, 16, 2, 32)).astype(np.float16)
    idx = np.array([4, 1], np.int32)
    leftpad = np.array([3, 0], np.int32)
    seqlens = np.array([10, 7], np.int32)
    out = cuflash2.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=seqlens, cache_batch_idx=idx,
                                           cache_leftpad=leftpad)
    for b in range(2):
        keys = big_k[idx[b], leftpad[b]:seqlens[b]][None]
        values = big_v[idx[b], leftpad[b]:seqlens[b]][None]
        ref, _ = reference.attention_naive(q[b:b + 1], keys, values)
        np.testing.assert_allclose(out[b].astype(np.float64), ref[0], atol=2e-3)


def test_features_and_defaults():
    """No cache_seqlens: the whole cache is used; window, softcap and ALiBi apply."""
    rng = _rng(5)
    q, k_cache, v_cache, _, _ = _data(rng, b=2, sq=4, cache_len=12, dtype=ml_dtypes.bfloat16)
    slopes = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    out = cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, window_size=(5, -1), softcap=3.0,
                                           alibi_slopes=slopes)
    ref, _ = reference.attention_naive(q, k_cache, v_cache, causal=True, window_size=(5, -1), softcap=3.0,
                                       alibi_slopes=slopes)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-2)


@pytest.mark.parametrize("kwargs,error,fragments", [
    ({"k": "new"}, ValueError, ("k:", "together")),
    ({"k": "new", "v": "new", "cache_seqlens": None}, ValueError, ("cache_seqlens:", "required")),
    ({"cache_seqlens": np.zeros(2, np.int32)}, ValueError, ("cache_seqlens:", "(3,)", "(2,)")),
    ({"cache_seqlens": np.zeros(3, np.int64)}, TypeError, ("cache_seqlens:", "int32", "int64")),
    ({"block_table": np.zeros((3, 2), np.int32), "cache_batch_idx": np.zeros(3, np.int32)}, ValueError,
     ("cache_batch_idx:", "block_table")),
    ({"block_table": np.zeros((2, 2), np.int32)}, ValueError, ("block_table:", "(3, max_pages)", "(2, 2)")),
    ({"rotary_cos": np.ones((8, 4), np.float32)}, ValueError, ("rotary_cos:", "rotary_sin")),
    ({"rotary_cos": np.ones((8, 20), np.float32), "rotary_sin": np.ones((8, 20), np.float32)}, ValueError,
     ("rotary_cos:", "1 to 16", "20")),
    ({"num_splits": -1}, ValueError, ("num_splits:", ">= 0", "-1")),
    ({"window_size": (-3, 0)}, ValueError, ("window_size:", ">= -1")),
])
def test_validation_errors(kwargs, error, fragments):
    rng = _rng(6)
    q, k_cache, v_cache, k, v = _data(rng, b=3)
    kwargs = dict(kwargs)
    for name, value in (("k", k), ("v", v)):
        if kwargs.get(name) == "new":
            kwargs[name] = value
    kwargs.setdefault("cache_seqlens", np.zeros(3, np.int32))
    with pytest.raises(error) as info:
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_cache_dtype_mismatch_is_rejected():
    rng = _rng(8)
    q, k_cache, v_cache, _, _ = _data(rng)
    with pytest.raises(TypeError, match="k: expected dtype float16"):
        cuflash2.flash_attn_with_kvcache(q, k_cache.astype(np.float32), v_cache.astype(np.float32))


@pytest.mark.parametrize("blocks,slots,key_blocks", [(8, 264, 1024), (1, 264, 32), (64, 264, 128), (300, 264, 64),
                                                     (33, 264, 2), (5, 100, 7), (60, 100, 64), (150, 264, 64)])
def test_num_splits_heuristic(blocks, slots, key_blocks):
    splits = num_splits_heuristic(blocks, slots, key_blocks)
    assert 1 <= splits <= max(1, min(128, key_blocks))
    if blocks >= 0.8 * slots or key_blocks <= 1:
        assert splits == 1
    else:  # more thread blocks in flight than without splitting, within one wave of the slots
        assert blocks * splits > blocks or key_blocks == 1
        waves = blocks * splits / slots
        limit = min(128, key_blocks, slots)
        if blocks * limit <= slots:
            assert splits == limit  # one wave: as many blocks in flight as possible
        elif 2 * blocks <= slots:
            assert splits == slots // blocks  # exactly one full wave
        else:
            assert waves / np.ceil(waves) >= 0.5


def test_num_splits_heuristic_fills_the_gpu_for_single_sequence_decoding():
    # batch 1, 8 kv heads, one query block, 64k keys in 64-key blocks, 132 SMs x 2 slots
    splits = num_splits_heuristic(8, 264, 1024)
    assert splits == 33  # 8 x 33 = 264: every slot of the one wave busy


def test_split_kv_fills_one_decoding_block_per_sm():
    """The decoding kernel aims split-KV at one block per SM (its 4 warps already read at full
    bandwidth), the row-split tiles at two; with 132 SMs, batch 16 x 8 kv heads is not split for the
    decoding kernel, and one sequence gets 16 splits."""
    from cuflash2.families import mma_sync as config
    from cuflash2.families.mma_sync.kvcache_launches import split_slots_per_sm

    decode = config.kvcache_config(128, "bf16", False, 90, query_rows=4)
    rows64 = config.kvcache_config(128, "bf16", False, 90, query_rows=64)
    assert split_slots_per_sm(decode) == 1 and split_slots_per_sm(rows64) == 2
    sms = 132
    assert num_splits_heuristic(16 * 8, split_slots_per_sm(decode) * sms, 64) == 1
    assert num_splits_heuristic(8, split_slots_per_sm(decode) * sms, 512) == 16


@pytest.mark.parametrize("page", [None, 4])
def test_cache_overflowing_its_rows_is_an_error_naming_the_cache(page):
    """cache_seqlens + new keys past the cache's rows (the block table's pages when paged) is never
    silently clamped."""
    rng = _rng(21)
    q, k_cache, v_cache, k, v = _data(rng, b=2, sq=2, new=2, d=32)  # cache of 16 rows
    kwargs = {}
    if page:  # 3 pages of 4 rows a sequence: 12 rows
        k_cache, v_cache = (x.reshape(-1, page, *x.shape[2:]) for x in (k_cache, v_cache))
        kwargs["block_table"] = np.arange(6, dtype=np.int32).reshape(2, 3)
    rows = 12 if page else k_cache.shape[1]
    name = "block_table" if page else "k_cache"
    ok = np.array([rows - 2, 0], np.int32)
    cuflash2.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k, v, cache_seqlens=ok, **kwargs)
    with pytest.raises(ValueError, match=f"{name}: expected cache_seqlens.* <= .*{rows} .*got {rows + 1} for sequence 0"):
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([rows - 1, 0], np.int32),
                                         **kwargs)
    with pytest.raises(ValueError, match=f"{name}: expected"):
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=rows, **kwargs)
    with pytest.raises(ValueError, match="cache_seqlens: expected values >= 0"):
        cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([-1, 0], np.int32),
                                         **kwargs)
