"""Kernel launches on a stream, and the device scratch memory a call's launches share.

A launch goes through `launch_kernel`, scratch through `scratch`: while `recording` runs, both are
kept by a recorder instead of reaching the GPU (cuflash2.core.replay records a call's launches this
way, whatever kernel family made them).

Arguments are packed by `struct` into one buffer (one cuLaunchKernel call).

CuPy's RawKernel call wraps every argument in a Python object before it launches. The attention
kernels take 40-70 scalars, so on small problems (a decoding step) that wrapping costs as much as
the GPU work. Here each argument gets an 8-byte slot in a per-thread buffer, the values are written
by one `struct.pack_into`, and the driver gets the array of slot addresses (`kernelParams`). The
driver copies each parameter by the size the kernel declares; the slots are little-endian, so a
4-byte int32/float32 parameter reads the low half of its slot.

The packing itself is pure (`slot_format`, `pack_slots`) and tested without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Callable, NamedTuple

import numpy as np

from .compiler import get_kernel
from .device import import_cupy
from .tensors import TensorInfo

SLOT_BYTES = 8
# Argument type -> struct code of one 8-byte slot (4-byte values padded at the end).
_SLOT_CODE = {np.uint64: "Q", np.int64: "q", np.int32: "i4x", np.float32: "f4x"}
_formats: dict[tuple, struct.Struct] = {}


def slot_format(types: tuple) -> struct.Struct:
    """The packing of arguments of these numpy scalar types, one 8-byte slot each (cached)."""
    packer = _formats.get(types)
    if packer is None:
        try:
            codes = "".join(_SLOT_CODE[t] for t in types)
        except KeyError as exc:
            raise TypeError(f"kernel argument: expected np.uint64, np.int64, np.int32 or np.float32, "
                            f"got {exc.args[0].__name__}") from None
        packer = _formats[types] = struct.Struct("<" + codes)
    return packer


def pack_slots(args: tuple, into=None) -> bytearray:
    """The argument slots of `args` as bytes (written into `into` when given)."""
    packer = slot_format(tuple(map(type, args)))
    if into is None:
        into = bytearray(packer.size)
    packer.pack_into(into, 0, *args)
    return into


# CuPy's driver and runtime bindings, imported on the first launch (the package imports without
# CuPy) and kept here so that a launch does not go through the import machinery.
_driver = None
_runtime = None


def _load_driver():
    global _driver
    from cupy_backends.cuda.api import driver

    _driver = driver
    return driver


def _load_runtime():
    global _runtime
    from cupy.cuda import runtime

    _runtime = runtime
    return runtime


class _ThreadSlots(threading.local):
    """Per-thread slot buffers by argument count: (values, array of slot addresses). The driver
    copies the parameters during cuLaunchKernel, so a buffer is free again once the call returns."""

    def __init__(self):
        self.buffers: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    def get(self, count: int):
        entry = self.buffers.get(count)
        if entry is None:
            values = np.zeros(count * SLOT_BYTES, dtype=np.uint8)
            addresses = values.ctypes.data + SLOT_BYTES * np.arange(count, dtype=np.uint64)
            entry = self.buffers[count] = (values, addresses, int(addresses.ctypes.data))
        return entry


_slots = _ThreadSlots()


def launch_packed_kernel(kernel, grid, threads: int, smem_bytes: int, stream, args: tuple) -> None:
    """Launch a CuPy RawKernel `kernel` on `stream` (the device's context must be current)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    launch_packed(kernel.kernel.ptr, grid, threads, smem_bytes, stream.ptr, slot_format(tuple(map(type, args))), args)


def launch_packed(function: int, grid: tuple, threads: int, smem_bytes: int, stream: int, packer: struct.Struct,
                  args) -> None:
    """Launch the CUfunction `function` with a 3-d grid on the raw stream handle `stream`, the
    arguments packed by `packer` (see slot_format; Python scalars or the numpy types it was made for)."""
    values, _, addresses_ptr = _slots.get(len(args))
    packer.pack_into(values, 0, *args)
    (_driver or _load_driver()).launchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, smem_bytes, stream,
                                             addresses_ptr, 0)


#: False launches through CuPy's RawKernel call instead of the packed-argument launch (A/B timing).
PACKED_LAUNCH = True


class _Recording(threading.local):
    recorder = None  # an object with launch(config, grid, args), launch_struct(config, grid, arguments)
    # and scratch(shape, dtype, zero)


_recording = _Recording()


def recording(recorder, run) -> None:
    """Run `run()` with `recorder` keeping its launches and scratch requests instead of the GPU."""
    previous, _recording.recorder = _recording.recorder, recorder
    try:
        run()
    finally:
        _recording.recorder = previous


def is_recording() -> bool:
    return _recording.recorder is not None


def launch_kernel(config, device_id: int, stream, grid, args) -> None:
    """Launch the kernel of `config` (compiled on first use) with numpy-scalar arguments."""
    if _recording.recorder is not None:
        _recording.recorder.launch(config, grid, args)
        return
    kernel = get_kernel(config, device_id)
    if PACKED_LAUNCH:
        launch_packed_kernel(kernel, grid, config.threads, config.smem_bytes, stream, args)
    else:
        kernel(grid, (config.threads,), args, shared_mem=config.smem_bytes, stream=stream)


