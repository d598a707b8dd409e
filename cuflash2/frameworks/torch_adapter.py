"""The PyTorch adapter: torch tensors described without copies, outputs from torch's caching
allocator, work on torch's current stream; cuflash2's kernels as torch.library custom ops with
autograd.

Imported only when a torch tensor is passed in. Outputs are allocated by torch (its caching
allocator), kernels run on torch's current stream, and the ops have fake (meta) implementations, so
torch.compile(fullgraph=True) can trace through them.

Eager calls (not under torch.compile) take a torch.autograd.Function around the same
implementations instead: the custom-op dispatch with registered autograd costs about 170-180 us of
Python per differentiable call, the Function 25-34 us (benchmarks/bench_torch_dispatch.py, CPU), which
at short sequences is more than the kernels take; eager calls autograd need not record (no input
requires grad, or grad mode is off) call the implementations directly. All paths run the same code
on the same stream.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import numpy as np
import torch
from torch import Tensor

from ..core import replay
from ..dropout import NO_DROPOUT, DropoutSpec
from ..problem.options import AttentionOptions
from ..problem.tensors import TensorInfo, softmax_scale_or_default
from ..runtime.device import import_cupy
from .gpu import GpuAdapter, GpuCall, external_stream


class TorchCall(GpuCall):
    """A GPU call on torch tensors: described through torch's own attributes, outputs from torch."""

    def tensor(self, name: str, x) -> TensorInfo:
        if x.device.type != "cuda":
            raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device}")
        if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
            x = x.contiguous()
            self.keep.append(x)
        return TensorInfo(tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."),
                          f"cuda:{x.device.index}", x.data_ptr(), x.element_size())

    def output(self, name: str, x) -> TensorInfo:
        if x.device.type != "cuda":
            raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device}")
        return self.checked_output(name, TensorInfo(tuple(x.shape), tuple(x.stride()),
                                                    str(x.dtype).removeprefix("torch."), f"cuda:{x.device.index}",
                                                    x.data_ptr(), x.element_size()))

    @staticmethod
    def exportable(x):
        return x.detach() if x.requires_grad else x

    def empty(self, shape, dtype_name: str, like=None):
        array = torch.empty(shape, dtype=getattr(torch, dtype_name), device=f"cuda:{self.device_id}")
        return array, self.tensor("out", array)

    def result(self, x):
        return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


class TorchOps:
    """A replay's operations on torch tensors (torch's allocator, torch's stream)."""

    pointer = operator.methodcaller("data_ptr")

    def __init__(self):
        self.array_type = torch.Tensor
        self.current_device = import_cupy().cuda.runtime.getDevice  # the CUDA runtime's, shared with torch
        self.float32 = torch.float32
        # The current stream as a raw handle without building a Stream object (what compiled torch
        # code uses); the public call is the fallback.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw if raw is not None else lambda index: torch.cuda.current_stream(index).cuda_stream

    @staticmethod
    def signature(x):
        return x.shape, x.stride(), x.dtype, x.device

    @staticmethod
    def strides_in_elements(x) -> tuple:
        return tuple(x.stride())

    def stream_getter(self, device_id: int):
        return functools.partial(self._raw_stream, device_id)

    @staticmethod
    def allocator(shape, dtype, device_id: int):
        return functools.partial(torch.empty, shape, dtype=dtype, device=torch.device("cuda", device_id))

    @staticmethod
    def scratch_allocator(nbytes: int, device_id: int):
        return functools.partial(torch.empty, nbytes, dtype=torch.uint8, device=torch.device("cuda", device_id))


_torch_allocators: dict[int, object] = {}


def _torch_allocator(cp, device_id: int):
    """A CuPy allocator whose memory is a torch tensor: everything a torch call allocates (scratch,
    temporaries) is then counted by torch.cuda.memory_allocated, reused through torch's cache on
    torch's current stream (the one the call runs on), and legal under torch.cuda.graph capture."""
    allocate = _torch_allocators.get(device_id)
    if allocate is None:
        device = torch.device("cuda", device_id)

        def allocate(nbytes: int):
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            memory = cp.cuda.UnownedMemory(block.data_ptr(), nbytes, owner=block, device_id=device_id)
            return cp.cuda.MemoryPointer(memory, 0)

        _torch_allocators[device_id] = allocate
    return allocate


class TorchAdapter(GpuAdapter):
    """Torch tensors: the generic GPU entry points on torch's stream and allocator, and the
    differentiable ones through custom ops (torch.compile) or their eager autograd twins."""

    call_type = TorchCall

    def __init__(self):
        self.name = "torch"
        self.replay_ops = TorchOps()

    @contextlib.contextmanager
    def call(self, first_input):
        if first_input.device.type != "cuda":
            raise TypeError(f"q: expected a CUDA tensor (or a NumPy array for the CPU path), "
                            f"got a torch tensor on {first_input.device}")
        device_id = first_input.device.index
        cp = import_cupy()
        with cp.cuda.Device(device_id):  # scratch and CuPy temporaries come from torch's caching allocator too
            stream = external_stream(cp, torch.cuda.current_stream(device_id).cuda_stream, device_id)
            with stream, cp.cuda.using_allocator(_torch_allocator(cp, device_id)):
                yield TorchCall(self.name, device_id, stream)

    def attention(self, q, k, v, alibi_slopes, options: AttentionOptions, out, seed_given: bool,
                  return_attn_probs: bool):
        return forward(q, k, v, options, alibi_slopes, out, seed_given)

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                         options: AttentionOptions, out, seed_given: bool, return_attn_probs: bool):
        return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi_slopes,
                              out, seed_given)

    def paged_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                        alibi_slopes, options: AttentionOptions, out, return_attn_probs: bool):
        return varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                                    alibi_slopes, block_table, out)

    def kvcache_step(self, key, arrays: tuple):
        if _use_custom_op(arrays[0]):  # traced: the custom op below, never a replay of real buffers
            return None
        return super().kvcache_step(key, arrays)

    def kvcache(self, arrays: tuple, softmax_scale, causal: bool, window, softcap: float, interleaved: bool,
                num_splits: int, return_softmax_lse: bool, key, host_lengths, checked: bool):
        if _use_custom_op(arrays[0]):  # torch.compile: the custom op that mutates the caches
            return kvcache_traced(arrays, softmax_scale, causal, window, softcap, interleaved, num_splits,
                                  return_softmax_lse, checked)
        return super().kvcache(arrays, softmax_scale, causal, window, softcap, interleaved, num_splits,
                               return_softmax_lse, key, host_lengths, checked)


ADAPTER = TorchAdapter()


def _options(softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p, dropout_seed,
             dropout_rng_state) -> AttentionOptions:
    """The options of a custom op's flat arguments (checked by the public function that made them)."""
    dropout = DropoutSpec(dropout_p, dropout_seed, 0, dropout_rng_state) if dropout_p else NO_DROPOUT
    return AttentionOptions(softmax_scale, causal, (window_left, window_right), softcap, deterministic, dropout)


_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (then the custom ops, which it can see through)."""
    return bool(_is_compiling and _is_compiling())


def _needs_graph(q, k, v) -> bool:
    """Whether autograd must record the call: grad mode on and one of q, k, v requires grad. Other
    eager calls (inference, torch.no_grad) skip the autograd.Function and its host cost."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


try:
    from torch._subclasses.fake_tensor import FakeTensor
except ImportError:  # a private module: without it, no fake tensors to recognise
    FakeTensor = ()


def _use_custom_op(q: Tensor) -> bool:
    """The custom ops under torch.compile, and for meta or fake tensors traced without it (make_fx,
    FakeTensorMode), which only their fake implementations can take; the eager Functions otherwise."""
    return _compiling() or q.is_meta or isinstance(q, FakeTensor)


def _forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
             dropout_seed, deterministic, dropout_rng_state):
    """(out, lse, the call's replay key): out and lse are new contiguous tensors whatever the path,
    so the key (q, k, v and the options) fixes their layout too."""
    options = _options(softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p,
                       dropout_seed, dropout_rng_state)
    key = ADAPTER.forward_key(q, k, v, options, alibi_slopes)
    result = replay.replay(key, (q, k, v))
    if result is not None:  # a call signature seen before: what forward_into below would launch
        return result + (key,)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    ADAPTER.forward_into(q, k, v, out, lse, alibi_slopes, options)
    return out, lse, key


def _fwd_impl(*args):
    return _forward(*args)[:2]


@torch.library.custom_op("cuflash2::flash_attn_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
                    window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                    dropout_seed: int, deterministic: bool, dropout_rng_state: Tensor | None) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                     dropout_seed, deterministic, dropout_rng_state)


@_flash_attn_fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
      deterministic, dropout_rng_state):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
              dropout_p, dropout_seed, deterministic, dropout_rng_state, forward_key=None):
    """(dq, dk, dv). `forward_key`: the replay key of the forward that made out and lse from these q,
    k, v (the eager path keeps it): the backward's key is then that key and dout's signature, which
    costs less than describing all six inputs again."""
    dout = _kernel_ready(dout)  # here, not in the autograd formula: torch.compile traces that with fake tensors
    options = _options(softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p,
                       dropout_seed, dropout_rng_state)
    if forward_key is not None:
        key = ("bwd after fwd", forward_key, TorchOps.signature(dout), bool(deterministic))
    else:
        key = ADAPTER.backward_key(dout, q, k, v, out, lse, options, alibi_slopes)
    result = replay.replay(key, (dout, q, k, v, out, lse))
    if result is not None:  # a call signature seen before: what the backward below would launch
        return result
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    return ADAPTER.backward(dout, q, k, v, out, lse, alibi_slopes, options, dq, dk, dv, replay_key=key)


@torch.library.custom_op("cuflash2::flash_attn_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                    causal: bool, window_left: int, window_right: int, softcap: float,
                    alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                    deterministic: bool, dropout_rng_state: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                     dropout_p, dropout_seed, deterministic, dropout_rng_state)


@_flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
      dropout_seed, deterministic, dropout_rng_state):
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
    """The eager-mode twin of the custom op above: same implementation, same saved tensors. The
    options come as one tuple (Function.apply walks every argument, at a cost per argument)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse, key = _forward(q, k, v, *options)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.forward_key = options, key
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward (it would silently drop terms)
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(dout, q, k, v, out, lse, *ctx.options, forward_key=ctx.forward_key)
        return dq, dk, dv, None


def forward(q, k, v, options: AttentionOptions, alibi_slopes, out=None, seed_given: bool = True):
    """(out, softmax_lse, dropout) through the custom op (torch.compile) or its eager twin;
    differentiable with respect to q, k, v (not the ALiBi slopes, as in FA2). Without seed_given, a
    dropout call draws its (seed, offset) from torch's generator; the returned spec carries them."""
    scale = softmax_scale_or_default(options.softmax_scale, q.shape[-1])
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a torch tensor like q, got {type(alibi_slopes).__name__}")
    dropout = options.dropout if options.dropout.p == 0 else _with_rng_state(options.dropout, seed_given, q.device)
    window = options.window
    flat = (scale, bool(options.causal), int(window[0]), int(window[1]), float(options.softcap), alibi_slopes,
            float(dropout.p), int(dropout.seed), bool(options.deterministic), dropout.rng_state)
    if _use_custom_op(q):
        result, lse = _flash_attn_fwd(q, k, v, *flat)
    elif _needs_graph(q, k, v):
        result, lse = _EagerAttention.apply(q, k, v, flat)
    else:
        result, lse, _ = _forward(q, k, v, *flat)
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse, dropout


def _with_rng_state(dropout: DropoutSpec, seed_given: bool, device) -> DropoutSpec:
    """The spec with a device (seed, offset) drawn from torch's CUDA generator when the call gave
    no seed: torch.manual_seed then reproduces the mask, activation checkpointing (which restores
    the generator before recomputing) regenerates it, and CUDA-graph replays draw new ones."""
    if dropout.p == 0 or seed_given:
        return dropout
    return dropout._replace(rng_state=torch.empty(2, dtype=torch.int64, device=device).random_())


# ---- varlen ---------------------------------------------------------------------------------------

def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic,
                     dropout_rng_state):
    options = _options(softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p,
                       dropout_seed, dropout_rng_state)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return ADAPTER.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                                  options, out)


@torch.library.custom_op("cuflash2::flash_attn_varlen_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                           window_right: int, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                           dropout_seed: int, deterministic: bool,
                           dropout_rng_state: Tensor | None) -> tuple[Tensor, Tensor]:
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic,
                            dropout_rng_state)


@_flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, deterministic,
                     dropout_rng_state):
    dout = _kernel_ready(dout)
    options = _options(softmax_scale, causal, window_left, window_right, softcap, deterministic, dropout_p,
                       dropout_seed, dropout_rng_state)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    return ADAPTER.varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   alibi_slopes, options, dq, dk, dv)


@torch.library.custom_op("cuflash2::flash_attn_varlen_bwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
                           alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: int,
                           deterministic: bool, dropout_rng_state: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                            dropout_seed, deterministic, dropout_rng_state)


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
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
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
        return dq, dk, dv, None, None, None


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: AttentionOptions,
                   alibi_slopes, out=None, seed_given: bool = True):
    """(out, softmax_lse, dropout) of a varlen call through the custom op or its eager twin;
    differentiable w.r.t. q, k, v. Dropout seeds as in forward."""
    scale = softmax_scale_or_default(options.softmax_scale, q.shape[-1])
    causal, window, softcap, deterministic = options.causal, options.window, options.softcap, options.deterministic
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like q, got {type(x).__name__}")
    dropout = _with_rng_state(options.dropout, seed_given, q.device)
    flat = (int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal), int(window[0]), int(window[1]), float(softcap),
            alibi_slopes, float(dropout.p), int(dropout.seed), bool(deterministic), dropout.rng_state)
    if _use_custom_op(q):
        result, lse = _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *flat)
    elif _needs_graph(q, k, v):
        result, lse = _EagerVarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, flat)
    else:
        result, lse = _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, *flat)
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse, dropout


# ---- KV cache (inference: no autograd) --------------------------------------------------------------

def _kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_value,
                  cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                  softcap, rotary_interleaved, alibi_slopes, num_splits, checked=False):
    lengths = cache_seqlens if cache_seqlens is not None else (None if cache_seqlens_value < 0 else
                                                                cache_seqlens_value)
    arrays = (q, k_cache, v_cache, k, v, lengths, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
              rotary_cos, rotary_sin)
    host_lengths = lengths if isinstance(lengths, int) else None
    return GpuAdapter.kvcache(ADAPTER, arrays, softmax_scale, causal, (window_left, window_right), softcap,
                              rotary_interleaved, num_splits, True, None, host_lengths,
                              host_lengths is not None or (lengths is not None and checked))


@torch.library.custom_op("cuflash2::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"),
                         device_types="cuda")
def _flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                             rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None,
                             cache_seqlens_value: int, cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None,
                             block_table: Tensor | None, softmax_scale: float | None, causal: bool, window_left: int,
                             window_right: int, softcap: float, rotary_interleaved: bool,
                             alibi_slopes: Tensor | None, num_splits: int, checked: bool) -> tuple[Tensor, Tensor]:
    return _kvcache_impl(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_value,
                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                         softcap, rotary_interleaved, alibi_slopes, num_splits, checked)


@_flash_attn_with_kvcache.register_fake
def _(q, k_cache, v_cache, *options):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def kvcache_traced(arrays: tuple, softmax_scale, causal, window, softcap, rotary_interleaved, num_splits,
                   return_softmax_lse, checked: bool):
    """flash_attn_with_kvcache as a custom op that mutates the caches, for torch.compile and fake
    tensors (eager calls keep the direct path and its decoding-step replay). `arrays` as
    cuflash2.core.kvcache.INPUT_BUFFERS."""
    (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos,
     rotary_sin) = arrays
    value = -1
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        value, cache_seqlens = int(cache_seqlens), None
    elif cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int or a torch tensor like q, got {type(cache_seqlens).__name__}")
    out, lse = _flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, value,
                                        cache_batch_idx, cache_leftpad, block_table,
                                        None if softmax_scale is None else float(softmax_scale), bool(causal),
                                        int(window[0]), int(window[1]), float(softcap), bool(rotary_interleaved),
                                        alibi_slopes, int(num_splits), bool(checked))
    return (out, lse) if return_softmax_lse else out


# ---- paged varlen (forward only) --------------------------------------------------------------------
# flash_attn_varlen_func with block_table: FA2 has no backward there, so neither the op nor the
# eager path is differentiable, and inputs that require grad are refused up front (varlen_paged_forward).

def _varlen_paged_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    options = AttentionOptions(softmax_scale, causal, (window_left, window_right), softcap)
    return ADAPTER.paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                                 alibi_slopes, options, out)


@torch.library.custom_op("cuflash2::flash_attn_varlen_paged_fwd", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_paged_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                 block_table: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                                 causal: bool, window_left: int, window_right: int, softcap: float,
                                 alibi_slopes: Tensor | None) -> tuple[Tensor, Tensor]:
    return _varlen_paged_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)


@_flash_attn_varlen_paged_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, *options):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def varlen_paged_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: AttentionOptions,
                         alibi_slopes, block_table, out=None):
    """(out, softmax_lse) of a varlen call against paged K/V (forward only: inputs that require
    grad raise while grad mode is on; run under torch.no_grad() / torch.inference_mode())."""
    scale = softmax_scale_or_default(options.softmax_scale, q.shape[-1])
    causal, window, softcap = options.causal, options.window, options.softcap
    for name, x in (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("block_table", block_table), ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor like q, got {type(x).__name__}")
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.requires_grad:
                raise RuntimeError(f"{name}: flash_attn_varlen_func with block_table has no backward (as in "
                                   f"flash-attn); expected tensors that do not require grad, or a call under "
                                   f"torch.no_grad() / torch.inference_mode()")
    op = _flash_attn_varlen_paged_fwd if _use_custom_op(q) else _varlen_paged_fwd_impl
    result, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, int(max_seqlen_q), int(max_seqlen_k), scale,
                     bool(causal), int(window[0]), int(window[1]), float(softcap), alibi_slopes)
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse
