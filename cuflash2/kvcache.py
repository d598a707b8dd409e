"""Inference with a KV cache: FlashAttention-2's flash_attn_with_kvcache.

Flow of one GPU call: validate shapes on the host (device values such as cache_seqlens are never
read back, so a decoding step does not synchronise) -> append the new k/v rows to the cache in place
(rotary embedding applied to k on the way) -> rotate q into a scratch copy if asked -> attention of q
against the cache, split over the keys when the grid alone would not fill the GPU (split-KV), then
the partial results combined by their LSEs.

Semantics (FA2's): k_cache/v_cache are (batch_cache, seqlen_cache, nheads_kv, headdim), or with
block_table (num_pages, page_size, nheads_kv, headdim) pages listed per sequence in block_table
(batch, max_pages) int32; any page size works. cache_seqlens (int or int32 (batch,)) are the cache
lengths before appending; sequence b attends to cache rows [cache_leftpad[b], cache_seqlens[b] +
seqlen_new). Masks are bottom-right aligned on those keys. Rotary positions are absolute cache rows,
as in flash-attn, whatever cache_leftpad says: new key i sits at cache_seqlens[b] + i; q rows at the
same positions when causal or windowed, all at cache_seqlens[b] otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np

from . import interop, kvcache_step, launch, reference
from .api import numpy_alibi
from .config import (FWD_DECODE, KernelConfig, fp32_cols, kvcache_config, kvcache_helper_configs, paged_varlen_config,
                     with_vector_width)
from .features import Features, as_batched, check_alibi, check_softcap, check_window
from .validate import (
    AttentionShape,
    TensorInfo,
    check_alignment,
    contiguous_info,
    expect,
    softmax_scale_or_default,
    validate_qkv,
)
from .validate import check_bool

_THREADS = 256
_MAX_SPLITS = 128  # the combine kernel's kMaxCombineSplits
#: False sends every call through the full path (A/B timing of the decoding-step fast path).
FAST_STEPS = True
#: Checked mode: device cache_seqlens are read back and checked against the cache's capacity before
#: the launches (one synchronisation per call, so off by default; CUFLASH2_CHECK_KVCACHE=1 turns it
#: on). Lengths given as ints or NumPy arrays are always checked: that costs nothing.
CHECK_CACHE_BOUNDS = os.environ.get("CUFLASH2_CHECK_KVCACHE", "0") not in ("", "0")


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


@dataclasses.dataclass(frozen=True)
class _Cache:
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


def _check_index_array(name: str, info: TensorInfo | None, shape: tuple, device: str) -> None:
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


def _host_lengths(cache_seqlens):
    """cache_seqlens as host values when they are already on the host (int, NumPy), else None."""
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        return int(cache_seqlens)
    return cache_seqlens if isinstance(cache_seqlens, np.ndarray) else None


def validate_kvcache(q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, k: TensorInfo | None,
                     v: TensorInfo | None, rotary_cos: TensorInfo | None, rotary_sin: TensorInfo | None,
                     cache_seqlens: TensorInfo | None, cache_batch_idx: TensorInfo | None,
                     cache_leftpad: TensorInfo | None, block_table: TensorInfo | None, softmax_scale=None,
                     check_pointers: bool = True) -> _Cache:
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
        _check_index_array("block_table", block_table, tuple(block_table.shape), q.device)
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
        _check_index_array(name, info, (batch,), q.device)
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
    return _Cache(batch, seqlen_q, nheads, nheads_kv, head_dim, seqlen_new, rows, entries, page_size, rotary_dim,
                  dataclasses.replace(shape, seqlen_k=rows))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q against a KV cache, appending k/v to it in place first (see the module doc).

    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads, seqlen_q))
    with return_softmax_lse. num_splits: 0 picks a split of the keys that fills the GPU; 1 disables
    split-KV. No autograd (inference). cache_seqlens given as an int (or NumPy values) are checked
    against the cache: cache_seqlens + new keys beyond it (block_table.shape[1] * page_size when
    paged) is a ValueError. Device arrays are checked so only in checked mode (CHECK_CACHE_BOUNDS,
    env CUFLASH2_CHECK_KVCACHE=1), which reads them back (a synchronisation per call); otherwise,
    like FA2, out-of-range device values (cache_seqlens, cache_batch_idx, block_table, ...) are not
    read on the host, and the kernels clamp or skip them, so they never read or write outside the
    given buffers.
    """
    if interop.framework_of(q) == "torch":
        from . import torch_ops

        if torch_ops.traced(q):  # torch.compile: the custom op that mutates the caches
            return torch_ops.kvcache_traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                            window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                            return_softmax_lse)
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
              rotary_cos, rotary_sin)  # kvcache_step.INPUT_BUFFERS
    host_lengths = _host_lengths(cache_seqlens)
    checked = cache_seqlens is not None and (host_lengths is not None or CHECK_CACHE_BOUNDS)
    step_key = kvcache_step.call_key(q, arrays, (softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                                 num_splits, return_softmax_lse)) \
        if FAST_STEPS and launch.PACKED_LAUNCH and not checked else None
    step = kvcache_step.lookup(step_key)
    if step is not None:  # a decoding step of a signature seen before
        result = step(arrays)
        if result is not None:
            return result
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    if interop.framework_of(q) == "numpy":
        return _kvcache_numpy(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, window, softcap, rotary_interleaved,
                              alibi_slopes, return_softmax_lse)
    if interop.framework_of(q) == "jax":
        raise NotImplementedError("q: flash_attn_with_kvcache updates the cache in place; JAX arrays are immutable")
    with interop.gpu_call(q) as call:
        if checked:
            lengths = host_lengths if host_lengths is not None else call.to_cupy("cache_seqlens", cache_seqlens).get()
            fast_step = (None, ())
        else:
            lengths, fast_step = None, (step_key, arrays)
        return _kvcache_gpu(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, bool(causal), window, softcap,
                            bool(rotary_interleaved), alibi_slopes, int(num_splits), return_softmax_lse,
                            fast_step, lengths)


