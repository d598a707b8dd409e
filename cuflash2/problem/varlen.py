"""Variable-length (packed) calls described and checked: cu_seqlens against the packed tensors,
paged K/V against its page table (pure; cu_seqlens values come as host copies)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .features import check_cu_seqlens, check_packed_dims, varlen_shape
from .tensors import AttentionShape, TensorInfo, check_alignment, check_grid, expect, validate_qkv


@dataclasses.dataclass(frozen=True)
class VarlenCall:
    shape: AttentionShape  # batch = number of sequences, seqlens = the maxima
    q: TensorInfo  # packed (total, nheads, dim) descriptions
    k: TensorInfo
    v: TensorInfo
    covers_all_rows: bool  # cu_seqlens_q[-1] == total_q and cu_seqlens_k[-1] == total_k


def as_one_batch(info: TensorInfo) -> TensorInfo:
    return dataclasses.replace(info, shape=(1, *info.shape), strides=(0, *info.strides))


def validate_varlen(q, k, v, softmax_scale, cu_q: TensorInfo, cu_q_values, cu_k: TensorInfo, cu_k_values, max_seqlen_q,
              max_seqlen_k, check_pointers: bool) -> VarlenCall:
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_packed_dims(name, info)
    one = validate_qkv(as_one_batch(q), as_one_batch(k), as_one_batch(v), softmax_scale,
                       check_pointers=check_pointers)
    total_q, total_k = q.shape[0], k.shape[0]
    batch = check_cu_seqlens("cu_seqlens_q", cu_q, cu_q_values, total_q, max_seqlen_q, None, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_k, cu_k_values, total_k, max_seqlen_k, batch, q.device)
    shape = varlen_shape(q, k, batch, max_seqlen_q, max_seqlen_k, one.softmax_scale)
    check_grid(shape)
    covers = int(cu_q_values[-1]) == total_q and int(cu_k_values[-1]) == total_k
    return VarlenCall(shape, q, k, v, covers)


@dataclasses.dataclass(frozen=True)
class PagedVarlenCall:
    shape: AttentionShape  # batch = number of sequences, seqlens = the maxima
    q: TensorInfo  # packed (total_q, nheads, dim)
    k: TensorInfo  # paged (num_blocks, page_size, nheads_kv, dim)
    v: TensorInfo
    block_table: TensorInfo  # int32 (batch, max_num_blocks_per_seq)
    page_size: int
    covers_all_rows: bool  # cu_seqlens_q[-1] == total_q


def validate_paged_varlen(q: TensorInfo, k: TensorInfo, v: TensorInfo, block_table: TensorInfo, softmax_scale,
                          cu_q: TensorInfo, cu_q_values, cu_k: TensorInfo, cu_k_values, max_seqlen_q: int,
                          max_seqlen_k: int, check_pointers: bool = True) -> PagedVarlenCall:
    """Checks of a flash_attn_varlen_func call with block_table (pure; cu_*_values: host copies of
    cu_seqlens). Every sequence's key count must fit its row of the page table."""
    check_packed_dims("q", q)
    for name, info in (("k", k), ("v", v)):
        expect(len(info.shape) == 4, lambda: f"{name}: expected 4 dims (num_blocks, page_size, nheads_k, headdim) "
                                              f"with block_table, got shape {info.shape}")
    expect(v.shape == k.shape, lambda: f"v: expected shape {k.shape} (same as k: pages of the same cache), "
                                       f"got {v.shape}")
    num_blocks, page_size = k.shape[:2]
    expect(page_size >= 1, lambda: f"k: expected a page size (dim 1) of at least 1, got shape {k.shape}")
    expect(block_table.dtype == "int32", lambda: f"block_table: expected dtype int32, got {block_table.dtype}",
           TypeError)
    expect(len(block_table.shape) == 2, lambda: f"block_table: expected 2 dims (batch, max_num_blocks_per_seq), "
                                                f"got shape {tuple(block_table.shape)}")
    expect(block_table.device == q.device,
           lambda: f"block_table: expected device {q.device} (same as q), got {block_table.device}")
    expect(block_table.shape[1] <= 1 or block_table.strides[1] == 1,
           lambda: f"block_table: expected a contiguous last dim, got strides {block_table.strides}")
    # dtypes, heads, head dim and alignment: q as one batch against one page of k/v
    one_page = {name: dataclasses.replace(info, shape=(1, *info.shape[1:])) for name, info in (("k", k), ("v", v))}
    one = validate_qkv(as_one_batch(q), one_page["k"], one_page["v"], softmax_scale, check_pointers=check_pointers)
    if check_pointers:
        for name, info in (("k", k), ("v", v)):
            check_alignment(name, info)
    total_q = q.shape[0]
    batch = check_cu_seqlens("cu_seqlens_q", cu_q, cu_q_values, total_q, max_seqlen_q, None, q.device)
    values_k = np.asarray(cu_k_values, dtype=np.int64)
    # cu_seqlens_k counts keys in the pages, not rows of k: its last entry has no packed bound
    check_cu_seqlens("cu_seqlens_k", cu_k, values_k, max(int(values_k[-1]), 0) if values_k.size else 0,
                     max_seqlen_k, batch, q.device)
    expect(block_table.shape[0] == batch,
           lambda: f"block_table: expected shape ({batch}, max_num_blocks_per_seq) (batch from cu_seqlens_q), "
                   f"got {tuple(block_table.shape)}")
    capacity = block_table.shape[1] * page_size
    lengths = np.diff(values_k)
    longest = int(lengths.max())
    expect(longest <= capacity,
           lambda: f"block_table: expected at most {block_table.shape[1]} pages x {page_size} rows = {capacity} keys "
                   f"per sequence, got sequence {int(lengths.argmax())} with {longest} keys (cu_seqlens_k)")
    shape = AttentionShape(batch, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[2], q.shape[2], q.dtype,
                           one.softmax_scale)
    check_grid(shape)
    return PagedVarlenCall(shape, q, k, v, block_table, page_size, int(cu_q_values[-1]) == total_q)


def check_packed_like(name: str, info: TensorInfo, like: TensorInfo) -> None:
    if info.shape != like.shape:
        raise ValueError(f"{name}: expected shape {like.shape}, got {info.shape}")
    if info.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype}, got {info.dtype}")
    if info.strides[-1] != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got stride {info.strides[-1]}")


def check_varlen_lse(info: TensorInfo, nheads: int, total_q: int) -> None:
    expected = (nheads, total_q)
    if tuple(info.shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected} (nheads, total_q), got {tuple(info.shape)}")
    if info.dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {info.dtype}")
    if info.strides != (total_q, 1):
        raise ValueError(f"softmax_lse: expected a contiguous array, got strides {info.strides}")


__all__ = ["PagedVarlenCall", "VarlenCall", "as_one_batch", "check_packed_like", "check_varlen_lse", "validate_paged_varlen",
           "validate_varlen"]
