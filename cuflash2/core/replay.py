"""Record a call's kernel launches once per call signature, replay them with new buffer addresses.

A training or decoding loop makes the same attention call every step: the same shapes, strides,
dtypes and options, with new buffer addresses. Describing, validating, choosing tiles and building
the kernels' argument lists costs a few hundred Python operations per call (210-380 us on the H200
machine's CPU for a forward or backward, as long as the forward kernels take at seqlen 512), so it
is done once:

- record: a call's launches run with stand-in addresses while cuflash2.runtime.launcher.recording
  keeps them (and the call's scratch requests) instead of the GPU. The launch functions are the
  ones the call would run anyway (whichever kernel family's), so a replay launches exactly what a
  direct call would. Each pointer argument equal to a stand-in becomes a slot naming its buffer.
- run a `Recording`: fill this call's addresses into the slots and launch, with one scratch buffer
  for all the call's scratch regions (those that must start at zero are cleared on the stream).
- `Replay`: a Recording plus what a call needs without the full path: the framework's operations
  (current device, pointers, allocation, stream) to allocate the outputs and scratch. A full-path
  call keeps one under its key (the framework's signature of the raw arguments); a later call with
  that key skips describing and validating and costs a few dozen Python operations.

Forward and backward calls record after a full-path call and keep a Replay; the KV-cache and varlen
calls run their launches from a Recording on every call (the full path then only describes and
checks) and the KV-cache keeps a Replay too.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from typing import NamedTuple

import numpy as np

from .. import families
from ..runtime import launcher
from ..runtime.compiler import get_kernel
from ..runtime.tensors import TensorInfo, contiguous_info

# Stand-in addresses of a recording: buffer i at _STAND_IN + i * 2^48 (far above any real address,
# so an argument equal to one can only be that buffer's pointer), plus the real buffer's address
# modulo 16 where the launches depend on it (vector widths).
_STAND_IN, _STAND_IN_STEP = 1 << 60, 1 << 48
_SCRATCH_ALIGN = 256
_MAX_REPLAYS = 256

#: False sends every call through the full path (A/B timing, tests).
FAST_CALLS = True


def stand_in(index: int, offset: int = 0) -> int:
    return _STAND_IN + index * _STAND_IN_STEP + offset


def scratch_layout(sizes: list[int]) -> tuple[list[int], int]:
    """(byte offset of each region, total bytes) for scratch regions of the given sizes laid out
    back to back, each starting at a multiple of 256 bytes (the kernels read partial outputs with
    16-byte loads; empty regions take no bytes). Pure."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += math.ceil(nbytes / _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return offsets, total


class Recorder:
    """Stands in for the GPU while a call's launches run: keeps their launches and scratch requests
    instead of launching and allocating (cuflash2.runtime.launcher.recording)."""

    def __init__(self, first_scratch_index: int):
        self.launches: list = []  # (config, grid, args)
        self.regions: list = []  # (nbytes, zero)
        self.first_scratch_index = first_scratch_index

    def launch(self, config, grid, args) -> None:
        self.launches.append((config, grid, args))

    def launch_struct(self, config, grid, arguments: launcher.StructArguments) -> None:
        self.launches.append((config, grid, arguments))

    def scratch(self, shape, dtype, zero: bool) -> TensorInfo:
        dtype = np.dtype(dtype)
        address = stand_in(self.first_scratch_index + len(self.regions))
        self.regions.append((math.prod(shape) * dtype.itemsize, zero))
        return contiguous_info(shape, dtype.name, dtype.itemsize, "", address)


class RecordedLaunch(NamedTuple):
    """One launch of a recording; `slots` are (argument index, index into the call's pointer list)."""

    kernel: object  # the CuPy kernel, kept alive with its module
    function: int  # its CUfunction handle
    grid: tuple
    threads: int
    smem_bytes: int
    packer: object  # struct.Struct of the argument slots
    template: list  # the arguments as Python scalars, pointers still symbolic
    slots: tuple
    types: tuple  # the arguments' numpy types (for CuPy's launcher)
    config: object  # the kernel family's config of the kernel
    struct: launcher.StructArguments | None = None  # a parameter-struct launch: slots index its tensors
    last_struct: list | None = None  # [(addresses, fields)] of its last call
    gather: object = None  # pointers -> the addresses of its struct's tensors (address_gatherer)


def address_gatherer(slots: tuple):
    """A function of a call's pointer list giving the addresses of `slots` as a tuple (None for a
    None slot: an absent tensor)."""
    if slots and None not in slots:
        if len(slots) == 1:
            return lambda pointers: (pointers[slots[0]],)
        return operator.itemgetter(*slots)
    return lambda pointers: tuple(None if source is None else pointers[source] for source in slots)


def struct_fields(step: RecordedLaunch, pointers: list) -> tuple:
    """The parameter struct of a recorded struct launch built for this call's buffer addresses (the
    last call's fields again when the addresses are the same: a caching allocator hands them back)."""
    addresses = step.gather(pointers)
    last = step.last_struct[0]
    if last is not None and last[0] == addresses:
        return last[1]
    fields = step.struct.build(addresses)
    step.last_struct[0] = (addresses, fields)  # one assignment: another thread sees the old or the new pair
    return fields


def launch_struct_step(step: RecordedLaunch, pointers: list, stream: int) -> None:
    """Launch a recorded parameter-struct launch for this call's buffers on the raw stream `stream`."""
    launcher.launch_struct(step.function, step.grid, step.threads, step.smem_bytes, stream, step.packer,
                           struct_fields(step, pointers))


def fill_arguments(step: RecordedLaunch, pointers: list) -> list:
    """The arguments of one recorded launch with this call's buffer addresses filled in. Pure."""
    args = step.template.copy()
    for index, source in step.slots:
        args[index] = pointers[source]
    return args


def recorded_launches(recorded: list, kernel_of, sources: dict) -> list | None:
    """RecordedLaunch tuples of recorded (config, grid, args), each pointer argument made a slot that
    names its buffer (`sources`: stand-in address -> index into the per-call pointer list); None
    when an argument holds an address that is not a stand-in (a tensor the recording did not
    cover). Pure but for kernel_of(config) -> the loaded kernel."""
    launches = []
    for config, grid, args in recorded:
        if isinstance(args, launcher.StructArguments):
            if any(info is not None and info.data_ptr not in sources for info in args.tensors):
                return None
            kernel = kernel_of(config)
            slots = tuple(None if info is None else sources[info.data_ptr] for info in args.tensors)
            launches.append(RecordedLaunch(kernel, kernel.kernel.ptr, tuple(grid) + (1,) * (3 - len(grid)),
                                           config.threads, config.smem_bytes, args.packer, [], slots, (), config,
                                           args, [None], address_gatherer(slots)))
            continue
        slots = []
        for index, arg in enumerate(args):
            if type(arg) is np.uint64 and int(arg):
                if int(arg) not in sources:
                    return None
                slots.append((index, sources[int(arg)]))
        kernel = kernel_of(config)
        types = tuple(map(type, args))
        launches.append(RecordedLaunch(kernel, kernel.kernel.ptr, tuple(grid) + (1,) * (3 - len(grid)),
                                       config.threads, config.smem_bytes, launcher.slot_format(types),
                                       [a.item() for a in args], tuple(slots), types, config))
    return launches


