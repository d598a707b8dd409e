"""The mma.sync family's KV-cache launches: append (with rotary) into the cache, rotate q, attention
against the cache (split over the keys when the grid alone would not fill the GPU, then the partial
results combined by their LSEs), and the paged varlen forward on the same kernel.

Launches and scratch go through cuflash2.runtime.launcher: the core records a call signature's
launches once and replays them (cuflash2.core.replay).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...problem.features import Features, as_batched
from ...problem.kvcache import KVCacheProblem
from ...problem.tensors import SHORT_DTYPE, AttentionShape, TensorInfo
from ...runtime import launcher
from ...runtime.device import device_arch, sm_count
from .kernel_config import FWD_DECODE, KernelConfig, fp32_cols, with_vector_width
from .kvcache_tiles import kvcache_config, kvcache_helper_configs, paged_varlen_config
from .launches import call_vector_width, feature_args

_THREADS = 256
_MAX_SPLITS = 128  # the combine kernel's kMaxCombineSplits


def num_splits_heuristic(blocks: int, slots: int, key_blocks: int, max_splits: int = _MAX_SPLITS) -> int:
    """Splits of the key range that fill `slots` concurrent thread blocks best (pure).

    blocks: thread blocks without splitting; key_blocks: key blocks per sequence (upper bound).
    Decoding is bound by memory traffic, so more blocks in flight is better: when even the largest
    split fits in one wave it is taken, and otherwise, when at least two splits per block fit, the
    splits that fill exactly one wave (every slot busy, each block's share of the keys smallest).
    Otherwise the waves of blocks * splits over the slots should end as full as possible; among
    splits within 15% of the best wave efficiency the smallest wins (fewer partial results).
    """
    if blocks <= 0 or key_blocks <= 1 or blocks >= 0.8 * slots:
        return 1
    limit = max(1, min(max_splits, slots, key_blocks))
    if blocks * limit <= slots:  # everything fits in one wave: as many blocks in flight as possible
        return limit
    if 2 * blocks <= slots:  # one full wave
        return slots // blocks

    def efficiency(splits: int) -> float:
        waves = blocks * splits / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if efficiency(s) >= 0.85 * best)


def split_slots_per_sm(config: KernelConfig) -> int:
    """Thread blocks per SM that split-KV aims to fill. The row-split KV-cache tiles fit 2 per SM
    and need both to reach full bandwidth. One block of the decoding kernel (4 warps over the keys)
    per SM already reads at full bandwidth: splitting further only adds partial results and the
    combine (measured: batch 16 at 2k-8k keys, 1 split 1.05-1.23x 2 splits; docs/design-notes.md,
    'Decoding')."""
    return 1 if config.kernel == FWD_DECODE else 2


def kvcache(cache: KVCacheProblem, t: dict, causal: bool, features: Features, interleaved: bool,
            num_splits: int, aligns: tuple[int, int, int], device_id: int, stream) -> None:
    """The launches of one flash_attn_with_kvcache call on described tensors `t` (the call's
    buffers by name, None when absent; "lse" None when the call does not return it: scratch then).
    `aligns`: the addresses of q, k_cache and v_cache modulo 16 (the vector width)."""
    if cache.batch == 0 or cache.seqlen_q == 0:
        return
    shape = cache.shape
    dtype = SHORT_DTYPE[shape.dtype]
    rotary, combine = kvcache_helper_configs(dtype)
    out = t["out"]
    if t["k"] is not None:
        for src, dst, rotate in (("k", "k_cache", True), ("v", "v_cache", False)):
            _rotary_copy(rotary, t[src], t[dst], cache, t, device_id, stream, to_cache=True, rotate=rotate,
                         interleaved=interleaved, positions_per_row=True)
    q_used = t["q"]
    if t["rotary_cos"] is not None:
        _, q_used = launcher.scratch(t["q"].shape, np.dtype(_NUMPY_DTYPE[shape.dtype]))
        per_row = causal or tuple((features.window_left, features.window_right)) != (-1, -1)
        _rotary_copy(rotary, t["q"], q_used, cache, dict(t, cache_batch_idx=None, block_table=None), device_id,
                     stream, to_cache=False, rotate=True, interleaved=interleaved, positions_per_row=per_row)
    lse = t["lse"]
    if lse is None:
        _, lse = launcher.scratch((cache.batch, cache.nheads, cache.seqlen_q), np.float32)
    # The attention kernel and the combine read/write q (or its rotated copy), the caches and out.
    offsets = dict(zip(("q", "k_cache", "v_cache"), aligns))
    vec = call_vector_width(shape.head_dim, *(dataclasses.replace(t[name], data_ptr=offsets[name])
                                              for name in ("q", "k_cache", "v_cache")), q_used, out)
    _attention(device_id, stream, q_used, out, lse, cache, t, causal, features, num_splits,
               with_vector_width(combine, vec), vec)


# The scratch copy of q holds the same 16-bit values (as raw 16-bit words: bfloat16 has no numpy type).
_NUMPY_DTYPE = {"float16": np.float16, "bfloat16": np.uint16}


def _ptr(info):
    return np.uint64(info.data_ptr if info is not None else 0)


def _strides3(info: TensorInfo):
    return [np.int64(s) for s in info.strides[:3]]


def _rotary_copy(config, src: TensorInfo, dst: TensorInfo, cache: KVCacheProblem, sym: dict, device_id: int, stream,
                 *, to_cache, rotate, interleaved, positions_per_row) -> None:
    rows = src.shape[1]
    work = rows * src.shape[2] * cache.head_dim
    if work == 0:
        return
    if to_cache:
        dst_rows, dst_entries = cache.cache_rows, cache.cache_entries
    else:
        dst_rows, dst_entries = rows, cache.batch
    table = sym["block_table"]
    cos, sin = (sym["rotary_cos"], sym["rotary_sin"]) if rotate else (None, None)
    launcher.launch_kernel(config, device_id, stream, (math.ceil(work / _THREADS), cache.batch),
                       (_ptr(src), *_strides3(src), _ptr(dst), *_strides3(dst), np.int32(rows), np.int32(src.shape[2]),
                        np.int32(cache.head_dim), _ptr(sym["cache_seqlens"]), _ptr(sym["cache_batch_idx"]), _ptr(table), np.int64(table.strides[0] if table else 0),
                        np.int32(max(cache.page_size, 1)), np.int32(dst_rows), np.int32(dst_entries),
                        np.int32(1 if to_cache else 0), _ptr(cos), _ptr(sin), np.int32(cos.shape[0] if cos else 0),
                        np.int32(cache.rotary_dim), np.int32(1 if interleaved else 0),
                        np.int32(1 if positions_per_row else 0)))


def _decode_swap(q: TensorInfo, out: TensorInfo, shape: AttentionShape, cache: KVCacheProblem, causal: bool,
                 features: Features):
    """One-token decoding with GQA: the query heads of a kv head become rows of one query block (a
    free view), so each kv head's cache is read once instead of once per query head. Valid when
    every row sees the same keys: seqlen_q == 1, no left window, no ALiBi (its slope is per head)."""
    group = shape.kv_group
    if cache.seqlen_q != 1 or group == 1 or features.window_left >= 0 or features.alibi is not None:
        return q, out, shape, causal
    def swap(t: TensorInfo) -> TensorInfo:
        return dataclasses.replace(t, shape=(cache.batch, group, cache.nheads_kv, cache.head_dim),
                                   strides=(t.strides[0], t.strides[2], group * t.strides[2], t.strides[3]))
    shape = dataclasses.replace(shape, seqlen_q=group, nheads=cache.nheads_kv)
    # A single query row sees every key (bottom-right causal with seqlen_q = 1), so causal is moot.
    return swap(q), swap(out), shape, False


def _attention(device_id, stream, q, out, lse, cache: KVCacheProblem, sym: dict, causal, features, num_splits,
               combine, vec: int = 16) -> None:
    """The attention launch (and the split-KV combine, with its partial results in scratch)."""
    q, out, shape, causal = _decode_swap(q, out, cache.shape, cache, causal, features)
    arch = device_arch(device_id)
    config = kvcache_config(shape.head_dim, SHORT_DTYPE[shape.dtype], causal, arch, shape.seqlen_q)
    config = with_vector_width(config, vec)
    m_blocks = math.ceil(shape.seqlen_q / config.block_m)
    if num_splits == 0:
        slots = split_slots_per_sm(config) * sm_count(device_id)
        num_splits = num_splits_heuristic(m_blocks * shape.nheads * cache.batch, slots,
                                          math.ceil(cache.cache_rows / config.block_n))
    key_blocks = math.ceil(cache.cache_rows / config.block_n)
    num_splits = max(1, min(num_splits, _MAX_SPLITS, key_blocks))
    num_splits = math.ceil(key_blocks / math.ceil(key_blocks / num_splits))  # no split left without keys
    rows = cache.batch * shape.nheads * shape.seqlen_q
    partial_rows = num_splits * rows if num_splits > 1 else 0
    o_partial = lse_partial = None
    if partial_rows:  # rows fp32_cols wide, as the kernels lay them out
        _, o_partial = launcher.scratch((partial_rows, fp32_cols(shape.head_dim)), np.float32)
        _, lse_partial = launcher.scratch((partial_rows,), np.float32)
    args = _attention_args(q, sym["k_cache"], sym["v_cache"], out, lse, shape, shape.seqlen_q, cache, causal,
                           features, sym["cache_seqlens"], sym["cache_batch_idx"], sym["cache_leftpad"],
                           sym["block_table"], num_splits, o_partial, lse_partial)
    launcher.launch_kernel(config, device_id, stream, (m_blocks * num_splits, shape.nheads, cache.batch), args)
    if partial_rows:
        launcher.launch_kernel(combine, device_id, stream, (math.ceil(rows * 32 / _THREADS),),
                               (_ptr(o_partial), _ptr(lse_partial), _ptr(out), _ptr(lse), *_strides3(out),
                                np.int32(num_splits), np.int32(cache.batch), np.int32(shape.nheads),
                                np.int32(shape.seqlen_q), np.int32(shape.head_dim)))


def _attention_args(q, k_cache, v_cache, out, lse, shape: AttentionShape, seqlen_q_arg: int, cache: KVCacheProblem, causal,
                    features: Features, cache_seqlens, cache_batch_idx, cache_leftpad, table, num_splits, o_partial,
                    lse_partial) -> tuple:
    """The argument list of flash_fwd_kvcache_kernel / flash_fwd_decode_kernel (CF_FWD_PARAMS,
    CF_VARIANT_PARAMS, CF_KVCACHE_PARAMS). seqlen_q_arg: the query rows per sequence, or total_q in
    a paged varlen call (the LSE's row count)."""
    return (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(lse), *_strides3(q), *_strides3(k_cache),
            *_strides3(v_cache), *_strides3(out), np.int32(seqlen_q_arg), np.int32(cache.cache_rows),
            np.int32(shape.head_dim), np.int32(shape.kv_group), *feature_args(features, causal, shape.softmax_scale),
            _ptr(cache_seqlens), np.int32(cache.seqlen_new), _ptr(cache_batch_idx), _ptr(cache_leftpad), _ptr(table),
            np.int64(table.strides[0] if table else 0), np.int32(max(cache.page_size, 1)),
            np.int32(cache.cache_rows), np.int32(cache.cache_entries), np.int32(num_splits), _ptr(o_partial),
            _ptr(lse_partial))


def paged_varlen_forward(device_id: int, stream, q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, out: TensorInfo,
                         lse: TensorInfo, block_table: TensorInfo, shape: AttentionShape, page_size: int, causal: bool,
                         features: Features) -> None:
    """out, lse <- attention of packed q against paged K/V: the KV-cache kernel with the varlen
    sequence ranges (kernels_cu/common/variant.cuh, kvcache_seq_range). q and out are (total_q, nheads, d),
    lse (nheads, total_q); features carry cu_seqlens_q/k and total_q (validated by the caller,
    shape.seqlen_q/k being the maxima). One launch, no split of the keys: the kernel's split-KV
    partial layout is per fixed-length sequence. Launches nothing when there is no query row."""
    if shape.seqlen_q == 0 or shape.batch == 0:
        return
    config = paged_varlen_config(shape.head_dim, SHORT_DTYPE[shape.dtype], causal,
                                 device_arch(device_id), shape.seqlen_q)
    config = with_vector_width(config, call_vector_width(shape.head_dim, q, k_cache, v_cache, out))
    max_pages = block_table.shape[1]
    cache = KVCacheProblem(shape.batch, shape.seqlen_q, shape.nheads, shape.nheads_kv, shape.head_dim, 0,
                   page_size * max_pages, k_cache.shape[0], page_size, 0, shape)
    args = _attention_args(as_batched(q, shape.batch, shape.seqlen_q), k_cache, v_cache,
                           as_batched(out, shape.batch, shape.seqlen_q), lse, shape, features.total_q, cache, causal,
                           features, None, None, None, block_table, 1, None, None)
    grid = (math.ceil(shape.seqlen_q / config.block_m), shape.nheads, shape.batch)
    launcher.launch_kernel(config, device_id, stream, grid, args)
