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

import dataclasses

import numpy as np

from . import interop, launch, reference
from . import dropout as dropout_rng
from .backward import gradient_outputs
from .api import (_check_grid, _fill, _probs, call_dropout, check_host_dropout, dropout_source, gpu_features,
                  host_dropout, numpy_alibi, resolve_dropout)
from .features import (
    as_batched,
    check_cu_seqlens,
    check_max_seqlen,
    check_packed_dims,
    check_softcap,
    check_window,
    varlen_shape,
)
from .validate import AttentionShape, TensorInfo, check_alignment, check_bool, expect, validate_qkv


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
    framework = interop.framework_of(q)
    dropout = call_dropout(framework, dropout_p, dropout_seed)
    window, softcap = check_window(window_size), check_softcap(softcap)
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    if framework == "torch":
        from . import torch_ops

        out, lse, dropout = torch_ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window, softcap, alibi_slopes, deterministic, out,
                                            dropout, seed_given=dropout_seed is not None)
    elif framework == "jax":  # differentiable, jit-able; cu_seqlens values are checked only outside jit
        from . import jax_ops

        jax_ops.check_call(out, return_attn_probs, dropout_p, dropout_seed, q, k, v, cu_seqlens_q, cu_seqlens_k,
                           alibi_slopes)
        out, lse = jax_ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                                          dropout)
    else:
        out, lse = flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window, softcap, alibi_slopes, out=out,
                                             dropout_p=dropout.p, **dropout_source(dropout))
    if not return_attn_probs:
        return out
    return out, lse, varlen_attention_probs(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window, softcap, alibi_slopes,
                                            dropout_p=dropout.p, **dropout_source(dropout))


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
    window, softcap = check_window(window_size), check_softcap(softcap)
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    framework = interop.framework_of(q)
    if framework == "jax":  # jit-able; differentiating raises (no backward)
        from . import jax_ops

        jax_ops.check_call(out, return_attn_probs, 0.0, None, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                           alibi_slopes)
        out, lse = jax_ops.varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                softmax_scale, causal, window, softcap, alibi_slopes, block_table)
    elif framework == "torch":
        from . import torch_ops

        out, lse = torch_ops.varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  softmax_scale, causal, window, softcap, alibi_slopes, block_table,
                                                  out)
    else:
        out, lse = flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window, softcap, alibi_slopes, out=out,
                                             block_table=block_table)
    if not return_attn_probs:
        return out
    k_packed = gather_pages(k, block_table, cu_seqlens_k)
    return out, lse, varlen_attention_probs(q, k_packed, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window, softcap, alibi_slopes)


def check_paged_dropout(dropout_p) -> None:
    """Paged K/V is FA2's forward-only inference path: no dropout."""
    if dropout_rng.check_dropout(dropout_p) != 0.0:
        raise ValueError(f"dropout_p: expected 0.0 with block_table (paged K/V is a forward-only inference path), "
                         f"got {dropout_p}")


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or shape[1] != parts:
        raise ValueError(f"{name}: expected shape (total, {parts}, nheads, headdim), got {shape}")


# ---- validation ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _VarlenCall:
    shape: AttentionShape  # batch = number of sequences, seqlens = the maxima
    q: TensorInfo  # packed (total, nheads, dim) descriptions
    k: TensorInfo
    v: TensorInfo
    covers_all_rows: bool  # cu_seqlens_q[-1] == total_q and cu_seqlens_k[-1] == total_k


def _as_one_batch(info: TensorInfo) -> TensorInfo:
    return dataclasses.replace(info, shape=(1, *info.shape), strides=(0, *info.strides))


