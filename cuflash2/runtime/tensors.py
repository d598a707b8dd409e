"""Described tensors: what a launch needs to know about an array (pointer, shape, strides in
elements, dtype, device), whatever framework holds it."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What validation needs to know about an array, framework-independent."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # numpy-style name: "float16", "bfloat16", ...
    device: str  # "cpu" or "cuda:N"
    data_ptr: int = 0
    itemsize: int = 2


def contiguous_info(shape, dtype: str, itemsize: int, device: str = "", data_ptr: int = 0) -> TensorInfo:
    """TensorInfo of a dense row-major array of this shape."""
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(tuple(shape), strides, dtype, device, data_ptr, itemsize)