class _ParamStruct(threading.local):
    """A per-thread buffer for one by-value parameter struct and the one-entry kernelParams array
    pointing at it (the driver copies the parameters during cuLaunchKernel)."""

    def __init__(self):
        self.buffers: dict[int, tuple[np.ndarray, int, np.ndarray]] = {}

    def get(self, nbytes: int):
        entry = self.buffers.get(nbytes)
        if entry is None:
            values = np.zeros(nbytes, dtype=np.uint8)
            pointers = np.array([values.ctypes.data], dtype=np.uint64)  # kept alive in the entry
            entry = self.buffers[nbytes] = (values, int(pointers.ctypes.data), pointers)
        return entry


_param_structs = _ParamStruct()


class StructArguments(NamedTuple):
    """The parameter struct of a launch: `build(addresses)` gives its fields in `packer`'s layout for
    the described tensors placed at `addresses` (one per entry of `tensors`, None for an absent one),
    so that a replay rebuilds it for new addresses (held inside TMA tensor maps, say) without
    describing the tensors again."""

    packer: struct.Struct
    tensors: tuple  # TensorInfo or None
    build: Callable

    def fields(self) -> tuple:
        """The fields for the described tensors where they are."""
        return self.build(tuple(None if t is None else t.data_ptr for t in self.tensors))


def launch_struct_kernel(config, device_id: int, stream, grid, arguments: StructArguments) -> None:
    """Launch a kernel whose one parameter is a by-value struct (see StructArguments)."""
    if _recording.recorder is not None:
        _recording.recorder.launch_struct(config, grid, arguments)
        return
    kernel = get_kernel(config, device_id)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    launch_struct(kernel.kernel.ptr, grid, config.threads, config.smem_bytes, stream.ptr, arguments.packer,
                  arguments.fields())


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): grid and block dims, dynamic shared memory, stream, attributes."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def max_active_clusters(config, device_id: int, cluster_ctas: int) -> int:
    """How many clusters of `cluster_ctas` CTAs of `config`'s kernel (its cluster dims compiled in)
    the device runs at once: cuOccupancyMaxActiveClusters, through ctypes (CuPy has no binding).
    It depends on how the SMs the process sees (an MPS limit, a green context) fall into GPCs, not
    on the SM count alone, and not on other work running at the time; asked once per config and
    device. 0 where not even one cluster fits."""
    kernel = get_kernel(config, device_id)
    launch = _LaunchConfig((ctypes.c_uint * 3)(cluster_ctas, 1, 1), (ctypes.c_uint * 3)(config.threads, 1, 1),
                           config.smem_bytes, None, None, 0)
    count = ctypes.c_int()
    query = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    query.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
    query.restype = ctypes.c_int
    with import_cupy().cuda.Device(device_id):
        status = query(ctypes.byref(count), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(launch))
    if status != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed for {config.short_id()}: CUresult {status}")
    return count.value


def launch_struct(function: int, grid: tuple, threads: int, smem_bytes: int, stream: int, packer: struct.Struct,
                  fields: tuple) -> None:
    """Launch the CUfunction `function` with its parameter struct's `fields` packed by `packer`."""
    values, pointers, _ = _param_structs.get(packer.size)
    packer.pack_into(values, 0, *fields)
    (_driver or _load_driver()).launchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, smem_bytes, stream,
                                             pointers, 0)


#: Scratch of launches captured into CUDA graphs: each replay of such a graph uses the addresses
#: captured, so the memory must outlive the call (and any reuse by the pool) for good.
_captured_scratch: list = []


def scratch(shape, dtype=np.float32, zero: bool = False):
    """(array, TensorInfo) of device scratch on the current stream (CuPy's pool, stream-ordered: keep
    the array until the launches that use it are queued). Recorded calls get a stand-in instead."""
    if _recording.recorder is not None:
        return None, _recording.recorder.scratch(shape, dtype, zero)
    cp = import_cupy()
    array = cp.zeros(shape, dtype=dtype) if zero else cp.empty(shape, dtype=dtype)
    if cp.cuda.get_current_stream().is_capturing():
        _captured_scratch.append(array)
    itemsize = np.dtype(dtype).itemsize
    info = TensorInfo(tuple(shape), tuple(s // itemsize for s in array.strides), np.dtype(dtype).name, "",
                      array.data.ptr, itemsize)
    return array, info


@functools.cache
def resident_slots(config, device_id: int) -> int:
    """How many thread blocks of `config` the GPU runs at once (SMs x resident blocks per SM)."""
    cp = import_cupy()
    from cupy_backends.cuda.api import driver

    kernel = get_kernel(config, device_id)
    with cp.cuda.Device(device_id):
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, config.threads,
                                                                   config.smem_bytes)
        return max(1, per_sm) * cp.cuda.Device(device_id).attributes["MultiProcessorCount"]


def fill(info, value, device_id: int) -> None:
    """Fill a described device tensor on the current stream (rare paths only: wraps it as a CuPy
    array). Value 0 is +0.0 in both 16-bit formats."""
    cp = import_cupy()
    if not all(info.shape):
        return
    itemsize = info.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(info.shape, info.strides))
    memory = cp.cuda.UnownedMemory(info.data_ptr, extent * itemsize, owner=None, device_id=device_id)
    dtype = np.float32 if info.dtype == "float32" else np.uint16
    view = cp.ndarray(info.shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0),
                      strides=tuple(s * itemsize for s in info.strides))
    view.fill(value)


def memset_async(address: int, nbytes: int, stream: int) -> None:
    (_runtime or _load_runtime()).memsetAsync(address, 0, nbytes, stream)
