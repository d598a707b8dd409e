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

import numpy as np

from .frameworks import adapter_for
from .problem.features import check_softcap, check_window
from .problem.tensors import check_bool
from .runtime.switches import switch_on

#: False sends every call through the full path (A/B timing of the decoding-step replay).
FAST_STEPS = True
#: Checked mode: device cache_seqlens are read back and checked against the cache's capacity before
#: the launches (one synchronisation per call, so off by default; CUFLASH2_CHECK_KVCACHE=1 turns it
#: on). Lengths given as ints or NumPy arrays are always checked: that costs nothing.
CHECK_CACHE_BOUNDS = switch_on("CUFLASH2_CHECK_KVCACHE")


def _host_lengths(cache_seqlens):
    """cache_seqlens as host values when they are already on the host (int, NumPy), else None."""
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        return int(cache_seqlens)
    return cache_seqlens if isinstance(cache_seqlens, np.ndarray) else None


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
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
              rotary_cos, rotary_sin)  # cuflash2.core.kvcache.INPUT_BUFFERS
    adapter = adapter_for(q)
    host_lengths = _host_lengths(cache_seqlens)
    checked = cache_seqlens is not None and (host_lengths is not None or CHECK_CACHE_BOUNDS)
    key = None if checked or not FAST_STEPS else adapter.kvcache_key(arrays, (softmax_scale, causal, window_size, softcap,
                                                            rotary_interleaved, num_splits, return_softmax_lse))
    result = adapter.kvcache_step(key, arrays)
    if result is not None:  # a decoding step of a signature seen before (its options were checked then)
        return result
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    return adapter.kvcache(arrays, softmax_scale, bool(causal), window, softcap, bool(rotary_interleaved),
                           int(num_splits), return_softmax_lse, key, host_lengths, checked)