def _validate(q, k, v, softmax_scale, cu_q: TensorInfo, cu_q_values, cu_k: TensorInfo, cu_k_values, max_seqlen_q,
              max_seqlen_k, check_pointers: bool) -> _VarlenCall:
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_packed_dims(name, info)
    one = validate_qkv(_as_one_batch(q), _as_one_batch(k), _as_one_batch(v), softmax_scale,
                       check_pointers=check_pointers)
    total_q, total_k = q.shape[0], k.shape[0]
    batch = check_cu_seqlens("cu_seqlens_q", cu_q, cu_q_values, total_q, max_seqlen_q, None, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_k, cu_k_values, total_k, max_seqlen_k, batch, q.device)
    shape = varlen_shape(q, k, batch, max_seqlen_q, max_seqlen_k, one.softmax_scale)
    _check_grid(shape)
    covers = int(cu_q_values[-1]) == total_q and int(cu_k_values[-1]) == total_k
    return _VarlenCall(shape, q, k, v, covers)


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
    one = validate_qkv(_as_one_batch(q), one_page["k"], one_page["v"], softmax_scale, check_pointers=check_pointers)
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
    _check_grid(shape)
    return PagedVarlenCall(shape, q, k, v, block_table, page_size, int(cu_q_values[-1]) == total_q)


def gather_pages(cache, block_table, cu_seqlens_k):
    """The packed (cu_seqlens_k[-1], nheads_kv, headdim) keys or values of a paged cache (NumPy, or
    any GPU array through CuPy: its own framework back). Page ids must be in range (the NumPy path
    checks them first); for tests, debugging and the attention probabilities."""
    if interop.framework_of(cache, "k") == "numpy":
        return _gather(np, cache, np.asarray(block_table), np.asarray(cu_seqlens_k))
    with interop.gpu_call(cache) as call:
        arrays = [call.to_cupy(n, x) for n, x in (("k", cache), ("block_table", block_table))]
        cu = call.to_cupy("cu_seqlens_k", cu_seqlens_k).get()
        return call.result(_gather(interop.import_cupy(), *arrays, cu))


def _gather(xp, cache, table, cu_k):
    page_size = cache.shape[1]
    pages, rows = [], []
    for b in range(len(cu_k) - 1):
        j = np.arange(int(cu_k[b + 1]) - int(cu_k[b]))
        pages.append(j // page_size + b * table.shape[1])
        rows.append(j % page_size)
    flat = xp.asarray(np.concatenate(pages + [np.zeros(0, np.int64)]))
    page_ids = table.reshape(-1)[flat] if flat.size else xp.zeros(0, dtype=xp.int32)
    return cache[page_ids, xp.asarray(np.concatenate(rows + [np.zeros(0, np.int64)]))]


def _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window,
                softcap, alibi_slopes, dropout):
    infos = [call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    cu = _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k)
    problem = _validate(*infos, softmax_scale, *cu[0], *cu[1], max_seqlen_q, max_seqlen_k, check_pointers=True)
    base = gpu_features(call, problem.shape, infos[0].device, window, softcap, alibi_slopes, dropout)
    features = dataclasses.replace(base, cu_seqlens_q=cu[0][0], cu_seqlens_k=cu[1][0], total_q=q.shape[0],
                                   total_k=k.shape[0])
    return problem, features


# ---- forward ------------------------------------------------------------------------------------

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
        return _paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window, softcap, alibi_slopes, out, block_table)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    if interop.framework_of(q) == "numpy":
        return _forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              window, softcap, alibi_slopes, out, dropout)
    with interop.gpu_call(q) as call:
        problem, features = _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window, softcap, alibi_slopes, dropout)
        shape = problem.shape
        out, out_info, lse, lse_info = _outputs(call, out, q, problem)
        if shape.seqlen_q > 0:
            launch.forward(*(as_batched(i, shape.batch, m) for i, m in ((problem.q, shape.seqlen_q),
                                                                         (problem.k, shape.seqlen_k),
                                                                         (problem.v, shape.seqlen_k))),
                           as_batched(out_info, shape.batch, shape.seqlen_q), lse_info, shape, causal,
                           call.device_id, call.stream, features=features)
        return call.result(out), call.result(lse)


def _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k) -> list:
    """[(info, host values)] of the two cu_seqlens arrays (GPU arrays; a small copy for the checks)."""
    cu = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if interop.framework_of(x, name) == "numpy":
            raise TypeError(f"{name}: expected a GPU array like q, got a NumPy array")
        cu.append((call.tensor(name, x), call.to_cupy(name, x).get()))
    return cu


