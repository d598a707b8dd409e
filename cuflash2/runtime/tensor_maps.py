"""TMA tensor maps (CUtensorMap) for Hopper kernels, encoded by the CUDA driver.

CuPy has no binding for cuTensorMapEncodeTiled, so it is called through ctypes on the driver
library that CuPy itself uses. A map describes one tensor in global memory (address, sizes,
strides) and the box of elements one TMA instruction copies; it embeds the address, so each call
with new tensors needs new maps (encoding one takes about a microsecond).

The layout rules checked here are the hardware's: a 16-byte aligned base address, strides that are
multiples of 16 bytes and below 2^40, box sides of at most 256 elements, and an inner box of at
most the swizzle span (128 bytes).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

MAP_BYTES = 128
DATA_TYPE = {"float16": 6, "bfloat16": 9, "float32": 7}  # CUtensorMapDataType
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0  # out-of-range elements load as zero; stores to them are dropped


def strides_fit(data_ptr: int, strides_bytes, sizes) -> bool:
    """Whether a tensor can be described by a map: a 16-byte aligned base and, for every dim with
    more than one entry, a stride in bytes that is a multiple of 16 and below 2^40."""
    return data_ptr % 16 == 0 and all(n == 1 or (s % 16 == 0 and 0 < s < 2 ** 40)
                                      for s, n in zip(strides_bytes, sizes))


def describes(t) -> bool:
    """Whether a map can describe the array of TensorInfo `t` as it lies: contiguous last dim, and
    the base and other strides strides_fit takes."""
    return t.strides[-1] == 1 and strides_fit(t.data_ptr, [s * t.itemsize for s in t.strides[:-1]], t.shape[:-1])


@functools.cache
def _encode_function():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class _MapBuffer(threading.local):
    """A 64-byte aligned host buffer (per thread) the driver writes one map into."""

    def __init__(self):
        self.raw = np.zeros(MAP_BYTES + 64, dtype=np.uint8)
        self.offset = (-self.raw.ctypes.data) % 64
        self.address = self.raw.ctypes.data + self.offset


_buffer = _MapBuffer()
# Encoded maps by their arguments: a map is a pure function of them, and calls (replays especially)
# meet the same tensors again (an allocator hands the same addresses back).
_encoded: dict = {}
_MAX_ENCODED = 1024


def encode_tiled(dtype: str, data_ptr: int, sizes, strides_bytes, box, swizzle: int = SWIZZLE_128B) -> bytes:
    """The 128 bytes of a tiled tensor map. `sizes` lists the dims innermost first (the innermost
    has stride 1 element); `strides_bytes` the strides of the others, in bytes; `box` the copied
    box per dim. A dim of size 1 may have any stride (it is never stepped over)."""
    key = (dtype, data_ptr, tuple(sizes), tuple(strides_bytes), tuple(box), swizzle)
    encoded = _encoded.get(key)
    if encoded is None:
        encoded = _encode(dtype, data_ptr, sizes, strides_bytes, box, swizzle)
        if len(_encoded) >= _MAX_ENCODED:  # the oldest entry (two threads may both evict: no KeyError)
            _encoded.pop(next(iter(_encoded), None), None)
        _encoded[key] = encoded
    return encoded


def _encode(dtype: str, data_ptr: int, sizes, strides_bytes, box, swizzle: int) -> bytes:
    rank = len(sizes)
    if len(strides_bytes) != rank - 1 or len(box) != rank:
        raise ValueError(f"tensor map: {rank} sizes need {rank - 1} strides and {rank} box sides, "
                         f"got {len(strides_bytes)} and {len(box)}")
    if not strides_fit(data_ptr, strides_bytes, sizes[1:]):
        raise ValueError(f"tensor map: base 0x{data_ptr:x} must be 16-byte aligned and strides {list(strides_bytes)} "
                         f"(bytes) multiples of 16")
    if any(not 0 < b <= 256 for b in box):
        raise ValueError(f"tensor map: box sides must be within 1..256, got {list(box)}")
    # Dims of size 1 take a legal stride whatever the tensor says (torch leaves them arbitrary).
    fixed = [s if n > 1 else 16 for s, n in zip(strides_bytes, sizes[1:])]
    dims = (ctypes.c_uint64 * rank)(*sizes)
    strides = (ctypes.c_uint64 * max(1, rank - 1))(*fixed)
    boxes = (ctypes.c_uint32 * rank)(*box)
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    status = _encode_function()(_buffer.address, DATA_TYPE[dtype], rank, data_ptr, dims, strides, boxes, ones, 0,
                                swizzle, L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} (sizes {list(sizes)}, "
                           f"strides {fixed}, box {list(box)})")
    return _buffer.raw[_buffer.offset:_buffer.offset + MAP_BYTES].tobytes()