# ---- GPU ----------------------------------------------------------------------------------------
# A decoding loop makes the same call every step with new buffers. Everything but the buffer
# addresses (validation, tile and split choice, the launches' argument lists) is therefore worked
# out once per call signature and kept as a _Plan whose arguments hold symbolic addresses; a step
# then costs the descriptions of its inputs, the output allocations and the launches.

# Buffers a plan refers to. At plan time each one's data_ptr is _SYMBOLIC + 16 * slot, an address
# no real allocation has, so the pointer arguments can be found in the argument lists by value.
_BUFFERS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
            "block_table", "alibi_slopes", "rotary_cos", "rotary_sin", "out", "lse", "q_rot", "o_partial",
            "lse_partial")
_SLOT = {name: slot for slot, name in enumerate(_BUFFERS)}
_SYMBOLIC = 1 << 60
_MAX_PLANS = 256


def _symbolic(name: str, info: TensorInfo | None) -> TensorInfo | None:
    return None if info is None else dataclasses.replace(info, data_ptr=_SYMBOLIC + 16 * _SLOT[name])


def _contiguous(name: str, shape: tuple, dtype: str, itemsize: int) -> TensorInfo:
    return _symbolic(name, contiguous_info(shape, dtype, itemsize))


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One kernel launch of a plan; `pointer_slots` are (argument index, buffer name)."""

    config: KernelConfig
    grid: tuple
    args: tuple
    pointer_slots: tuple

    @staticmethod
    def of(config: KernelConfig, grid: tuple, args: tuple) -> _Launch:
        slots = tuple((i, _BUFFERS[(int(a) - _SYMBOLIC) // 16]) for i, a in enumerate(args)
                      if type(a) is np.uint64 and int(a) >= _SYMBOLIC)
        return _Launch(config, grid, tuple(args), slots)

    def run(self, call, pointers: dict) -> None:
        args = list(self.args)
        for index, name in self.pointer_slots:
            args[index] = np.uint64(pointers[name])
        launch.launch_kernel(self.config, call.device_id, call.stream, self.grid, args)


@dataclasses.dataclass(frozen=True)
class _Plan:
    cache: _Cache
    launches: tuple[_Launch, ...]
    rotate_q: bool  # q is rotated into a scratch copy first
    partial_rows: int  # split-KV partial result rows (0: no split)


_plans: dict = {}


def clear_plans() -> None:
    """Forget every launch plan and fast-path step (after changing a tile rule, for instance)."""
    _plans.clear()
    kvcache_step.clear()


def _kvcache_gpu(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, softmax_scale, causal, window, softcap, interleaved, alibi_slopes,
                 num_splits, return_softmax_lse, fast_step=(None, ()), host_lengths=None):
    cp = interop.import_cupy()
    infos, keep = _describe_inputs(call, cp, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, cache_leftpad, block_table, alibi_slopes)
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = softmax_scale_or_default(softmax_scale, 1)  # a hashable float (or a clear error)
    # The plan's vector width depends on the alignment of the attention kernel's pointers (up to 16
    # bytes) as well as on the strides: both are part of the key.
    aligns = tuple(infos[name].data_ptr & 15 for name in ("q", "k_cache", "v_cache"))
    key = (call.device_id, tuple(None if i is None else (i.shape, i.strides, i.dtype, i.device) for i in infos.values()),
           softmax_scale, causal, window, softcap, interleaved, num_splits, aligns)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(call.device_id, infos, softmax_scale, causal, window, softcap, interleaved, num_splits,
                          aligns)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    for name in ("q", "k_cache", "v_cache"):  # addresses change per call; shapes and strides were checked
        check_alignment(name, infos[name])
    cache = plan.cache
    if host_lengths is not None:
        check_cache_rows(host_lengths, cache.seqlen_new, cache.cache_rows, cache.page_size > 0)
    out, out_i = call.empty(infos["q"].shape, cache.shape.dtype, like=q)
    lse, lse_i = call.empty((cache.batch, cache.nheads, cache.seqlen_q), "float32")
    pointers = {name: info.data_ptr for name, info in infos.items() if info is not None}
    pointers["out"], pointers["lse"] = out_i.data_ptr, lse_i.data_ptr
    if plan.rotate_q:
        q_rot, q_rot_i = call.empty(infos["q"].shape, cache.shape.dtype, like=q)
        keep.append(q_rot)
        pointers["q_rot"] = q_rot_i.data_ptr
    if plan.partial_rows:  # one fp32 scratch: partial outputs, then their LSEs
        cols = fp32_cols(cache.head_dim)  # partial rows padded to 8 columns (the kernels' fp32_cols)
        partial = cp.empty(plan.partial_rows * (cols + 1), dtype=np.float32)
        keep.append(partial)
        pointers["o_partial"] = partial.data.ptr
        pointers["lse_partial"] = partial.data.ptr + plan.partial_rows * cols * 4
    for step in plan.launches:
        step.run(call, pointers)
    step_key, arrays = fast_step
    if kvcache_step.lookup(step_key) is None:
        kvcache_step.register(step_key, plan, infos, arrays, call.device_id, q, bool(return_softmax_lse))
    del keep  # stream-ordered: the scratch is reused only by work queued after this point
    return (call.result(out), call.result(lse)) if return_softmax_lse else call.result(out)


def _describe_inputs(call, cp, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, block_table, alibi_slopes) -> tuple[dict, list]:
    """({buffer name: TensorInfo or None}, arrays to keep alive). The caches are outputs (written in
    place, never copied); rotary tables are described as given but point at fp32 copies."""
    infos = {"q": call.tensor("q", q), "k_cache": call.output("k_cache", k_cache),
             "v_cache": call.output("v_cache", v_cache),
             "k": call.tensor("k", k) if k is not None else None,
             "v": call.tensor("v", v) if v is not None else None}
    keep = []
    batch = infos["q"].shape[0] if len(infos["q"].shape) == 4 else 0
    for name, x in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            x = cp.full((batch,), int(x), dtype=np.int32)
            keep.append(x)
            infos[name] = interop.describe(name, x)
        else:
            infos[name] = call.tensor(name, x) if x is not None else None
    infos["block_table"] = call.tensor("block_table", block_table) if block_table is not None else None
    infos["alibi_slopes"] = call.tensor("alibi_slopes", alibi_slopes) if alibi_slopes is not None else None
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        infos[name] = None
        if x is not None:
            given = call.to_cupy(name, x)
            fp32 = given if given.dtype == np.float32 and given.flags.c_contiguous else \
                cp.ascontiguousarray(interop.as_float32(cp, given))
            keep.append(fp32)
            infos[name] = dataclasses.replace(interop.describe(name, given), data_ptr=fp32.data.ptr)
    if infos["rotary_cos"] is not None and infos["cache_seqlens"] is None:
        # q's rotary position is the cache length: without lengths every sequence fills the cache
        rows = infos["k_cache"].shape[1] if len(infos["k_cache"].shape) == 4 else 0
        if block_table is not None and len(infos["block_table"].shape) == 2:
            rows *= infos["block_table"].shape[1]
        full = cp.full((batch,), rows, dtype=np.int32)
        keep.append(full)
        infos["cache_seqlens"] = interop.describe("cache_seqlens", full)
    return infos, keep


def _make_plan(device_id: int, infos: dict, softmax_scale, causal, window, softcap, interleaved, num_splits,
               aligns: tuple[int, ...] = (0, 0, 0)) -> _Plan:
    """Validate a call signature and lay out its launches (pointers symbolic; `aligns`: the real
    addresses of q, k_cache and v_cache modulo 16, for the vector width)."""
    sym = {name: _symbolic(name, info) for name, info in infos.items()}
    cache = validate_kvcache(sym["q"], sym["k_cache"], sym["v_cache"], sym["k"], sym["v"], sym["rotary_cos"],
                             sym["rotary_sin"], sym["cache_seqlens"], sym["cache_batch_idx"], sym["cache_leftpad"],
                             sym["block_table"], softmax_scale, check_pointers=False)
    shape = cache.shape
    if sym["alibi_slopes"] is not None:
        check_alibi(sym["alibi_slopes"], shape.batch, shape.nheads, sym["q"].device)
    features = Features(window[0], window[1], softcap, sym["alibi_slopes"])
    if cache.batch == 0 or cache.seqlen_q == 0:
        return _Plan(cache, (), False, 0)
    dtype = launch.SHORT_DTYPE[shape.dtype]
    rotary, combine = kvcache_helper_configs(dtype)
    out = _contiguous("out", sym["q"].shape, shape.dtype, sym["q"].itemsize)
    launches = []
    if sym["k"] is not None:
        for src, dst, rotate in (("k", "k_cache", True), ("v", "v_cache", False)):
            launches += _rotary_copy(rotary, sym[src], sym[dst], cache, sym, to_cache=True, rotate=rotate,
                                     interleaved=interleaved, positions_per_row=True)
    q_used = sym["q"]
    rotate_q = sym["rotary_cos"] is not None
    if rotate_q:
        q_used = dataclasses.replace(out, data_ptr=_symbolic("q_rot", out).data_ptr)
        per_row = causal or window != (-1, -1)
        launches += _rotary_copy(rotary, sym["q"], q_used, cache, dict(sym, cache_batch_idx=None, block_table=None),
                                 to_cache=False, rotate=True, interleaved=interleaved, positions_per_row=per_row)
    lse = _contiguous("lse", (cache.batch, cache.nheads, cache.seqlen_q), "float32", 4)
    # The attention kernel and the combine read/write q (or its rotated copy), the caches and out.
    offsets = dict(zip(("q", "k_cache", "v_cache"), aligns))
    vec = launch.call_vector_width(shape.head_dim, *(dataclasses.replace(sym[name], data_ptr=offsets[name])
                                                     for name in ("q", "k_cache", "v_cache")), q_used, out)
    attention, partial_rows = _attention(device_id, q_used, out, lse, cache, sym, causal, features, num_splits,
                                         with_vector_width(combine, vec), vec)
    return _Plan(cache, tuple(launches + attention), rotate_q, partial_rows)


@functools.cache
def _sm_count(device_id: int) -> int:
    """Streaming multiprocessors (cached: reading device attributes costs far more than a launch)."""
    cp = interop.import_cupy()
    return cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def _ptr(info):
    return np.uint64(info.data_ptr if info is not None else 0)


def _strides3(info: TensorInfo):
    return [np.int64(s) for s in info.strides[:3]]


def _rotary_copy(config, src: TensorInfo, dst: TensorInfo, cache: _Cache, sym: dict, *, to_cache, rotate, interleaved,
                 positions_per_row) -> list[_Launch]:
    rows = src.shape[1]
    work = rows * src.shape[2] * cache.head_dim
    if work == 0:
        return []
    if to_cache:
        dst_rows, dst_entries = cache.cache_rows, cache.cache_entries
    else:
        dst_rows, dst_entries = rows, cache.batch
    table = sym["block_table"]
    cos, sin = (sym["rotary_cos"], sym["rotary_sin"]) if rotate else (None, None)
    return [_Launch.of(config, (math.ceil(work / _THREADS), cache.batch),
                       (_ptr(src), *_strides3(src), _ptr(dst), *_strides3(dst), np.int32(rows), np.int32(src.shape[2]),
                        np.int32(cache.head_dim), _ptr(sym["cache_seqlens"]), _ptr(sym["cache_batch_idx"]), _ptr(table), np.int64(table.strides[0] if table else 0),
                        np.int32(max(cache.page_size, 1)), np.int32(dst_rows), np.int32(dst_entries),
                        np.int32(1 if to_cache else 0), _ptr(cos), _ptr(sin), np.int32(cos.shape[0] if cos else 0),
                        np.int32(cache.rotary_dim), np.int32(1 if interleaved else 0),
                        np.int32(1 if positions_per_row else 0)))]


def _decode_swap(q: TensorInfo, out: TensorInfo, shape: AttentionShape, cache: _Cache, causal: bool,
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


def _attention(device_id, q, out, lse, cache: _Cache, sym: dict, causal, features, num_splits,
               combine, vec: int = 16) -> tuple[list[_Launch], int]:
    """The attention launch (and the split-KV combine): (launches, partial result rows)."""
    q, out, shape, causal = _decode_swap(q, out, cache.shape, cache, causal, features)
    arch = launch.device_arch(device_id)
    config = kvcache_config(shape.head_dim, launch.SHORT_DTYPE[shape.dtype], causal, arch, shape.seqlen_q)
    config = with_vector_width(config, vec)
    m_blocks = math.ceil(shape.seqlen_q / config.block_m)
    if num_splits == 0:
        slots = split_slots_per_sm(config) * _sm_count(device_id)
        num_splits = num_splits_heuristic(m_blocks * shape.nheads * cache.batch, slots,
                                          math.ceil(cache.cache_rows / config.block_n))
    key_blocks = math.ceil(cache.cache_rows / config.block_n)
    num_splits = max(1, min(num_splits, _MAX_SPLITS, key_blocks))
    num_splits = math.ceil(key_blocks / math.ceil(key_blocks / num_splits))  # no split left without keys
    rows = cache.batch * shape.nheads * shape.seqlen_q
    partial_rows = num_splits * rows if num_splits > 1 else 0
    o_partial = _symbolic("o_partial", lse) if partial_rows else None
    lse_partial = _symbolic("lse_partial", lse) if partial_rows else None
    args = _attention_args(q, sym["k_cache"], sym["v_cache"], out, lse, shape, shape.seqlen_q, cache, causal,
                           features, sym["cache_seqlens"], sym["cache_batch_idx"], sym["cache_leftpad"],
                           sym["block_table"], num_splits, o_partial, lse_partial)
    launches = [_Launch.of(config, (m_blocks * num_splits, shape.nheads, cache.batch), args)]
    if partial_rows:
        launches.append(_Launch.of(combine, (math.ceil(rows * 32 / _THREADS),),
                                   (_ptr(o_partial), _ptr(lse_partial), _ptr(out), _ptr(lse), *_strides3(out),
                                    np.int32(num_splits), np.int32(cache.batch), np.int32(shape.nheads),
                                    np.int32(shape.seqlen_q), np.int32(shape.head_dim))))
    return launches, partial_rows


def _attention_args(q, k_cache, v_cache, out, lse, shape: AttentionShape, seqlen_q_arg: int, cache: _Cache, causal,
                    features: Features, cache_seqlens, cache_batch_idx, cache_leftpad, table, num_splits, o_partial,
                    lse_partial) -> tuple:
    """The argument list of flash_fwd_kvcache_kernel / flash_fwd_decode_kernel (CF_FWD_PARAMS,
    CF_VARIANT_PARAMS, CF_KVCACHE_PARAMS). seqlen_q_arg: the query rows per sequence, or total_q in
    a paged varlen call (the LSE's row count)."""
    return (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(lse), *_strides3(q), *_strides3(k_cache),
            *_strides3(v_cache), *_strides3(out), np.int32(seqlen_q_arg), np.int32(cache.cache_rows),
            np.int32(shape.head_dim), np.int32(shape.kv_group), *features.kernel_args(causal, shape.softmax_scale),
            _ptr(cache_seqlens), np.int32(cache.seqlen_new), _ptr(cache_batch_idx), _ptr(cache_leftpad), _ptr(table),
            np.int64(table.strides[0] if table else 0), np.int32(max(cache.page_size, 1)),
            np.int32(cache.cache_rows), np.int32(cache.cache_entries), np.int32(num_splits), _ptr(o_partial),
            _ptr(lse_partial))


# ---- paged varlen (flash_attn_varlen_func with block_table) -------------------------------------

def paged_varlen_forward(call, q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, out: TensorInfo,
                         lse: TensorInfo, block_table: TensorInfo, shape: AttentionShape, page_size: int, causal: bool,
                         features: Features) -> None:
    """out, lse <- attention of packed q against paged K/V: the KV-cache kernel with the varlen
    sequence ranges (kernels_cu/variant.cuh, kvcache_seq_range). q and out are (total_q, nheads, d),
    lse (nheads, total_q); features carry cu_seqlens_q/k and total_q (validated by the caller,
    shape.seqlen_q/k being the maxima). One launch, no split of the keys: the kernel's split-KV
    partial layout is per fixed-length sequence. Launches nothing when there is no query row."""
    if shape.seqlen_q == 0 or shape.batch == 0:
        return
    config = paged_varlen_config(shape.head_dim, launch.SHORT_DTYPE[shape.dtype], causal,
                                 launch.device_arch(call.device_id), shape.seqlen_q)
    config = with_vector_width(config, launch.call_vector_width(shape.head_dim, q, k_cache, v_cache, out))
    max_pages = block_table.shape[1]
    cache = _Cache(shape.batch, shape.seqlen_q, shape.nheads, shape.nheads_kv, shape.head_dim, 0,
                   page_size * max_pages, k_cache.shape[0], page_size, 0, shape)
    args = _attention_args(as_batched(q, shape.batch, shape.seqlen_q), k_cache, v_cache,
                           as_batched(out, shape.batch, shape.seqlen_q), lse, shape, features.total_q, cache, causal,
                           features, None, None, None, block_table, 1, None, None)
    grid = (math.ceil(shape.seqlen_q / config.block_m), shape.nheads, shape.batch)
    launch.launch_kernel(config, call.device_id, call.stream, grid, args)


# ---- NumPy (CPU reference of the same semantics) ------------------------------------------------

def _rotate(x, cos, sin, positions, interleaved):
    """x (rows, heads, d) float32 rotated at integer positions (rows,)."""
    half = cos.shape[1]
    rot = 2 * half
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half], out[..., half:rot] = a * c - b * s, a * s + b * c
    return out


