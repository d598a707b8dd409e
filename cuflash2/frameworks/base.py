"""What every framework adapter provides: the entry points the public functions call. The
differentiable ones (attention, varlen_attention, paged_attention) default to the plain forward;
the torch and JAX adapters override them with their autograd machinery."""

from __future__ import annotations

from ..problem.options import AttentionOptions


class Adapter:
    name = ""

    def attention(self, q, k, v, alibi_slopes, options: AttentionOptions, out, seed_given: bool,
                  return_attn_probs: bool):
        """(out, softmax_lse, dropout) of flash_attn_func."""
        out, lse = self.forward(q, k, v, alibi_slopes, options, out)
        return out, lse, options.dropout

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                         options: AttentionOptions, out, seed_given: bool, return_attn_probs: bool):
        """(out, softmax_lse, dropout) of flash_attn_varlen_func."""
        out, lse = self.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                                       options, out)
        return out, lse, options.dropout

    def paged_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                        alibi_slopes, options: AttentionOptions, out, return_attn_probs: bool):
        """(out, softmax_lse) of flash_attn_varlen_func with block_table."""
        return self.paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                                  alibi_slopes, options, out)

    def kvcache_key(self, arrays: tuple, options: tuple):
        """The decoding-step replay key of a flash_attn_with_kvcache call (None: no replay)."""
        return None

    def kvcache_step(self, key, arrays: tuple):
        """The outputs of the decoding-step replay kept under `key`, or None (the full path then)."""
        return None

    def forward(self, q, k, v, alibi_slopes, options: AttentionOptions, out=None):
        raise NotImplementedError

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                       options: AttentionOptions, out=None):
        raise NotImplementedError

    def paged_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                      alibi_slopes, options: AttentionOptions, out=None):
        raise NotImplementedError


__all__ = ["Adapter"]
