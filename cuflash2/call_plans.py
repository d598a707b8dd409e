"""Repeated forward and backward calls: a call signature seen before skips the full path's Python.

A training loop makes the same attention call every step: the same shapes, strides, dtypes and
options, with new buffer addresses. The full path (describe, validate, choose the config, build the
kernel arguments) costs a few hundred Python operations, 210-380 us per call on the H200 machine's
CPU, as long as the forward kernels take at seqlen 512 (benchmarks/host_cost.py). So after a full-path
call of a plain forward or backward (no ALiBi, dropout or varlen; window and softcap are fine) whose
inputs were used as given (no copy on the way), its launches are recorded once with stand-in
addresses and kept under the call's key (kvcache_step.call_key: the framework, every array's
shape, strides, dtype and device, the options). A later call with that key reads the addresses,
allocates the outputs and one scratch buffer, fills the addresses into the recorded arguments and
launches: a few dozen Python operations.

The recording runs the full path's own launch functions (launch.forward / launch.backward), so the
replayed launches are the ones the full path would make. Anything the key does not pin down (an
address not 16-byte aligned, another current device) goes to the full path, which raises the errors.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from . import kvcache_step, launch, packed_launch
from .compiler import get_kernel
from .kvcache_step import StepLaunch, fill_arguments
from .kvcache_step import aligned_offsets as scratch_layout  # (the name the tests and callers use)
from .validate import TensorInfo, contiguous_info

FORWARD_INPUTS, FORWARD_OUTPUTS = ("q", "k", "v"), ("out", "lse")
BACKWARD_INPUTS, BACKWARD_OUTPUTS = ("dout", "q", "k", "v", "out", "lse"), ("dq", "dk", "dv")
_MAX_PLANS = 256
# Stand-in addresses of the recording: buffer i at _STAND_IN + i * 2^48 (far above any real address,
# so an argument equal to one can only be that buffer's pointer).
_STAND_IN, _STAND_IN_STEP = 1 << 60, 1 << 48

FAST_CALLS = True  # False sends every call through the full path (A/B timing, tests)
_plans: dict = {}  # key -> CallPlan, or _NO_PLAN where recording failed (warned once)
_NO_PLAN = object()


def forward_key(q, k, v, softmax_scale, causal, window, softcap):
    """The key of a forward call that may take a plan (None when it cannot). Plans launch with
    packed arguments, so CuPy's launcher (launch.PACKED_LAUNCH off, for A/B timing) turns them off."""
    if not (FAST_CALLS and launch.PACKED_LAUNCH):
        return None
    return _tagged("fwd", kvcache_step.call_key(q, (q, k, v), (softmax_scale, causal, window, softcap)))


def backward_key(dout, q, k, v, out, lse, softmax_scale, causal, window, softcap, deterministic):
    if not (FAST_CALLS and launch.PACKED_LAUNCH):
        return None
    return _tagged("bwd", kvcache_step.call_key(q, (dout, q, k, v, out, lse),
                                                (softmax_scale, causal, window, softcap, deterministic)))


def _tagged(direction: str, key):
    """(direction, framework, array signatures, options, option types), or None."""
    return None if key is None else (direction, *key)


def lookup(key):
    plan = None if key is None else _plans.get(key)
    return None if plan is _NO_PLAN else plan


def replay(key, arrays: tuple):
    """The outputs (a tuple) of the plan kept under `key` run on `arrays`; None when there is no
    such plan or it hands the call back to the full path."""
    plan = lookup(key)
    if plan is None:
        return None
    result = plan(arrays)
    return None if result is None else tuple(result)


class CallPlan:
    """The launches of one call signature with the buffer addresses left open."""

    def __init__(self, kind: str, device_id: int, outputs: list, launches: list, regions: list):
        self.ops = kvcache_step.framework_ops(kind)
        self.device_id = device_id
        self.outputs = outputs  # (shape, dtype) of each output, allocated contiguous
        self.launches = launches  # StepLaunch tuples; slot sources index inputs, outputs, scratch regions
        self.offsets, self.scratch_bytes = scratch_layout([nbytes for nbytes, _ in regions])
        self.zero_ranges = [(offset, nbytes) for offset, (nbytes, zero) in zip(self.offsets, regions) if zero]
        self.calls = 0  # calls run (tests check that a loop takes the plan)

    def __call__(self, inputs: tuple):
        """The outputs of a call on `inputs`; None when the full path must take it."""
        ops = self.ops
        if ops.current_device() != self.device_id:
            return None
        pointer = ops.pointer
        pointers = [pointer(x) for x in inputs]
        for p in pointers:
            if p % 16:  # the kernels' 16-byte copies: the full path raises the alignment error
                return None
        device_id = self.device_id
        outputs = [ops.empty(shape, dtype, device_id) for shape, dtype in self.outputs]
        pointers += [pointer(x) for x in outputs]
        stream = ops.stream(device_id)
        scratch = None
        if self.scratch_bytes:
            scratch = ops.scratch(self.scratch_bytes, device_id)
            base = pointer(scratch)
            pointers += [base + offset for offset in self.offsets]
            for offset, nbytes in self.zero_ranges:
                _memset_async(base + offset, nbytes, stream)
        for step in self.launches:
            packed_launch.launch_packed(step.function, step.grid, step.threads, step.smem_bytes, stream, step.packer,
                                        fill_arguments(step, pointers))
        del scratch  # stream-ordered: reused only by work queued after this point
        self.calls += 1
        return outputs


def _memset_async(address: int, nbytes: int, stream: int) -> None:
    from cupy.cuda import runtime

    runtime.memsetAsync(address, 0, nbytes, stream)


