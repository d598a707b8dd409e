"""Which framework an array belongs to, and the description of NumPy and CuPy arrays."""

from __future__ import annotations

import numpy as np

from ..runtime.tensors import TensorInfo

_DLPACK_CUDA = 2
_DTYPE_NAMES: dict = {}  # dtype -> (name, itemsize): numpy's dtype.name is slow, and this runs per call


def framework_of(x, name: str = "q") -> str:
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (another CUDA producer) for argument `name`."""
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.split(".")[0]
    if root == "cupy":
        return "cupy"
    if root == "torch":
        return "torch"
    if root in ("jax", "jaxlib"):
        return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"{name}: expected a NumPy/CuPy array or a CUDA tensor with __dlpack__, "
                    f"got {type(x).__name__}")


def describe(name: str, x) -> TensorInfo:
    """TensorInfo of a NumPy or CuPy array (strides converted to elements)."""
    known = _DTYPE_NAMES.get(x.dtype)
    if known is None:
        dtype = np.dtype(x.dtype)
        known = _DTYPE_NAMES[x.dtype] = (dtype.name, dtype.itemsize)
    dtype_name, itemsize = known
    if isinstance(x, np.ndarray):
        device, ptr = "cpu", x.__array_interface__["data"][0]
    else:
        device, ptr = f"cuda:{x.device.id}", x.data.ptr
    strides = tuple(s // itemsize for s in x.strides)
    return TensorInfo(tuple(x.shape), strides, dtype_name, device, ptr, itemsize)


def check_cuda(name: str, x) -> None:
    device_type, _ = x.__dlpack_device__()
    if device_type != _DLPACK_CUDA:
        raise TypeError(f"{name}: expected a CUDA tensor (or a NumPy array for the CPU path), "
                        f"got a {type(x).__name__} on DLPack device type {device_type}")


__all__ = ["check_cuda", "describe", "framework_of"]
