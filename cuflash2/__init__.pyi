# Type hints of the public API (the names in cuflash2.__all__). The implementations live in api.py,
# varlen.py, kvcache.py and backward.py; tests/test_package.py checks that the parameter names,
# kinds and defaults here match theirs.
#
# Arrays are `Any`: CuPy arrays, torch tensors, JAX arrays, other CUDA DLPack producers and NumPy
# arrays all go in, and results come back in the caller's own type.

from typing import Any, Optional, Tuple

__version__: str
__all__: list[str]

Array = Any

def flash_attn_func(q: Array, k: Array, v: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, out: Optional[Array] = None,
                    dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_kvpacked_func(q: Array, kv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, out: Optional[Array] = None,
                             dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_qkvpacked_func(qkv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                              return_attn_probs: bool = False, *, out: Optional[Array] = None,
                              dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_forward(q: Array, k: Array, v: Array, softmax_scale: Optional[float] = None, causal: bool = False,
                       window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: Optional[Array] = None, out: Optional[Array] = None, *,
                       dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                       dropout_offset: int = 0, dropout_rng_state: Optional[Array] = None) -> Tuple[Array, Array]: ...
def flash_attn_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, softmax_lse: Array,
                        softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                        dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None, *,
                        dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                        dropout_offset: int = 0, dropout_rng_state: Optional[Array] = None) -> Tuple[Array, Array, Array]: ...
def attention_probs(q: Array, k: Array, softmax_lse: Array, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Array] = None, dropout_p: float = 0.0,
                    dropout_seed: Optional[int] = None, dropout_offset: int = 0,
                    dropout_rng_state: Optional[Array] = None) -> Array: ...
def flash_attn_varlen_func(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                           return_attn_probs: bool = False,
                           block_table: Optional[Array] = None, *, out: Optional[Array] = None,
                           dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_varlen_kvpacked_func(q: Array, kv: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, out: Optional[Array] = None,
                                    dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_varlen_qkvpacked_func(qkv: Array, cu_seqlens: Array, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, out: Optional[Array] = None,
                                     dropout_seed: Optional[int] = None) -> Any: ...
def flash_attn_varlen_forward(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Array] = None, out: Optional[Array] = None, *,
                              dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                              dropout_offset: int = 0,
                              dropout_rng_state: Optional[Array] = None, block_table: Optional[Array] = None) -> Tuple[Array, Array]: ...
def flash_attn_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, softmax_lse: Array,
                               cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int, max_seqlen_k: int,
                               softmax_scale: Optional[float] = None, causal: bool = False,
                               window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Optional[Array] = None, deterministic: bool = False,
                               dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None, *,
                               dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                               dropout_offset: int = 0,
                               dropout_rng_state: Optional[Array] = None) -> Tuple[Array, Array, Array]: ...
def varlen_attention_probs(q: Array, k: Array, softmax_lse: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Array] = None, dropout_p: float = 0.0,
                           dropout_seed: Optional[int] = None, dropout_offset: int = 0,
                           dropout_rng_state: Optional[Array] = None) -> Array: ...
def flash_attn_with_kvcache(q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
                            v: Optional[Array] = None, rotary_cos: Optional[Array] = None,
                            rotary_sin: Optional[Array] = None, cache_seqlens: Optional[Array | int] = None,
                            cache_batch_idx: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
                            block_table: Optional[Array] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Array] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> Any: ...