class Recorder:
    """Stands in for the GPU while launch.forward/backward run: keeps their launches and scratch
    requests instead of launching and allocating (launch._recording)."""

    def __init__(self, first_scratch_index: int):
        self.launches: list = []  # (config, grid, args)
        self.regions: list = []  # (nbytes, zero)
        self.first_scratch_index = first_scratch_index

    def launch(self, config, grid, args) -> None:
        self.launches.append((config, grid, args))

    def scratch(self, shape, dtype, zero: bool) -> TensorInfo:
        dtype = np.dtype(dtype)
        address = stand_in(self.first_scratch_index + len(self.regions))
        self.regions.append((math.prod(shape) * dtype.itemsize, zero))
        return contiguous_info(shape, dtype.name, dtype.itemsize, "", address)


def stand_in(index: int) -> int:
    return _STAND_IN + index * _STAND_IN_STEP


def plan_launches(recorded: list, kernel_of, buffers: int) -> list | None:
    """StepLaunch tuples of recorded (config, grid, args), each pointer argument made a slot that
    names its buffer (index into the per-call pointer list); None when an argument holds an address
    that is not a stand-in (a feature's tensor: such calls are not planned). Pure but for
    kernel_of(config) -> the loaded kernel."""
    sources = {stand_in(i): i for i in range(buffers)}
    launches = []
    for config, grid, args in recorded:
        slots = []
        for index, arg in enumerate(args):
            if type(arg) is np.uint64 and int(arg):
                if int(arg) not in sources:
                    return None
                slots.append((index, sources[int(arg)]))
        kernel = kernel_of(config)
        launches.append(StepLaunch(kernel, kernel.kernel.ptr, tuple(grid) + (1,) * (3 - len(grid)), config.threads,
                                   config.smem_bytes, packed_launch.slot_format(tuple(map(type, args))),
                                   [a.item() for a in args], tuple(slots)))
    return launches


def _is_contiguous(info: TensorInfo) -> bool:
    return info.strides == contiguous_info(info.shape, info.dtype, info.itemsize).strides


def _used_as_given(ops, arrays, infos) -> bool:
    """Whether the full path used the caller's arrays as they are (no copy on the way)."""
    return all(ops.pointer(x) == info.data_ptr and ops.strides_in_elements(x) == tuple(info.strides)
               for x, info in zip(arrays, infos, strict=True))


def _register(key, run_recorded, arrays, infos, output_infos, output_dtypes, device_id) -> None:
    """Record the launches of a full-path call and keep them under `key` (when it can be replayed)."""
    if key is None or key in _plans:
        return
    ops = kvcache_step.framework_ops(key[1])
    if not _used_as_given(ops, arrays, infos) or not all(map(_is_contiguous, output_infos)):
        return
    try:
        plan = _record(key[1], run_recorded, infos + output_infos, output_dtypes, device_id)
    except Exception as exc:  # the call's own work is queued already: it must not fail now
        warnings.warn(f"cuflash2: could not record a call plan ({type(exc).__name__}: {exc}); calls with this "
                      f"signature take the full path", RuntimeWarning, stacklevel=4)
        plan = _NO_PLAN
    if plan is None:
        return
    if len(_plans) >= _MAX_PLANS:  # first in, first out: a varying signature does not flush the rest
        del _plans[next(iter(_plans))]
    _plans[key] = plan


def _record(kind, run_recorded, infos, output_dtypes, device_id) -> CallPlan | None:
    """The CallPlan of run_recorded's launches (None when they hold an address it cannot fill)."""
    stand_ins = [dataclasses.replace(info, data_ptr=stand_in(i)) for i, info in enumerate(infos)]
    recorder = Recorder(len(stand_ins))
    launch.record(recorder, lambda: run_recorded(*stand_ins))
    launches = plan_launches(recorder.launches, lambda config: get_kernel(config, device_id),
                             len(stand_ins) + len(recorder.regions))
    if not launches:
        return None
    output_infos = infos[len(infos) - len(output_dtypes):]
    outputs = [(tuple(info.shape), dtype) for info, dtype in zip(output_infos, output_dtypes, strict=True)]
    return CallPlan(kind, device_id, outputs, launches, recorder.regions)


def _launches_kernels(shape) -> bool:
    """Empty problems are filled by the full path (zeros, LSE +inf) without the attention kernels."""
    return bool(shape.batch and shape.seqlen_q and shape.seqlen_k)


def register_forward(key, arrays, infos, output_infos, shape, causal, features, device_id) -> None:
    """After a full-path forward of (q, k, v) -> (out, lse): keep its plan under `key`."""
    if key is None or key in _plans or not features.replayable or not _launches_kernels(shape):
        return
    ops = kvcache_step.framework_ops(key[1])

    def run(q, k, v, out, lse):
        launch.forward(q, k, v, out, lse, shape, causal, device_id, None, features=features)

    _register(key, run, arrays, infos, output_infos, (arrays[0].dtype, ops.float32), device_id)


def register_backward(key, arrays, infos, output_infos, shape, causal, deterministic, features, device_id) -> None:
    """After a full-path backward of (dout, q, k, v, out, lse) -> (dq, dk, dv): keep its plan."""
    if key is None or key in _plans or not features.replayable or not _launches_kernels(shape):
        return

    def run(dout, q, k, v, out, lse, dq, dk, dv):
        launch.backward(dout, q, k, v, out, lse, dq, dk, dv, shape, causal, deterministic, device_id, None,
                        features=features)

    _register(key, run, arrays, infos, output_infos, tuple(x.dtype for x in arrays[1:4]), device_id)


def clear() -> None:
    _plans.clear()


__all__ = ["CallPlan", "Recorder", "backward_key", "clear", "fill_arguments", "forward_key", "lookup", "plan_launches",
           "register_backward", "register_forward", "replay", "scratch_layout"]