def _kvcache_numpy(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, window, softcap, interleaved, alibi_slopes, return_softmax_lse):
    arrays = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
              "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
              "block_table": block_table}
    for name, x in arrays.items():
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    batch = q.shape[0] if q.ndim == 4 else 0
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full((batch,), int(cache_seqlens), np.int32)
    if cache_seqlens is not None and not isinstance(cache_seqlens, np.ndarray):
        raise TypeError(f"cache_seqlens: expected an int or a NumPy array like q, got {type(cache_seqlens).__name__}")
    d = interop.describe
    cache = validate_kvcache(*(d(n, x) if x is not None else None for n, x in (
        ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad), ("block_table", block_table))), softmax_scale, check_pointers=False)
    shape = cache.shape
    if cache_seqlens is not None:
        check_cache_rows(cache_seqlens, cache.seqlen_new, cache.cache_rows, block_table is not None)
    slopes = numpy_alibi(alibi_slopes, shape)
    seqlens = (np.asarray(cache_seqlens, np.int64) if cache_seqlens is not None
               else np.full((batch,), cache.cache_rows, np.int64))
    leftpad = np.asarray(cache_leftpad, np.int64) if cache_leftpad is not None else np.zeros(batch, np.int64)
    cos = None if rotary_cos is None else np.asarray(rotary_cos, np.float32)
    sin = None if rotary_sin is None else np.asarray(rotary_sin, np.float32)

    def rows_of(b, positions):  # (cache entry or page, row) for logical rows of sequence b
        positions = np.asarray(positions)
        if block_table is not None:
            return block_table[b, positions // cache.page_size], positions % cache.page_size
        entry = cache_batch_idx[b] if cache_batch_idx is not None else b
        return np.full(positions.shape, entry), positions

    out = np.zeros(q.shape, q.dtype)
    lse = np.full((batch, cache.nheads, cache.seqlen_q), np.inf, np.float32)
    for b in range(batch):
        start, pad = int(seqlens[b]), int(leftpad[b])
        if k is not None:
            new_rows = np.arange(start, start + cache.seqlen_new)
            kn = np.asarray(k[b], np.float32)
            if cos is not None:
                kn = _rotate(kn, cos, sin, new_rows, interleaved)  # absolute rows, left pad included
            entries, rows = rows_of(b, new_rows)
            k_cache[entries, rows] = kn.astype(k_cache.dtype)
            v_cache[entries, rows] = v[b]
        end = start + cache.seqlen_new
        entries, rows = rows_of(b, np.arange(pad, end))
        kb, vb = k_cache[entries, rows][None], v_cache[entries, rows][None]
        qb = np.asarray(q[b], np.float32)
        if cos is not None:
            per_row = causal or window != (-1, -1)
            positions = start + (np.arange(cache.seqlen_q) if per_row else np.zeros(cache.seqlen_q, np.int64))
            qb = _rotate(qb, cos, sin, positions, interleaved).astype(q.dtype).astype(np.float32)
        if kb.shape[1] == 0:
            continue
        o, l_b = reference.attention_tiled(qb[None].astype(q.dtype), kb, vb, softmax_scale=shape.softmax_scale,
                                           causal=causal, window_size=window, softcap=softcap,
                                           alibi_slopes=None if slopes is None else
                                           np.broadcast_to(slopes.reshape(-1, cache.nheads), (batch, cache.nheads))[b:b + 1],
                                           p_dtype=q.dtype)
        out[b] = o[0].astype(q.dtype)
        lse[b] = l_b[0]
    return (out, lse) if return_softmax_lse else out


__all__ = ["flash_attn_with_kvcache", "num_splits_heuristic", "validate_kvcache"]
