"""Variable-length (packed) batches, FlashAttention-2's varlen API.

Sequences are packed along the first axis: q is (total_q, nheads, headdim), k and v are
(total_k, nheads_kv, headdim), and sequence b occupies rows cu_seqlens[b] : cu_seqlens[b + 1]
(int32, batch + 1 entries, starting at 0). softmax_lse is (nheads, total_q). Masks, softcap and
ALiBi apply per sequence, with each sequence's own seqlen_q and seqlen_k.

cu_seqlens are checked on the host (dtype, shape, first entry 0, non-decreasing, within the packed
tensors, no sequence longer than max_seqlen), which costs one small device-to-host copy per call.
Rows past the last sequence get out = 0, softmax_lse = +inf and zero gradients.

Paged KV (block_table, FA2's chunked-prefill signature; forward only): k and v are paged caches
(num_blocks, page_size, nheads_kv, headdim), any page size, and block_table int32 (batch,
max_num_blocks_per_seq) lists each sequence's pages: key j of sequence b is row j % page_size of
page block_table[b, j // page_size]. cu_seqlens_k then gives each sequence's key count (cumulative,
not rows of k); every count must fit its row of block_table (checked on the host with the other
cu_seqlens checks). Causal masks are bottom-right aligned per sequence, so a chunk of new queries
sees the whole cached prefix and itself. Window, softcap and ALiBi work as without paging; dropout
is rejected, and torch inputs that require grad are refused up front (there is no backward, as in
FA2; with JAX, differentiating raises). Page ids outside [0, num_blocks) read as zero keys on the GPU (not checked on the host, so no
device values beyond cu_seqlens are read back); the NumPy path rejects them.
"""

from __future__ import annotations

from . import dropout as dropout_rng
from .api import call_dropout
from .frameworks import adapter_for
from .problem.features import check_max_seqlen, check_softcap, check_window
from .problem.options import AttentionOptions, resolve_dropout
from .problem.tensors import check_bool
from .problem.varlen import validate_paged_varlen


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, out=None,
                           dropout_seed=None):
    """Attention over packed variable-length sequences; options as flash_attn_func.

    Returns out (total_q, nheads, headdim), or (out, softmax_lse, attn_probs) when return_attn_probs:
    softmax_lse fp32 (nheads, total_q); attn_probs fp32 (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero outside each sequence (testing only). block_table: k and v are paged caches (module doc;
    forward only).
    """
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    if block_table is not None:
        return _paged_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, out)
    adapter = adapter_for(q)
    dropout = call_dropout(adapter.name, dropout_p, dropout_seed)
    window, softcap = check_window(window_size), check_softcap(softcap)
    max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
    options = AttentionOptions(softmax_scale, causal, window, softcap, deterministic, dropout)
    out, lse, dropout = adapter.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 alibi_slopes, options, out, dropout_seed is not None,
                                                 return_attn_probs)
    if not return_attn_probs:
        return out
    return out, lse, adapter.varlen_probs(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          alibi_slopes, options._replace(dropout=dropout))


def _max_seqlens(max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    return check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k", max_seqlen_k)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None,
                                    dropout_seed=None):
    """As flash_attn_varlen_func with kv of shape (total_k, 2, nheads_kv, headdim)."""
    _check_packed("kv", kv, 2)
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, out=out, dropout_seed=dropout_seed)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, out=None, dropout_seed=None):
    """As flash_attn_varlen_func with qkv of shape (total, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 3)
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, out=out, dropout_seed=dropout_seed)


def _paged_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, return_attn_probs, block_table, out):
    """flash_attn_varlen_func with block_table: forward only."""
    check_paged_dropout(dropout_p)
    options = AttentionOptions(softmax_scale, causal, check_window(window_size), check_softcap(softcap))
    max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
    adapter = adapter_for(q)
    out, lse = adapter.paged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                                       alibi_slopes, options, out, return_attn_probs)
    if not return_attn_probs:
        return out
    k_packed = gather_pages(k, block_table, cu_seqlens_k)
    return out, lse, adapter.varlen_probs(q, k_packed, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          alibi_slopes, options)


def check_paged_dropout(dropout_p) -> None:
    """Paged K/V is FA2's forward-only inference path: no dropout."""
    if dropout_rng.check_dropout(dropout_p) != 0.0:
        raise ValueError(f"dropout_p: expected 0.0 with block_table (paged K/V is a forward-only inference path), "
                         f"got {dropout_p}")


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or shape[1] != parts:
        raise ValueError(f"{name}: expected shape (total, {parts}, nheads, headdim), got {shape}")


def gather_pages(cache, block_table, cu_seqlens_k):
    """The packed (cu_seqlens_k[-1], nheads_kv, headdim) keys or values of a paged cache (NumPy, or
    any GPU array through CuPy: its own framework back). Page ids must be in range (the NumPy path
    checks them first); for tests, debugging and the attention probabilities."""
    return adapter_for(cache, "k").gather_pages(cache, block_table, cu_seqlens_k)


def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                              causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, out=None, *,
                              dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None,
                              block_table=None):
    """Varlen forward returning (out, softmax_lse (nheads, total_q)). Dropout as flash_attn_forward
    (sequence b of the batch draws its mask as batch entry b). block_table: k and v are paged
    caches (module doc; no dropout)."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    if block_table is not None:
        check_paged_dropout(dropout_p)
        max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
        return adapter_for(q).paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q,
                                            max_seqlen_k, alibi_slopes,
                                            AttentionOptions(softmax_scale, causal, window, softcap), out)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    options = AttentionOptions(softmax_scale, causal, window, softcap, False, dropout)
    return adapter_for(q).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         alibi_slopes, options, out)


def varlen_attention_probs(q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Attention probabilities of a varlen call as fp32 (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero-padded (testing only); entries dropped by dropout are negated."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    options = AttentionOptions(softmax_scale, causal, window, softcap, False, dropout)
    return adapter_for(q).varlen_probs(q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       alibi_slopes, options)


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, *, dropout_p=0.0,
                               dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Gradients of flash_attn_varlen_func: (dq, dk, dv) shaped like the packed q, k, v."""
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
    options = AttentionOptions(softmax_scale, causal, window, softcap, deterministic, dropout)
    return adapter_for(q).varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, alibi_slopes, options, dq, dk, dv)


__all__ = [
    "flash_attn_varlen_backward",
    "flash_attn_varlen_forward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "gather_pages",
    "validate_paged_varlen",
    "varlen_attention_probs",
]
