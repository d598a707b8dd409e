"""Public functions with FlashAttention-2's names, arguments and return conventions: dense
attention (forward, backward, packed variants, probabilities).

Flow of one call: the arguments are checked here, once; the adapter of q's framework
(cuflash2.frameworks) describes the arrays and hands them to the core (cuflash2.core), which picks a
kernel family and queues the work on the caller's stream; the result comes back as the caller's own
array type. NumPy arrays run the CPU reference.
"""

from __future__ import annotations

from . import dropout as dropout_rng
from .dropout import check_dropout
from .frameworks import adapter_for
from .problem.features import check_softcap, check_window
from .problem.options import AttentionOptions, dropout_source, resolve_dropout
from .problem.tensors import check_bool


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None,
                    dropout_seed=None):
    """Exact attention softmax(scale * q k^T) v, FlashAttention-2 style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), fp16 or bf16,
    nheads % nheads_kv == 0 (GQA/MQA). Masks are aligned to the bottom-right corner: query i sees
    key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, with
    window_size = (left, right) (-1 = unbounded) and causal meaning right = 0.
    softcap > 0: logits become softcap * tanh(scale * q.k / softcap). alibi_slopes: fp32 (nheads,)
    or (batch, nheads); adds -slope * |i + seqlen_k - seqlen_q - j| to the logits.
    dropout_p > 0: attention dropout with a counter-based Philox mask drawn from dropout_seed (a new
    random seed when None); the backward regenerates the same mask (cuflash2.dropout).
    Returns out (same shape and type as q), or (out, softmax_lse, attn_probs) when return_attn_probs:
    softmax_lse is fp32 (batch, nheads, seqlen_q), natural log; attn_probs (batch, nheads, seqlen_q,
    seqlen_k) fp32 is materialised in full and meant for testing only (with dropout, dropped entries
    are negated, as FA2's S_dmask).
    """
    # The checks below are skipped for the defaults, which they would pass unchanged: a repeated
    # call's host time is mostly Python calls (docs/design-notes.md, "Host cost").
    if causal is not True and causal is not False:
        check_bool("causal", causal)
    if deterministic is not True and deterministic is not False:
        check_bool("deterministic", deterministic)
    adapter = adapter_for(q)
    if dropout_p == 0 and type(dropout_p) in _PLAIN_NUMBERS:
        dropout = dropout_rng.NO_DROPOUT
    else:
        dropout = call_dropout(adapter.name, dropout_p, dropout_seed)
    window = _UNBOUNDED if type(window_size) is tuple and window_size == _UNBOUNDED else check_window(window_size)
    softcap = 0.0 if softcap == 0 and type(softcap) in _PLAIN_NUMBERS else check_softcap(softcap)
    options = AttentionOptions(softmax_scale, causal, window, softcap, deterministic, dropout)
    out, lse, dropout = adapter.attention(q, k, v, alibi_slopes, options, out, dropout_seed is not None,
                                          return_attn_probs)
    if not return_attn_probs:
        return out
    return out, lse, adapter.probs(q, k, lse, alibi_slopes, options._replace(dropout=dropout))


_UNBOUNDED = (-1, -1)
_PLAIN_NUMBERS = (int, float)


def call_dropout(framework: str, dropout_p, dropout_seed) -> dropout_rng.DropoutSpec:
    """The dropout of an autograd entry point: torch calls without a seed leave it to the torch
    adapter, which draws it from torch's CUDA generator; the others resolve (or draw) it here."""
    if framework == "torch" and dropout_seed is None:
        return dropout_rng.DropoutSpec(check_dropout(dropout_p))
    return resolve_dropout(dropout_p, dropout_seed, 0, draw_seed=True)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             out=None, dropout_seed=None):
    """As flash_attn_func with kv of shape (batch, seqlen_k, 2, nheads_kv, headdim)."""
    _check_packed("kv", kv, 2)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, out=out, dropout_seed=dropout_seed)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              out=None, dropout_seed=None):
    """As flash_attn_func with qkv of shape (batch, seqlen, 3, nheads, headdim)."""
    _check_packed("qkv", qkv, 3)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, out=out,
                           dropout_seed=dropout_seed)


def _check_packed(name: str, x, parts: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 5 or shape[2] != parts:
        raise ValueError(f"{name}: expected shape (batch, seqlen, {parts}, nheads, headdim), got {shape}")


def flash_attn_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, out=None, *, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                       dropout_rng_state=None):
    """Forward pass returning (out, softmax_lse); the building block of the public functions.
    With dropout_p > 0, dropout_seed (and dropout_offset) must be given, or dropout_rng_state: a
    device int64 array (seed, offset) the kernels read when they run (CUDA-graph friendly). Pass
    the same to the backward."""
    options = _explicit_options(softmax_scale, causal, window_size, softcap, False, dropout_p, dropout_seed,
                                dropout_offset, dropout_rng_state)
    return adapter_for(q).forward(q, k, v, alibi_slopes, options, out)


def _explicit_options(softmax_scale, causal, window_size, softcap, deterministic, dropout_p, dropout_seed,
                      dropout_offset, dropout_rng_state) -> AttentionOptions:
    """The checked options of an explicit forward, backward or probabilities call (dropout needs a
    seed or a device rng_state there)."""
    check_bool("causal", causal)
    window, softcap = check_window(window_size), check_softcap(softcap)
    dropout = resolve_dropout(dropout_p, dropout_seed, dropout_offset, draw_seed=False, rng_state=dropout_rng_state)
    return AttentionOptions(softmax_scale, causal, window, softcap, deterministic, dropout)


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, *,
                        dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """Gradients of flash_attn_func: returns (dq, dk, dv) shaped like q, k, v.

    dout, out: (batch, seqlen_q, nheads, headdim) like q; softmax_lse: fp32 (batch, nheads, seqlen_q)
    as returned by flash_attn_forward. dq/dk/dv may be given to receive the results. Dropout takes
    the forward's dropout_p and dropout_seed/dropout_offset or dropout_rng_state (the mask is
    regenerated).
    """
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    options = _explicit_options(softmax_scale, causal, window_size, softcap, deterministic, dropout_p, dropout_seed,
                                dropout_offset, dropout_rng_state)
    return adapter_for(q).backward(dout, q, k, v, out, softmax_lse, alibi_slopes, options, dq, dk, dv)


def attention_probs(q, k, softmax_lse, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_rng_state=None):
    """softmax of the (masked, softcapped, ALiBi-biased) logits as fp32 (batch, nheads, seqlen_q,
    seqlen_k), rebuilt from the LSE. With dropout, the entries the kernels dropped are negated
    (FA2's S_dmask convention); the kept ones are not rescaled.

    Materialises the full matrix: for tests and debugging only.
    """
    options = _explicit_options(softmax_scale, causal, window_size, softcap, False, dropout_p, dropout_seed,
                                dropout_offset, dropout_rng_state)
    return adapter_for(q).probs(q, k, softmax_lse, alibi_slopes, options)


__all__ = ["attention_probs", "dropout_source", "flash_attn_backward", "flash_attn_forward", "flash_attn_func",
           "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"]