@dataclasses.dataclass
class Recording:
    """The launches of one call signature with the buffer addresses left open: `buffers` given per
    call (inputs and outputs, in the order of the recorded TensorInfos), then the scratch regions."""

    launches: list
    buffers: int
    regions: list  # (nbytes, zero) of each scratch region, in request order

    def __post_init__(self):
        self.offsets, self.scratch_bytes = scratch_layout([nbytes for nbytes, _ in self.regions])
        self.zero_ranges = [(offset, nbytes) for offset, (nbytes, zero) in zip(self.offsets, self.regions) if zero]

    def run(self, pointers: list, stream: int, scratch_base: int = 0) -> None:
        """Launch on the raw stream handle `stream`: `pointers` are the buffers' addresses (0 for an
        absent one), `scratch_base` the address of scratch_bytes of device memory."""
        if self.regions:
            pointers = pointers + [scratch_base + offset for offset in self.offsets]
            for offset, nbytes in self.zero_ranges:
                launcher.memset_async(scratch_base + offset, nbytes, stream)
        launch_packed, launch_struct = launcher.launch_packed, launcher.launch_struct
        for step in self.launches:
            if step.struct is not None:
                launch_struct(step.function, step.grid, step.threads, step.smem_bytes, stream, step.packer,
                              struct_fields(step, pointers))
                continue
            launch_packed(step.function, step.grid, step.threads, step.smem_bytes, stream, step.packer,
                          fill_arguments(step, pointers))

    def run_direct(self, pointers: list, stream) -> None:
        """`run` on a CuPy stream with scratch from CuPy's pool (the full path of a call);
        CuPy's own launcher when launcher.PACKED_LAUNCH is off."""
        scratch = None
        base = 0
        if self.scratch_bytes:
            scratch = launcher.scratch((self.scratch_bytes,), np.uint8)[0]
            base = scratch.data.ptr
        if launcher.PACKED_LAUNCH:
            self.run(pointers, stream.ptr, base)
        else:
            pointers = pointers + [base + offset for offset in self.offsets]
            for offset, nbytes in self.zero_ranges:
                launcher.memset_async(base + offset, nbytes, stream.ptr)
            for step in self.launches:
                if step.struct is not None:
                    launch_struct_step(step, pointers, stream.ptr)
                    continue
                args = [kind(a) for kind, a in zip(step.types, fill_arguments(step, pointers))]
                step.kernel(step.grid, (step.threads,), args, shared_mem=step.smem_bytes, stream=stream)
        del scratch  # stream-ordered: reused only by work queued after this point


def record(run, infos: list, device_id: int, offsets: tuple | None = None) -> Recording | None:
    """The Recording of run(*stand_ins) for the described buffers `infos` (None entries stay None);
    None when the launches hold an address the stand-ins do not cover. `offsets`: each buffer's
    address modulo 16 where the recorded launches may depend on it (else 0)."""
    offsets = offsets or (0,) * len(infos)
    stand_ins = [None if info is None else dataclasses.replace(info, data_ptr=stand_in(i, offset))
                 for i, (info, offset) in enumerate(zip(infos, offsets, strict=True))]
    recorder = Recorder(len(stand_ins))
    launcher.recording(recorder, lambda: run(*stand_ins))
    sources = {info.data_ptr: i for i, info in enumerate(stand_ins) if info is not None}
    sources.update((stand_in(len(stand_ins) + i), len(stand_ins) + i) for i in range(len(recorder.regions)))
    launches = recorded_launches(recorder.launches, lambda config: get_kernel(config, device_id), sources)
    if launches is None:
        return None
    return Recording(launches, len(stand_ins), recorder.regions)


class Replay:
    """A call signature's Recording run without the full path. `ops` are the framework's operations:
    current_device(), pointer(x) -> address, allocator(shape, dtype, device_id) and
    scratch_allocator(nbytes, device_id) -> a callable that returns a new array each call,
    stream_getter(device_id) -> a callable that returns the raw handle of the current stream. The
    callables are made once here, so that a call costs as few Python operations as it can (a replay
    exists to make a repeated call cheap). Inputs may be None (an absent optional tensor); the first
    `aligned_inputs` must be 16-byte aligned (the kernels' widest copies: the full path takes the
    others, and raises the alignment errors)."""

    def __init__(self, recording: Recording, ops, device_id: int, outputs: list, aligned_inputs: int,
                 single: bool = False):
        self.recording, self.ops, self.device_id = recording, ops, device_id
        self.outputs = outputs  # (shape, dtype) of each output, allocated contiguous
        self.aligned_inputs = aligned_inputs
        self.single = single  # return the one output itself, not a tuple
        self.calls = 0  # calls run (tests check that a loop takes the replay)
        self._allocators = [ops.allocator(shape, dtype, device_id) for shape, dtype in outputs]
        self._scratch = ops.scratch_allocator(recording.scratch_bytes, device_id) if recording.scratch_bytes else None
        self._stream = ops.stream_getter(device_id)

    def __call__(self, inputs: tuple):
        """The outputs of a call on `inputs`; None when the full path must take it."""
        ops = self.ops
        if ops.current_device() != self.device_id:
            return None
        pointer = ops.pointer
        pointers = [0 if x is None else pointer(x) for x in inputs]
        for p in pointers[:self.aligned_inputs]:
            if p % 16:
                return None
        outputs = [allocate() for allocate in self._allocators]
        pointers += map(pointer, outputs)
        scratch = self._scratch() if self._scratch is not None else None
        self.recording.run(pointers, self._stream(), 0 if scratch is None else pointer(scratch))
        del scratch  # stream-ordered: reused only by work queued after this point
        self.calls += 1
        return outputs[0] if self.single else tuple(outputs)


