"""PyTorch integration: cuflash2's kernels as torch.library custom ops with autograd.

Imported only when a torch tensor is passed in. Outputs are allocated by torch (its caching
allocator), kernels run on torch's current stream, and the ops have fake (meta) implementations, so
torch.compile(fullgraph=True) can trace through them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import api, backward
from .validate import softmax_scale_or_default


@torch.library.custom_op("cuflash2::flash_attn_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
                    deterministic: bool) -> tuple[Tensor, Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    api.forward_into(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal)
    return out, lse


@_flash_attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, deterministic):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("cuflash2::flash_attn_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                    causal: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    backward.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                 deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


@_flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic


def _backward(ctx, dout, dlse):  # the LSE output is not differentiated (as in FA2)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


_flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def forward(q, k, v, softmax_scale, causal, deterministic, out=None):
    """(out, softmax_lse) through the custom op; differentiable with respect to q, k, v."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    result, lse = _flash_attn_fwd(q, k, v, scale, bool(causal), bool(deterministic))
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse
