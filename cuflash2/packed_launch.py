"""Kernel launches with the arguments packed by `struct` into one buffer (one cuLaunchKernel call).

CuPy's RawKernel call wraps every argument in a Python object before it launches. The attention
kernels take 40-70 scalars, so on small problems (a decoding step) that wrapping costs as much as
the GPU work. Here each argument gets an 8-byte slot in a per-thread buffer, the values are written
by one `struct.pack_into`, and the driver gets the array of slot addresses (`kernelParams`). The
driver copies each parameter by the size the kernel declares; the slots are little-endian, so a
4-byte int32/float32 parameter reads the low half of its slot.

The packing itself is pure (`slot_format`, `pack_slots`) and tested without a GPU.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

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


def launch(kernel, grid, threads: int, smem_bytes: int, stream, args: tuple) -> None:
    """Launch a CuPy RawKernel `kernel` on `stream` (the device's context must be current)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    launch_packed(kernel.kernel.ptr, grid, threads, smem_bytes, stream.ptr, slot_format(tuple(map(type, args))), args)


def launch_packed(function: int, grid: tuple, threads: int, smem_bytes: int, stream: int, packer: struct.Struct,
                  args) -> None:
    """Launch the CUfunction `function` with a 3-d grid on the raw stream handle `stream`, the
    arguments packed by `packer` (see slot_format; Python scalars or the numpy types it was made for)."""
    from cupy_backends.cuda.api import driver

    values, _, addresses_ptr = _slots.get(len(args))
    packer.pack_into(values, 0, *args)
    driver.launchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, smem_bytes, stream, addresses_ptr, 0)
