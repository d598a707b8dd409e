"""PyTorch integration: cuflash2's kernels as torch.library custom ops with autograd.

Imported only when a torch tensor is passed in. Outputs are allocated by torch (its caching
allocator), kernels run on torch's current stream, and the ops have fake (meta) implementations, so
torch.compile(fullgraph=True) can trace through them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import api, backward, varlen
from .validate import softmax_scale_or_default


@torch.library.custom_op("cuflash2::flash_attn_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                    dropout_seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    api.forward_into(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                     window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                     dropout_p=dropout_p, dropout_seed=dropout_seed)
    return out, lse


@_flash_attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
      deterministic):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("cuflash2::flash_attn_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                    causal: bool, window_left: int, window_right: int, softcap: float,
                    alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                    deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    backward.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                 window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, dq=dq, dk=dk, dv=dv, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed)
    return dq, dk, dv


@_flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
      dropout_seed, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options  # softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, dropout_seed, ...


def _backward(ctx, dout, dlse):  # the LSE output is not differentiated (as in FA2)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


_flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic, out=None,
            dropout=(0.0, 0, 0)):
    """(out, softmax_lse) through the custom op; differentiable with respect to q, k, v (not the
    ALiBi slopes, as in FA2)."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a torch tensor like q, got {type(alibi_slopes).__name__}")
    result, lse = _flash_attn_fwd(q, k, v, scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
                                  alibi_slopes, float(dropout[0]), int(dropout[1]), bool(deterministic))
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse


# ---- varlen ---------------------------------------------------------------------------------------

@torch.library.custom_op("cuflash2::flash_attn_varlen_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                           window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                           dropout_seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out, lse = varlen.flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                softmax_scale, causal, (window_left, window_right), softcap,
                                                alibi_slopes, out=out, dropout_p=dropout_p,
                                                dropout_seed=dropout_seed)
    return out, lse


@_flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("cuflash2::flash_attn_varlen_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                           alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                           deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    varlen.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                                      deterministic, dq=dq, dk=dk, dv=dv, dropout_p=dropout_p,
                                      dropout_seed=dropout_seed)
    return dq, dk, dv


@_flash_attn_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.options)


_flash_attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, deterministic, out=None, dropout=(0.0, 0, 0)):
    """(out, softmax_lse) of a varlen call through the custom op; differentiable w.r.t. q, k, v."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like q, got {type(x).__name__}")
    result, lse = _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                         scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
                                         alibi_slopes, float(dropout[0]), int(dropout[1]), bool(deterministic))
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse
