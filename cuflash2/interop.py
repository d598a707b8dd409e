"""Framework interop: NumPy / CuPy / any CUDA DLPack producer in, the caller's own type out.

GPU work always runs on the caller's stream: CuPy's current stream for CuPy arrays, torch's current
stream for torch tensors (wrapped as a CuPy external stream), CuPy's current stream for other DLPack
producers (they make their data ready on it when exporting). Nothing synchronises the device.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from .validate import TensorInfo

_DLPACK_CPU, _DLPACK_CUDA = 1, 2

CUPY_MISSING = ("cuflash2 needs CuPy for GPU arrays: run pip install '.[cuda12]' in the cuflash2 checkout "
                "(CUDA 12 driver), or pip install '.[cuda13]' (CUDA 13)")


def import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(CUPY_MISSING) from exc
    return cupy


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


_DTYPE_NAMES: dict = {}  # dtype -> (name, itemsize): numpy's dtype.name is slow, and this runs per call


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


def _check_cuda(name: str, x) -> None:
    device_type, _ = x.__dlpack_device__()
    if device_type != _DLPACK_CUDA:
        raise TypeError(f"{name}: expected a CUDA tensor (or a NumPy array for the CPU path), "
                        f"got a {type(x).__name__} on DLPack device type {device_type}")


def _torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GpuCall:
    """One GPU call: the inputs described as device tensors, outputs allocated in the caller's
    framework, and the stream to launch on. Copies made on the way (a non-unit last stride) are
    kept alive here until the call ends."""

    def __init__(self, framework: str, device_id: int, stream):
        self.framework, self.device_id, self.stream = framework, device_id, stream
        self._keep: list = []

    def tensor(self, name: str, x) -> TensorInfo:
        """Describe a GPU input (the kernels need a unit last stride: copy when it is not, as FA2)."""
        if self.framework == "torch":
            if x.device.type != "cuda":
                raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device}")
            if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
                x = x.contiguous()
                self._keep.append(x)
            return TensorInfo(tuple(x.shape), tuple(x.stride()), _torch_dtype_name(x.dtype),
                              f"cuda:{x.device.index}", x.data_ptr(), x.element_size())
        return describe(name, self.to_cupy(name, x))

    def output(self, name: str, x) -> TensorInfo:
        """Describe a caller-given output buffer. Never copies (the kernels must write into the
        caller's memory), so a last dimension that is not contiguous is rejected."""
        if self.framework == "torch":
            if x.device.type != "cuda":
                raise TypeError(f"{name}: expected a CUDA tensor, got a tensor on {x.device}")
            info = TensorInfo(tuple(x.shape), tuple(x.stride()), _torch_dtype_name(x.dtype),
                              f"cuda:{x.device.index}", x.data_ptr(), x.element_size())
        else:
            cp = import_cupy()
            if framework_of(x, name) != "cupy":
                _check_cuda(name, x)
                x = cp.from_dlpack(x)
            info = describe(name, x)
        if info.shape and info.shape[-1] > 1 and info.strides[-1] != 1:
            raise ValueError(f"{name}: expected an output with a contiguous last dim (stride 1), "
                             f"got stride {info.strides[-1]}")
        return info

    def to_cupy(self, name: str, x):
        """A CuPy view of a GPU input (zero-copy through DLPack, except the last-stride copy)."""
        cp = import_cupy()
        if self.framework != "cupy":
            _check_cuda(name, x)
            if self.framework == "torch" and x.requires_grad:
                x = x.detach()
            x = cp.from_dlpack(x)
        if x.ndim and x.strides[-1] != x.dtype.itemsize and x.shape[-1] > 1:
            x = cp.ascontiguousarray(x)
        self._keep.append(x)
        return x

    def empty(self, shape, dtype_name: str, like=None):
        """(array in the caller's framework, its TensorInfo) for a new output."""
        if self.framework == "torch":
            import torch

            array = torch.empty(shape, dtype=getattr(torch, dtype_name), device=f"cuda:{self.device_id}")
            return array, self.tensor("out", array)
        cp = import_cupy()
        dtype = like.dtype if like is not None and np.dtype(like.dtype).name == dtype_name else np.dtype(dtype_name)
        array = cp.empty(shape, dtype=dtype)
        return array, describe("out", array)

    def result(self, x):
        """Hand an output back in the caller's framework (CuPy arrays converted zero-copy)."""
        if self.framework == "torch":
            import torch

            return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        if self.framework == "jax":
            import jax

            return jax.dlpack.from_dlpack(x)
        return x


def _dlpack_device_id(x) -> int:
    return int(x.__dlpack_device__()[1])


_external_streams: dict[tuple[int, int], object] = {}


def _torch_stream(cp, device_id: int):
    import torch

    return external_stream(cp, torch.cuda.current_stream(device_id).cuda_stream, device_id)


_torch_allocators: dict[int, object] = {}


def _torch_allocator(cp, device_id: int):
    """A CuPy allocator whose memory is a torch tensor: everything a torch call allocates (scratch,
    temporaries) is then counted by torch.cuda.memory_allocated, reused through torch's cache on
    torch's current stream (the one the call runs on), and legal under torch.cuda.graph capture."""
    allocate = _torch_allocators.get(device_id)
    if allocate is None:
        import torch

        device = torch.device("cuda", device_id)

        def allocate(nbytes: int):
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            memory = cp.cuda.UnownedMemory(block.data_ptr(), nbytes, owner=block, device_id=device_id)
            return cp.cuda.MemoryPointer(memory, 0)

        _torch_allocators[device_id] = allocate
    return allocate


def external_stream(cp, handle: int, device_id: int):
    """A (cached) CuPy wrapper of a stream owned by another framework."""
    stream = _external_streams.get((handle, device_id))
    if stream is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cp.cuda.ExternalStream(handle, device_id)
        _external_streams[(handle, device_id)] = stream
    return stream


@contextlib.contextmanager
def gpu_call(first_input):
    """Context for one GPU call: makes the input's device and the caller's stream current."""
    framework = framework_of(first_input)
    cp = import_cupy()
    if framework == "cupy":
        device_id = first_input.device.id
    elif framework == "torch":
        if first_input.device.type != "cuda":
            raise TypeError(f"q: expected a CUDA tensor (or a NumPy array for the CPU path), "
                            f"got a torch tensor on {first_input.device}")
        device_id = first_input.device.index
    else:
        _check_cuda("q", first_input)
        device_id = _dlpack_device_id(first_input)
    with cp.cuda.Device(device_id):
        if framework == "torch":  # scratch and CuPy temporaries come from torch's caching allocator too
            stream = _torch_stream(cp, device_id)
            with stream, cp.cuda.using_allocator(_torch_allocator(cp, device_id)):
                yield GpuCall(framework, device_id, stream)
        else:
            stream = cp.cuda.get_current_stream()
            with stream:
                yield GpuCall(framework, device_id, stream)


def as_float32(xp, x):
    """float32 copy of a float16/bfloat16/float32 array (bf16 widened bit-exactly, no dtype support needed)."""
    if np.dtype(x.dtype).name == "bfloat16":
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)
