"""A flash_attn_with_kvcache call described and checked (pure; device values such as cache_seqlens
are never read here)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .tensors import AttentionShape, TensorInfo, expect, validate_qkv


@dataclasses.dataclass(frozen=True)
class KVCacheProblem:
    """Validated description of a call."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    seqlen_new: int  # rows of k/v to append (0: none)
    cache_rows: int  # rows per sequence the cache can hold
    cache_entries: int  # batch_cache, or pages when paged
    page_size: int  # 0 when not paged
    rotary_dim: int  # 0 without rotary
    shape: AttentionShape  # q against the cache as the kernels see it (seqlen_k = cache_rows)


def check_index_array(name: str, info: TensorInfo | None, shape: tuple, device: str) -> None:
    if info is None:
        return
    expect(info.dtype == "int32", lambda: f"{name}: expected dtype int32, got {info.dtype}", TypeError)
    expect(tuple(info.shape) == shape, lambda: f"{name}: expected shape {shape}, got {tuple(info.shape)}")
    expect(info.device == device, lambda: f"{name}: expected device {device} (same as q), got {info.device}")
    expect(not info.shape or info.strides[-1] == 1 or info.shape[-1] == 1,
            lambda: f"{name}: expected a contiguous last dim, got strides {info.strides}")


def check_cache_rows(cache_seqlens, seqlen_new: int, cache_rows: int, paged: bool) -> None:
    """Every sequence's rows after the append fit the cache: 0 <= cache_seqlens[b] and
    cache_seqlens[b] + seqlen_new <= cache_rows (host values; pure). The kernels would otherwise skip
    the rows past the end, silently."""
    lengths = np.asarray(cache_seqlens, np.int64).reshape(-1)
    expect(bool((lengths >= 0).all()), lambda: f"cache_seqlens: expected values >= 0, got {lengths.min()}")
    ends = lengths + seqlen_new
    over = np.flatnonzero(ends > cache_rows)
    if over.size:
        b = int(over[0])
        where = ("block_table: expected cache_seqlens[b] + new keys <= block_table.shape[1] * page_size = "
                 if paged else "k_cache: expected cache_seqlens[b] + new keys <= seqlen_cache = ")
        raise ValueError(f"{where}{cache_rows} for every sequence, got {ends[b]} for sequence {b} "
                         f"({lengths[b]} cached + {seqlen_new} new)")


def validate_kvcache(q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, k: TensorInfo | None,
                     v: TensorInfo | None, rotary_cos: TensorInfo | None, rotary_sin: TensorInfo | None,
                     cache_seqlens: TensorInfo | None, cache_batch_idx: TensorInfo | None,
                     cache_leftpad: TensorInfo | None, block_table: TensorInfo | None, softmax_scale=None,
                     check_pointers: bool = True) -> KVCacheProblem:
    """Shapes, dtypes and devices of a flash_attn_with_kvcache call (pure; values are not read)."""
    expect(len(q.shape) == 4, lambda: f"q: expected 4 dims (batch, seqlen_q, nheads, headdim), got shape {q.shape}")
    for name, info in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect(len(info.shape) == 4, lambda: f"{name}: expected 4 dims, got shape {info.shape}")
    expect(v_cache.shape == k_cache.shape, lambda: f"v_cache: expected shape {k_cache.shape} (same as k_cache), "
                                            f"got {v_cache.shape}")
    batch, seqlen_q, nheads, head_dim = q.shape
    entries, rows, nheads_kv, cache_dim = k_cache.shape
    expect(cache_dim == head_dim, lambda: f"k_cache: expected head dim {head_dim} (same as q), got {cache_dim}")
    # Reuse the dense checks for dtypes, heads, head dim and alignment: q against a cache-shaped k.
    fake_kv = dataclasses.replace(k_cache, shape=(batch, rows, nheads_kv, head_dim))
    shape = validate_qkv(q, fake_kv, dataclasses.replace(v_cache, shape=fake_kv.shape), softmax_scale,
                         check_pointers=check_pointers)
    page_size = 0
    if block_table is not None:
        expect(len(block_table.shape) == 2 and block_table.shape[0] == batch,
                lambda: f"block_table: expected shape ({batch}, max_pages), got {tuple(block_table.shape)}")
        check_index_array("block_table", block_table, tuple(block_table.shape), q.device)
        expect(cache_batch_idx is None, lambda: "cache_batch_idx: expected None with block_table (pages are per sequence)")
        page_size = rows
        rows = page_size * block_table.shape[1]
    else:
        expect(cache_batch_idx is not None or entries >= batch,
                lambda: f"k_cache: expected a batch of at least {batch} (q's) without cache_batch_idx, got {entries}")
    seqlen_new = 0
    expect((k is None) == (v is None), lambda: "k: expected k and v to be given together, got only one of them")
    if k is not None:
        for name, info, like in (("k", k, k_cache), ("v", v, v_cache)):
            expect(len(info.shape) == 4 and info.shape[0] == batch and info.shape[2:] == (nheads_kv, head_dim),
                    lambda: f"{name}: expected shape ({batch}, seqlen_new, {nheads_kv}, {head_dim}), got {info.shape}")
            expect(info.dtype == q.dtype, lambda: f"{name}: expected dtype {q.dtype} (same as q), got {info.dtype}",
                    TypeError)
            expect(info.device == q.device, lambda: f"{name}: expected device {q.device} (same as q), got {info.device}")
        expect(v.shape == k.shape, lambda: f"v: expected shape {k.shape} (same as k), got {v.shape}")
        expect(cache_seqlens is not None, lambda: "cache_seqlens: required when k and v are appended to the cache")
        seqlen_new = k.shape[1]
    expect(seqlen_new <= rows, lambda: f"k: expected at most {rows} new rows (the cache size), got {seqlen_new}")
    for name, info in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                       ("cache_leftpad", cache_leftpad)):
        check_index_array(name, info, (batch,), q.device)
    rotary_dim = 0
    expect((rotary_cos is None) == (rotary_sin is None), lambda: "rotary_cos: expected rotary_cos and rotary_sin together")
    if rotary_cos is not None:
        for name, info in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            expect(len(info.shape) == 2, lambda: f"{name}: expected shape (seqlen_ro, rotary_dim / 2), got {info.shape}")
            expect(info.dtype in ("float16", "bfloat16", "float32"),
                    lambda: f"{name}: expected a float16, bfloat16 or float32 array, got {info.dtype}", TypeError)
            expect(info.device == q.device, lambda: f"{name}: expected device {q.device} (same as q), got {info.device}")
        expect(rotary_sin.shape == rotary_cos.shape,
                lambda: f"rotary_sin: expected shape {rotary_cos.shape} (same as rotary_cos), got {rotary_sin.shape}")
        rotary_dim = 2 * rotary_cos.shape[1]
        expect(0 < rotary_dim <= head_dim, lambda: f"rotary_cos: expected 1 to {head_dim // 2} columns (rotary_dim / 2), "
                                            f"got {rotary_cos.shape[1]}")
        expect(rotary_cos.shape[0] >= 1, lambda: "rotary_cos: expected at least one position")
    return KVCacheProblem(batch, seqlen_q, nheads, nheads_kv, head_dim, seqlen_new, rows, entries, page_size, rotary_dim,
                  dataclasses.replace(shape, seqlen_k=rows))


__all__ = ["KVCacheProblem", "check_cache_rows", "check_index_array", "validate_kvcache"]
