"""The decoding step's fast path: a flash_attn_with_kvcache call whose signature was seen before.

A decoding loop makes the same call every token: the same shapes, strides, dtypes and options, with
new buffer addresses. The first such call goes through the full path (describe, validate, plan);
when that call used the caller's buffers as they are (no copy on the way), a `Step` is kept under a
key made of the raw attributes of the arguments. Later calls with that key skip the full path: they
read the buffer addresses, allocate the outputs and one scratch buffer, fill the addresses into the
plan's packed argument lists and launch. That is a few dozen Python operations instead of a few
hundred, which is what bounds one-token decoding at small batch (README, Performance).

Only CuPy arrays and torch tensors take it, every array argument of the same kind as q, on the
current device. Anything else (Python-int cache_seqlens, rotary tables that are not contiguous
float32, an input that needed a copy, a misaligned address) takes the full path, which also raises
the errors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import packed_launch
from .compiler import get_kernel
from .config import fp32_cols

# The array arguments of flash_attn_with_kvcache in the order of kvcache._BUFFERS' first entries;
# the per-call pointer list continues with the outputs and scratch regions (OUTPUT_BUFFERS).
INPUT_BUFFERS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                 "block_table", "alibi_slopes", "rotary_cos", "rotary_sin")
OUTPUT_BUFFERS = ("out", "lse", "q_rot", "o_partial", "lse_partial")
_SCRATCH_ALIGN = 256
_MAX_STEPS = 256


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(byte offset of each region, total bytes) for scratch regions of the given sizes laid out
    back to back, each starting at a multiple of 256 bytes (the kernels read partial outputs with
    16-byte loads; empty regions take no bytes). Pure."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += math.ceil(nbytes / _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return offsets, total


def scratch_layout(regions: dict[str, int]) -> tuple[dict[str, int], int]:
    """({name: byte offset}, total bytes) of aligned_offsets for named regions; empty regions are
    left out. Pure."""
    offsets, total = aligned_offsets(list(regions.values()))
    return {name: offset for (name, nbytes), offset in zip(regions.items(), offsets) if nbytes > 0}, total


class _Cupy:
    """Per-framework operations of a step, CuPy flavour."""

    def __init__(self):
        import cupy

        self.cp = cupy
        self.array_type = cupy.ndarray
        self.current_device = cupy.cuda.runtime.getDevice
        self.float32 = np.dtype(np.float32)

    @staticmethod
    def signature(x):
        return x.shape, x.strides, x.dtype, x.data.device_id

    @staticmethod
    def pointer(x) -> int:
        return x.data.ptr

    @staticmethod
    def strides_in_elements(x) -> tuple:
        return tuple(s // x.itemsize for s in x.strides)

    def stream(self, device_id: int) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def empty(self, shape, dtype, device_id: int):
        return self.cp.empty(shape, dtype=dtype)

    def scratch(self, nbytes: int, device_id: int):
        return self.cp.empty(nbytes, dtype=np.uint8)


class _Torch:
    """Per-framework operations of a step, torch flavour (torch's allocator, torch's stream)."""

    def __init__(self):
        import cupy
        import torch

        self.torch = torch
        self.array_type = torch.Tensor
        self.current_device = cupy.cuda.runtime.getDevice  # the CUDA runtime's, shared with torch
        self.float32 = torch.float32
        self._devices: dict = {}
        # The current stream as a raw handle without building a Stream object (what compiled torch
        # code uses); the public call is the fallback.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw if raw is not None else lambda index: torch.cuda.current_stream(index).cuda_stream

    @staticmethod
    def signature(x):
        return x.shape, x.stride(), x.dtype, x.device

    @staticmethod
    def pointer(x) -> int:
        return x.data_ptr()

    @staticmethod
    def strides_in_elements(x) -> tuple:
        return tuple(x.stride())

    def stream(self, device_id: int) -> int:
        return self._raw_stream(device_id)

    def _device(self, device_id: int):
        device = self._devices.get(device_id)
        if device is None:
            device = self._devices[device_id] = self.torch.device("cuda", device_id)
        return device

    def empty(self, shape, dtype, device_id: int):
        return self.torch.empty(shape, dtype=dtype, device=self._device(device_id))

    def scratch(self, nbytes: int, device_id: int):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self._device(device_id))


_frameworks: dict[str, object] = {}


def framework_ops(name: str):
    ops = _frameworks.get(name)
    if ops is None:
        ops = _frameworks[name] = _Cupy() if name == "cupy" else _Torch()
    return ops


def _kind_of(q) -> str | None:
    root = type(q).__module__.split(".", 1)[0]
    return root if root in ("cupy", "torch") else None


_steps: dict = {}


_OPTION_TYPES = (type(None), bool, int, float)


def _plain_option(value) -> bool:
    """Options compared by value: Python scalars and tuples of them. Anything else (a tensor or a
    NumPy scalar as softmax_scale, say) may hash by identity or change in place: the full path."""
    if type(value) is tuple:
        return all(type(v) in _OPTION_TYPES for v in value)
    return type(value) in _OPTION_TYPES


def call_key(q, arrays: tuple, options: tuple):
    """The fast-path key of a call (None when the call cannot take the fast path): the framework,
    each array argument's shape, strides, dtype and device, and the options with their types (so
    that num_splits=True, which the full path rejects, never matches num_splits=1)."""
    kind = _kind_of(q)
    if kind is None or not all(map(_plain_option, options)):
        return None
    ops = framework_ops(kind)
    array_type, signature = ops.array_type, ops.signature
    sig = []
    for x in arrays:
        if x is None:
            sig.append(None)
        elif type(x) is array_type or isinstance(x, array_type):
            sig.append(signature(x))
        else:  # a Python int, a NumPy array, another framework's tensor: the full path
            return None
    return kind, tuple(sig), options, tuple(map(type, options))


def lookup(key):
    return None if key is None else _steps.get(key)


class StepLaunch(NamedTuple):
    """One launch of a step; `slots` are (argument index, index into the step's pointer list)."""

    kernel: object  # the CuPy kernel, kept alive with its module
    function: int  # its CUfunction handle
    grid: tuple
    threads: int
    smem_bytes: int
    packer: object  # struct.Struct of the argument slots
    template: list  # the arguments, pointers still symbolic
    slots: tuple


def fill_arguments(step: StepLaunch, pointers: list) -> list:
    """The arguments of one recorded launch with this call's buffer addresses filled in. Pure."""
    args = step.template.copy()
    for index, source in step.slots:
        args[index] = pointers[source]
    return args


class Step:
    """One call signature's launches with the buffer addresses left open."""

    def __init__(self, kind: str, device_id: int, out_shape: tuple, out_dtype, lse_shape: tuple,
                 return_lse: bool, regions: dict[str, int], launches: list):
        self.ops = framework_ops(kind)
        self.device_id = device_id
        self.out_shape, self.out_dtype, self.lse_shape, self.return_lse = out_shape, out_dtype, lse_shape, return_lse
        self.offsets, self.scratch_bytes = scratch_layout(regions)
        self.launches = launches  # StepLaunch tuples
        self.calls = 0  # steps run (tests check that a loop takes the fast path)

    def __call__(self, arrays: tuple):
        """Run the step; None when the full path must take the call (it raises the right error)."""
        ops = self.ops
        if ops.current_device() != self.device_id:
            return None
        pointer = ops.pointer
        pointers = [0 if x is None else pointer(x) for x in arrays]
        if (pointers[0] | pointers[1] | pointers[2]) % 16:  # q, k_cache, v_cache: 16-byte copies
            return None
        device_id, offsets = self.device_id, self.offsets
        out = ops.empty(self.out_shape, self.out_dtype, device_id)
        lse = ops.empty(self.lse_shape, ops.float32, device_id) if self.return_lse else None
        scratch = ops.scratch(self.scratch_bytes, device_id) if self.scratch_bytes else None
        base = pointer(scratch) if scratch is not None else 0
        pointers += [pointer(out), pointer(lse) if lse is not None else base + offsets["lse"],
                     base + offsets.get("q_rot", 0), base + offsets.get("o_partial", 0),
                     base + offsets.get("lse_partial", 0)]
        stream = ops.stream(device_id)
        for step in self.launches:
            packed_launch.launch_packed(step.function, step.grid, step.threads, step.smem_bytes, stream, step.packer,
                                        fill_arguments(step, pointers))
        del scratch  # stream-ordered: reused only by work queued after this point
        self.calls += 1
        return (out, lse) if self.return_lse else out


def register(key, plan, infos: dict, arrays: tuple, device_id: int, q, return_lse: bool) -> None:
    """Keep a Step for this call signature, if the full path used the caller's buffers as given."""
    if key is None or not plan.launches:
        return
    ops = framework_ops(key[0])
    for name, x in zip(INPUT_BUFFERS, arrays, strict=True):
        info = infos[name]
        if (x is None) != (info is None):
            return
        if x is not None and (ops.pointer(x) != info.data_ptr or ops.strides_in_elements(x) != tuple(info.strides)):
            return  # copied or converted on the way (a last stride, fp16 rotary tables, ...)
    cache = plan.cache
    rows = cache.batch * cache.nheads * cache.seqlen_q
    # Partial rows are fp32_cols wide, as the kernels and the full path lay them out (head dims that
    # are not a multiple of 8 pad them).
    regions = {"o_partial": plan.partial_rows * fp32_cols(cache.head_dim) * 4, "lse_partial": plan.partial_rows * 4,
               "lse": 0 if return_lse else rows * 4,
               "q_rot": math.prod(infos["q"].shape) * infos["q"].itemsize if plan.rotate_q else 0}
    sources = {name: i for i, name in enumerate(INPUT_BUFFERS + OUTPUT_BUFFERS)}
    launches = []
    for step in plan.launches:
        kernel = get_kernel(step.config, device_id)  # loaded by the full path already; kept alive there
        grid = tuple(step.grid) + (1,) * (3 - len(step.grid))
        packer = packed_launch.slot_format(tuple(map(type, step.args)))
        template = [a.item() for a in step.args]  # Python scalars pack faster; the packer keeps the types
        slots = tuple((index, sources[name]) for index, name in step.pointer_slots)
        launches.append(StepLaunch(kernel, kernel.kernel.ptr, grid, step.config.threads, step.config.smem_bytes,
                                   packer, template, slots))
    if len(_steps) >= _MAX_STEPS:
        _steps.clear()
    _steps[key] = Step(key[0], device_id, tuple(q.shape), q.dtype, (cache.batch, cache.nheads, cache.seqlen_q),
                       return_lse, regions, launches)


def clear() -> None:
    _steps.clear()


__all__ = ["Step", "StepLaunch", "aligned_offsets", "call_key", "clear", "fill_arguments", "lookup", "register",
           "scratch_layout"]
