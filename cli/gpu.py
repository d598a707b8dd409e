"""GPU discovery shared by the commands (one place to ask 'is there a usable GPU?')."""

from __future__ import annotations

import dataclasses

from cuflash2.runtime.device import CUPY_MISSING


def find_gpu():
    """(cupy, "") when a CUDA GPU is usable, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, CUPY_MISSING
    try:
        available = cupy.cuda.is_available()
    except Exception as exc:  # a broken driver install: say what CuPy said
        return None, f"CUDA is not usable ({type(exc).__name__}: {exc})"
    if not available:
        return None, "no CUDA GPU found (cupy.cuda.is_available() is False)"
    return cupy, ""


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    device_id: int
    name: str
    major: int
    minor: int
    sm_count: int
    smem_optin_bytes: int
    l2_bytes: int
    memory_bytes: int

    @property
    def arch(self) -> str:
        return f"sm_{self.major}{self.minor}"


def gpu_info(cp, device_id: int | None = None) -> GpuInfo:
    device_id = cp.cuda.Device().id if device_id is None else device_id
    props = cp.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return GpuInfo(device_id, name, int(props["major"]), int(props["minor"]), int(props["multiProcessorCount"]),
                   int(props.get("sharedMemPerBlockOptin", 0)), int(props.get("l2CacheSize", 0)),
                   int(props.get("totalGlobalMem", 0)))


def cuda_version(number: int) -> str:
    """12040 -> '12.4'; 0 -> 'none'."""
    if not number:
        return "none"
    return f"{number // 1000}.{number % 1000 // 10}"


def no_gpu_error(command: str, reason: str) -> str:
    """One line: what is missing and what to do (cli.errors words every edge error)."""
    from .errors import no_gpu

    return no_gpu(command, reason)
