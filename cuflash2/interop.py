"""Framework interop: NumPy / CuPy / any CUDA DLPack producer in, the caller's own type out.

GPU work always runs on the caller's stream: CuPy's current stream for CuPy arrays, torch's current
stream for torch tensors (wrapped as a CuPy external stream), CuPy's current stream for other DLPack
producers (they make their data ready on it when exporting). Nothing synchronises the device.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from .validate import TensorInfo

_DLPACK_CPU, _DLPACK_CUDA = 1, 2

CUPY_MISSING = ("cuflash2 needs CuPy for GPU arrays: pip install 'cuflash2[cuda12]' "
                "(CUDA 12) or 'cuflash2[cuda13]' (CUDA 13)")


def import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(CUPY_MISSING) from exc
    return cupy


def framework_of(x) -> str:
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (another CUDA producer)."""
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
    raise TypeError(f"expected a NumPy/CuPy array or a CUDA tensor with __dlpack__, got {type(x).__name__}")


def describe(name: str, x) -> TensorInfo:
    """TensorInfo of a NumPy or CuPy array (strides converted to elements)."""
    dtype = np.dtype(x.dtype)
    itemsize = dtype.itemsize
    if isinstance(x, np.ndarray):
        device, ptr = "cpu", x.__array_interface__["data"][0]
    else:
        device, ptr = f"cuda:{x.device.id}", x.data.ptr
    strides = tuple(s // itemsize for s in x.strides)
    return TensorInfo(tuple(x.shape), strides, dtype.name, device, ptr, itemsize)


def _check_cuda(name: str, x) -> None:
    device_type, _ = x.__dlpack_device__()
    if device_type != _DLPACK_CUDA:
        raise TypeError(f"{name}: expected a CUDA tensor (or a NumPy array for the CPU path), "
                        f"got a {type(x).__name__} on DLPack device type {device_type}")


def _torch_view(x):
    return x.detach() if getattr(x, "requires_grad", False) else x


def _last_dim_contiguous(cp, x):
    """The kernels need stride 1 in the last dim; copy (as FA2 does) when it is not."""
    if x.ndim and x.strides[-1] != x.dtype.itemsize and x.shape[-1] > 1:
        return cp.ascontiguousarray(x)
    return x


@dataclasses.dataclass
class GpuCall:
    """The inputs of one call as CuPy arrays, plus how to hand results back."""

    framework: str
    device_id: int
    stream: object  # cupy stream to launch on

    def to_cupy(self, name: str, x):
        cp = import_cupy()
        if self.framework != "cupy":
            _check_cuda(name, x)
            if self.framework == "torch":
                x = _torch_view(x)
            x = cp.from_dlpack(x)
        return _last_dim_contiguous(cp, x)

    def from_cupy(self, x):
        if self.framework == "torch":
            import torch

            return torch.from_dlpack(x)
        if self.framework == "jax":
            import jax

            return jax.dlpack.from_dlpack(x)
        return x


def _dlpack_device_id(x) -> int:
    return int(x.__dlpack_device__()[1])


@contextlib.contextmanager
def gpu_call(first_input):
    """Context for one GPU call: makes the input's device and the caller's stream current."""
    framework = framework_of(first_input)
    cp = import_cupy()
    if framework == "cupy":
        device_id = first_input.device.id
    else:
        _check_cuda("q", first_input)
        device_id = _dlpack_device_id(first_input)
    with cp.cuda.Device(device_id):
        if framework == "torch":
            import torch

            torch_stream = torch.cuda.current_stream(device_id)
            stream = cp.cuda.ExternalStream(torch_stream.cuda_stream, device_id)
        else:
            stream = cp.cuda.get_current_stream()
        with stream:
            yield GpuCall(framework, device_id, stream)


def as_float32(xp, x):
    """float32 copy of a float16/bfloat16/float32 array (bf16 widened bit-exactly, no dtype support needed)."""
    if np.dtype(x.dtype).name == "bfloat16":
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)
