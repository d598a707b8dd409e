"""PyTorch integration: cuflash2's kernels as torch.library custom ops with autograd.

Imported only when a torch tensor is passed in. Outputs are allocated by torch (its caching
allocator), kernels run on torch's current stream, and the ops have fake (meta) implementations, so
torch.compile(fullgraph=True) can trace through them.

Eager calls (not under torch.compile) take a torch.autograd.Function around the same
implementations instead: the custom-op dispatch with registered autograd costs about 170-180 us of
Python per differentiable call, the Function 25-34 us (tests/bench_torch_dispatch.py, CPU), which
at short sequences is more than the kernels take. Both paths run the same code on the same stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import api, backward, call_plans, varlen
from .validate import softmax_scale_or_default


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (then the custom ops, which it can see through)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())


try:
    from torch._subclasses.fake_tensor import FakeTensor
except ImportError:  # a private module: without it, no fake tensors to recognise
    FakeTensor = ()


def _use_custom_op(q: Tensor) -> bool:
    """The custom ops under torch.compile, and for meta or fake tensors traced without it (make_fx,
    FakeTensorMode), which only their fake implementations can take; the eager Functions otherwise."""
    return _compiling() or q.is_meta or isinstance(q, FakeTensor)


def _fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
              dropout_seed, deterministic):
    window = (window_left, window_right)
    result = call_plans.replay(api.forward_plan_key(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                                                    dropout_p), (q, k, v))
    if result is not None:  # a call signature seen before: what forward_into below would launch
        return result
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    api.forward_into(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, window_size=window,
                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)
    return out, lse


@torch.library.custom_op("cuflash2::flash_attn_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                    dropout_seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                     dropout_seed, deterministic)


@_flash_attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
      deterministic):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              dropout_p, dropout_seed, deterministic):
    dout = _kernel_ready(dout)  # here, not in the autograd formula: torch.compile traces that with fake tensors
    window = (window_left, window_right)
    result = call_plans.replay(backward.backward_plan_key(dout, q, k, v, out, lse, softmax_scale, causal, window,
                                                          softcap, alibi_slopes, deterministic, dropout_p),
                               (dout, q, k, v, out, lse))
    if result is not None:  # a call signature seen before: what flash_attn_backward below would launch
        return result
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    backward.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, dq=dq, dk=dk, dv=dv, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed)
    return dq, dk, dv


@torch.library.custom_op("cuflash2::flash_attn_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                    causal: bool, window_left: int, window_right: int, softcap: float,
                    alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                    deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     dropout_p, dropout_seed, deterministic)


@_flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
      dropout_seed, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kernel_ready(grad: Tensor) -> Tensor:
    """The incoming gradient as the kernels read it: a unit last stride. Autograd hands over whatever
    layout the next op produced (an expanded one from out.sum(), with last stride 0), and the caller
    has no say in it: copy then. Any other alignment of base and rows is read as it is (the kernels
    take narrower accesses: config.vector_width)."""
    return grad if grad.stride(-1) == 1 else grad.clone(memory_format=torch.contiguous_format)


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


class _EagerAttention(torch.autograd.Function):
    """The eager-mode twin of the custom op above: same implementation, same saved tensors."""

    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = _fwd_impl(q, k, v, *options)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward (it would silently drop terms)
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * len(ctx.options)


def forward(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic, out=None,
            dropout=(0.0, 0, 0)):
    """(out, softmax_lse) through the custom op (torch.compile) or its eager twin; differentiable
    with respect to q, k, v (not the ALiBi slopes, as in FA2)."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a torch tensor like q, got {type(alibi_slopes).__name__}")
    op = _flash_attn_fwd if _use_custom_op(q) else _EagerAttention.apply
    result, lse = op(q, k, v, scale, bool(causal), int(window[0]), int(window[1]), float(softcap), alibi_slopes,
                     float(dropout[0]), int(dropout[1]), bool(deterministic))
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse


# ---- varlen ---------------------------------------------------------------------------------------

def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out, lse = varlen.flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                softmax_scale, causal, (window_left, window_right), softcap,
                                                alibi_slopes, out=out, dropout_p=dropout_p,
                                                dropout_seed=dropout_seed)
    return out, lse


@torch.library.custom_op("cuflash2::flash_attn_varlen_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                           window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                           dropout_seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic)


@_flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic):
    dout = _kernel_ready(dout)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    varlen.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
                                      deterministic, dq=dq, dk=dk, dv=dv, dropout_p=dropout_p,
                                      dropout_seed=dropout_seed)
    return dq, dk, dv


@torch.library.custom_op("cuflash2::flash_attn_varlen_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                           alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                           deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                            dropout_seed, deterministic)


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


class _EagerVarlenAttention(torch.autograd.Function):
    """The eager-mode twin of the varlen custom op."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
        out, lse = _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.options = options
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward (it would silently drop terms)
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
        return (dq, dk, dv, None, None) + (None,) * len(ctx.options)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
                   softcap, alibi_slopes, deterministic, out=None, dropout=(0.0, 0, 0)):
    """(out, softmax_lse) of a varlen call through the custom op or its eager twin; differentiable w.r.t. q, k, v."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like q, got {type(x).__name__}")
    op = _flash_attn_varlen_fwd if _use_custom_op(q) else _EagerVarlenAttention.apply
    result, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal),
                     int(window[0]), int(window[1]), float(softcap), alibi_slopes, float(dropout[0]), int(dropout[1]),
                     bool(deterministic))
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse
