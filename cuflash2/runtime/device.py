"""The CUDA device as CuPy sees it: CuPy itself (imported on first use, with a clear error when it
is missing), compute capability and multiprocessor count (cached: reading device attributes costs
far more than a launch)."""

from __future__ import annotations

import functools

CUPY_MISSING = ("cuflash2 needs CuPy for GPU arrays: run pip install '.[cuda12]' in the cuflash2 checkout "
                "(CUDA 12 driver), or pip install '.[cuda13]' (CUDA 13)")


def import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(CUPY_MISSING) from exc
    return cupy


def check_compute_capability(major: int, minor: int) -> int:
    arch = major * 10 + minor
    if arch < 80:
        raise RuntimeError(f"device: expected a GPU of compute capability >= 8.0 (Ampere or newer), "
                           f"got {major}.{minor}")
    return arch


@functools.cache
def device_arch(device_id: int) -> int:
    """Compute capability as an int (90 for sm_90), checked to be >= 8.0."""
    cc = import_cupy().cuda.Device(device_id).compute_capability
    return check_compute_capability(int(cc[:-1]), int(cc[-1]))


@functools.cache
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of the device."""
    cp = import_cupy()
    return cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)