def _outputs(call, out, q, problem):
    """(out, its info, lse, its info) of a varlen forward: the caller's out (checked) or a new one,
    and rows outside every sequence set to output 0 and LSE +inf."""
    shape = problem.shape
    if out is None:
        out, out_info = call.empty(problem.q.shape, shape.dtype, like=q)
    else:
        out_info = call.output("out", out)
        _check_like("out", out_info, problem.q)
        check_alignment("out", out_info)
    lse, lse_info = call.empty((shape.nheads, problem.q.shape[0]), "float32")
    if not problem.covers_all_rows:
        _fill(call, out_info, 0)
        _fill(call, lse_info, np.inf)
    return out, out_info, lse, lse_info


def _paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, out, block_table):
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    if interop.framework_of(q) == "numpy":
        return _paged_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, window, softcap, alibi_slopes, out, block_table)
    with interop.gpu_call(q) as call:
        infos = [call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
        if interop.framework_of(block_table, "block_table") == "numpy":
            raise TypeError("block_table: expected a GPU array like q, got a NumPy array")
        table = call.tensor("block_table", block_table)
        cu = _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k)
        problem = validate_paged_varlen(*infos, table, softmax_scale, *cu[0], *cu[1], max_seqlen_q, max_seqlen_k)
        shape = problem.shape
        features = dataclasses.replace(gpu_features(call, shape, infos[0].device, window, softcap, alibi_slopes),
                                       cu_seqlens_q=cu[0][0], cu_seqlens_k=cu[1][0], total_q=q.shape[0])
        out, out_info, lse, lse_info = _outputs(call, out, q, problem)
        from .kvcache import paged_varlen_forward

        paged_varlen_forward(call, problem.q, problem.k, problem.v, out_info, lse_info, problem.block_table, shape,
                             problem.page_size, bool(causal), features)
        return call.result(out), call.result(lse)


def _paged_forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window, softcap, alibi_slopes, out, block_table):
    """CPU path: the pages gathered into packed K/V, then the varlen NumPy path."""
    arrays = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "block_table": block_table}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    describe = interop.describe
    problem = validate_paged_varlen(describe("q", q), describe("k", k), describe("v", v),
                                    describe("block_table", block_table), softmax_scale,
                                    describe("cu_seqlens_q", cu_seqlens_q), cu_seqlens_q,
                                    describe("cu_seqlens_k", cu_seqlens_k), cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    check_pointers=False)
    num_blocks, page_size = k.shape[:2]
    for b, length in enumerate(np.diff(np.asarray(cu_seqlens_k, np.int64))):
        used = block_table[b, :-(-int(length) // page_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bad.any():
            raise ValueError(f"block_table: expected page ids in [0, {num_blocks}) for the pages sequence {b} uses, "
                             f"got {int(used[bad][0])}")
    k_packed, v_packed = (_gather(np, x, block_table, cu_seqlens_k) for x in (k, v))
    del problem
    return _forward_numpy(q, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window, softcap, alibi_slopes, out)


def _check_like(name: str, info: TensorInfo, like: TensorInfo) -> None:
    if info.shape != like.shape:
        raise ValueError(f"{name}: expected shape {like.shape}, got {info.shape}")
    if info.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype}, got {info.dtype}")
    if info.strides[-1] != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got stride {info.strides[-1]}")


def _sequences(cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, alibi_slopes,
                   extra=()):
    arrays = {"k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, **dict(extra)}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy array like q, got {type(x).__name__}")
    describe = interop.describe
    problem = _validate(describe("q", q), describe("k", k), describe("v", v), softmax_scale,
                        describe("cu_seqlens_q", cu_seqlens_q), cu_seqlens_q, describe("cu_seqlens_k", cu_seqlens_k),
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_pointers=False)
    slopes = numpy_alibi(alibi_slopes, problem.shape)
    if slopes is not None:
        slopes = np.broadcast_to(slopes.reshape(-1, problem.shape.nheads), (problem.shape.batch, problem.shape.nheads))
    return problem, slopes


def _sequence_mask(dropout, b: int, nheads: int, seqlen_q: int, seqlen_k: int):
    """(keep mask (1, nheads, seqlen_q, seqlen_k), rescale) of varlen sequence b, or (None, 1.0)."""
    if dropout.p == 0:
        return None, 1.0
    keep = dropout_rng.keep_mask(np, dropout.seed, dropout.offset, 1, nheads, seqlen_q, seqlen_k, dropout.p,
                                 batch_index=[b])
    return keep, dropout_rng.rescale(dropout.p)


def _forward_numpy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, out, dropout=dropout_rng.NO_DROPOUT):
    """CPU path: the tiled NumPy reference, one sequence at a time."""
    check_host_dropout(dropout)
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes)
    result = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((problem.shape.nheads, q.shape[0]), np.inf, dtype=np.float32)
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        seq_slopes = None if slopes is None else slopes[b:b + 1]
        if dropout.p > 0:  # the dense reference with the kernels' mask
            keep, rescale = _sequence_mask(dropout, b, problem.shape.nheads, rows_q.stop - rows_q.start,
                                           rows_k.stop - rows_k.start)
            o, l_b = reference.attention_naive(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                               softmax_scale=problem.shape.softmax_scale, causal=causal,
                                               window_size=window, softcap=softcap, alibi_slopes=seq_slopes,
                                               dropout_mask=keep, dropout_rescale=rescale)
        else:
            o, l_b = reference.attention_tiled(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                               softmax_scale=problem.shape.softmax_scale, causal=causal,
                                               window_size=window, softcap=softcap, alibi_slopes=seq_slopes,
                                               p_dtype=q.dtype)
        result[rows_q] = o[0].astype(q.dtype)
        lse[:, rows_q] = l_b[0]
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected a NumPy array like q, got {type(out).__name__}")
        _check_like("out", interop.describe("out", out), interop.describe("q", q))
        out[...] = result
        result = out
    return result, lse