#: Kept under a key whose calls cannot be recorded (or whose recording failed, warned once).
UNREPLAYABLE = object()


class ReplayCache:
    """Replays by key, at most _MAX_REPLAYS (first in, first out: a varying signature does not flush
    the others). A key whose recording failed is remembered, so it warns once."""

    def __init__(self):
        self.entries: dict = {}
        self.environment = families.environment()

    def _current(self) -> dict:
        """The entries, emptied first when the kernel choice's environment changed since they were
        kept (CUFLASH2_FAMILY set to compare families, say)."""
        environment = families.environment()
        if environment != self.environment:
            self.entries.clear()
            self.environment = environment
        return self.entries

    def lookup(self, key):
        entry = None if key is None else self._current().get(key)
        return None if entry is UNREPLAYABLE else entry

    def __contains__(self, key) -> bool:
        return key in self._current()

    def keep(self, key, entry) -> None:
        """Keep `entry` under `key` (None: remember that the key cannot be replayed)."""
        entries = self._current()
        if len(entries) >= _MAX_REPLAYS:
            del entries[next(iter(entries))]
        entries[key] = UNREPLAYABLE if entry is None else entry

    def keep_recorded(self, key, make_replay) -> None:
        """Keep make_replay() under `key`: a failure warns (the call's own work is queued already, so
        it must not fail now) and marks the key; None (not replayable) keeps nothing."""
        try:
            replay = make_replay()
        except Exception as exc:
            warnings.warn(f"cuflash2: could not record a call plan ({type(exc).__name__}: {exc}); calls with this "
                          f"signature take the full path", RuntimeWarning, stacklevel=5)
            replay = UNREPLAYABLE
        if replay is not None:
            self.keep(key, replay)

    def clear(self) -> None:
        self.entries.clear()


#: Forward and backward calls (keys from the frameworks' call signatures).
CALLS = ReplayCache()
#: KV-cache calls: Replays by raw call signature, Recordings by described signature.
KVCACHE_STEPS = ReplayCache()
RECORDINGS = ReplayCache()


def used_as_given(ops, arrays, infos) -> bool:
    """Whether the full path used the caller's arrays as they are (no copy on the way): only then can
    a replay take the arrays' own addresses. None entries must match."""
    for x, info in zip(arrays, infos, strict=True):
        if (x is None) != (info is None):
            return False
        if x is not None and (ops.pointer(x) != info.data_ptr or ops.strides_in_elements(x) != tuple(info.strides)):
            return False
    return True


def is_contiguous(info: TensorInfo) -> bool:
    return info.strides == contiguous_info(info.shape, info.dtype, info.itemsize).strides


def replay(key, inputs: tuple):
    """The outputs of the Replay kept under `key` run on `inputs`; None when there is none or it
    hands the call back to the full path."""
    entry = CALLS.lookup(key)
    return None if entry is None else entry(inputs)


def clear() -> None:
    """Forget every recording and replay (after changing a tile rule, for instance)."""
    CALLS.clear()
    KVCACHE_STEPS.clear()
    RECORDINGS.clear()


__all__ = ["CALLS", "FAST_CALLS", "KVCACHE_STEPS", "RECORDINGS", "UNREPLAYABLE", "RecordedLaunch", "Recorder",
           "Recording", "Replay", "ReplayCache", "address_gatherer", "clear", "fill_arguments", "is_contiguous",
           "launch_struct_step", "record", "recorded_launches", "replay", "scratch_layout", "stand_in",
           "struct_fields", "used_as_given"]