def varlen_attention_probs(q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Attention probabilities of a varlen call as fp32 (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero-padded (testing only); entries dropped by dropout are negated."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    if interop.framework_of(q) == "numpy":
        return _varlen_probs(np, q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window, softcap, alibi_slopes, dropout)
    with interop.gpu_call(q) as call:
        arrays = [call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse))]
        cu_q, cu_k = (call.to_cupy(n, x).get() for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                                             ("cu_seqlens_k", cu_seqlens_k)))
        slopes = None if alibi_slopes is None else call.to_cupy("alibi_slopes", alibi_slopes)
        return call.result(_varlen_probs(interop.import_cupy(), *arrays, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, window, softcap, slopes, host_dropout(call, dropout)))


def _varlen_probs(xp, q, k, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window, softcap,
                  slopes, dropout=dropout_rng.NO_DROPOUT):
    batch, nheads = len(cu_q) - 1, q.shape[1]
    probs = xp.zeros((batch, nheads, max_seqlen_q, max_seqlen_k), dtype=xp.float32)
    if softmax_scale is None:
        softmax_scale = 1.0 / float(np.sqrt(q.shape[-1]))
    for b, rows_q, rows_k in _sequences(cu_q, cu_k):
        sq, sk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        if sq == 0 or sk == 0:
            continue
        slopes_b = None
        if slopes is not None:
            slopes_b = xp.broadcast_to(xp.asarray(slopes).reshape(-1, nheads), (batch, nheads))[b:b + 1]
        seq_probs = _probs(xp, q[None, rows_q], k[None, rows_k], lse[None, :, rows_q], softmax_scale, causal, window,
                           softcap, slopes_b)
        if dropout.p > 0:
            keep = dropout_rng.keep_mask(xp, dropout.seed, dropout.offset, 1, nheads, sq, sk, dropout.p,
                                         batch_index=[b])
            seq_probs = xp.where(keep, seq_probs, -seq_probs)
        probs[b, :, :sq, :sk] = seq_probs[0]
    return probs


# ---- backward -----------------------------------------------------------------------------------

def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, *, dropout_p=0.0,
                               dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Gradients of flash_attn_varlen_func: (dq, dk, dv) shaped like the packed q, k, v."""
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    max_seqlen_q, max_seqlen_k = check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k",
                                                                                                  max_seqlen_k)
    if interop.framework_of(q) == "numpy":
        return _backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv, dropout)
    with interop.gpu_call(q) as call:
        problem, features = _gpu_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, window, softcap, alibi_slopes, dropout)
        shape = problem.shape
        do_i, out_i, lse_i = (call.tensor(n, x) for n, x in (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
        for name, info in (("dout", do_i), ("out", out_i)):
            _check_like(name, info, problem.q)
            check_alignment(name, info)
        _check_lse(lse_i, shape.nheads, problem.q.shape[0])
        arrays, infos = gradient_outputs(call, (("dq", dq, q, problem.q), ("dk", dk, k, problem.k),
                                                ("dv", dv, v, problem.v)), _check_like)
        if not problem.covers_all_rows or shape.seqlen_q == 0 or shape.seqlen_k == 0:
            for info in infos:
                _fill(call, info, 0)
        if shape.seqlen_q > 0 and shape.seqlen_k > 0:
            b = shape.batch
            batched = [as_batched(i, b, m) for i, m in ((do_i, shape.seqlen_q), (problem.q, shape.seqlen_q),
                                                        (problem.k, shape.seqlen_k), (problem.v, shape.seqlen_k),
                                                        (out_i, shape.seqlen_q))]
            grads = [as_batched(i, b, m) for i, m in zip(infos, (shape.seqlen_q, shape.seqlen_k, shape.seqlen_k))]
            launch.backward(*batched, lse_i, *grads, shape, causal, deterministic, call.device_id, call.stream,
                            features=features)
        return tuple(call.result(a) for a in arrays)


def _check_lse(info: TensorInfo, nheads: int, total_q: int) -> None:
    expected = (nheads, total_q)
    if tuple(info.shape) != expected:
        raise ValueError(f"softmax_lse: expected shape {expected} (nheads, total_q), got {tuple(info.shape)}")
    if info.dtype != "float32":
        raise TypeError(f"softmax_lse: expected dtype float32, got {info.dtype}")
    if info.strides != (total_q, 1):
        raise ValueError(f"softmax_lse: expected a contiguous array, got strides {info.strides}")


def _backward_numpy(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window, softcap, alibi_slopes, dq, dk, dv, dropout=dropout_rng.NO_DROPOUT):
    check_host_dropout(dropout)
    problem, slopes = _numpy_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     alibi_slopes, (("dout", dout), ("out", out), ("softmax_lse", softmax_lse)))
    for name, x in (("dout", dout), ("out", out)):
        _check_like(name, interop.describe(name, x), problem.q)
    _check_lse(interop.describe("softmax_lse", softmax_lse), problem.shape.nheads, q.shape[0])
    grads = [np.zeros(x.shape, dtype=np.float32) for x in (q, k, v)]
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        args = (dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k], out[None, rows_q],
                softmax_lse[None, :, rows_q])
        options = dict(softmax_scale=problem.shape.softmax_scale, causal=causal, window_size=window, softcap=softcap,
                       alibi_slopes=None if slopes is None else slopes[b:b + 1])
        if dropout.p > 0:
            keep, rescale = _sequence_mask(dropout, b, problem.shape.nheads, rows_q.stop - rows_q.start,
                                           rows_k.stop - rows_k.start)
            g = reference.attention_backward_naive(*args, **options, dropout_mask=keep, dropout_rescale=rescale)
        else:
            g = reference.attention_backward_tiled(*args, **options)
        grads[0][rows_q], grads[1][rows_k], grads[2][rows_k] = g[0][0], g[1][0], g[2][0]
    result = []
    for name, given, g, like in (("dq", dq, grads[0], q), ("dk", dk, grads[1], k), ("dv", dv, grads[2], v)):
        g = g.astype(like.dtype)
        if given is None:
            result.append(g)
        else:
            _check_like(name, interop.describe(name, given), interop.describe(name, like))
            given[...] = g
            result.append(given)
    return tuple(result)


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
