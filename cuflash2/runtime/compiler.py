"""Kernel sources, NVRTC compilation and the compile cache.

Sources are read from the package (``cuflash2/kernels_cu`` in an installed wheel, ``kernels_cu/``
beside the package in a checkout; includes are paths relative to that folder) and their
``#include "..."`` lines are inlined, so the source string handed to CuPy covers every header:
CuPy's on-disk cache is keyed on that string (it does not hash included files), so editing any
header changes the key and nothing stale is ever loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.resources
import logging
import pathlib
import re
import struct
import threading
import time
from typing import Protocol


class KernelConfig(Protocol):
    """What the compiler needs of a kernel instantiation (a kernel family's config, hashable: the
    key of the loaded-kernel cache)."""

    source_file: str
    smem_bytes: int

    def template_name(self) -> str: ...

    def compile_options(self) -> tuple[str, ...]: ...

    def short_id(self) -> str: ...

#: Says when a kernel is compiled (or loaded from CuPy's disk cache) on its first use in a process.
#: Silent by default; logging.basicConfig(level=logging.INFO) or
#: logging.getLogger("cuflash2").setLevel(logging.INFO) with a handler turns it on.
logger = logging.getLogger("cuflash2")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_NVRTC_OPTIONS = ("-std=c++17", "-ftz=true")


def kernel_dir() -> pathlib.Path:
    """Folder holding the CUDA sources (installed package or source checkout)."""
    packaged = importlib.resources.files("cuflash2") / "kernels_cu"
    if packaged.is_dir():
        return pathlib.Path(str(packaged))
    checkout = pathlib.Path(__file__).resolve().parents[2] / "kernels_cu"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("cuflash2's CUDA sources (kernels_cu) are missing from this installation")


#: Where each kernel source file (KernelConfig.source_file) lives in kernels_cu/: common/ holds what
#: does not depend on an MMA instruction's fragment layout, mma_sync/ the mma.sync (m16n8k16) family.
#: Includes are written relative to kernels_cu/ as well ("common/ptx.cuh").
SOURCE_PATHS = {
    "flash_fwd.cu": "mma_sync/flash_fwd.cu",
    "flash_bwd.cu": "mma_sync/flash_bwd.cu",
    "flash_bwd_dq.cu": "mma_sync/flash_bwd_dq.cu",
    "flash_bwd_fused.cu": "mma_sync/flash_bwd_fused.cu",
    "flash_bwd_prepost.cu": "common/flash_bwd_prepost.cu",
    "kvcache.cu": "common/kvcache.cu",
}


def source_path(file_name: str) -> str:
    """Path of a kernel source file relative to kernel_dir() (paths pass through unchanged)."""
    return SOURCE_PATHS.get(file_name, file_name)


@functools.lru_cache(maxsize=None)
def kernel_source(file_name: str) -> str:
    """`file_name` with every quoted include inlined once (headers use #pragma once)."""
    folder = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (folder / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(source_path(file_name))


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    """Hash over every file under kernels_cu/, subfolders included (reported by `cuflash2 info`,
    used in cache keys)."""
    folder = kernel_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Compilation for the local GPU (CuPy RawModule; CuPy keeps the disk cache)
# --------------------------------------------------------------------------------------------

_loaded: dict[tuple[int, KernelConfig], object] = {}
_load_lock = threading.Lock()


def get_kernel(config: KernelConfig, device_id: int):
    """The compiled kernel for `config` on `device_id`, compiled on first use (then cached)."""
    key = (device_id, config)
    kernel = _loaded.get(key)
    if kernel is not None:
        return kernel
    with _load_lock:
        kernel = _loaded.get(key)
        if kernel is None:
            import cupy

            logger.info("compiling kernel %s on cuda:%d (first use of this variant in this process: "
                        "seconds with NVRTC, or a quick load from the kernel cache)", config.short_id(), device_id)
            start = time.perf_counter()
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=kernel_source(config.source_file),
                                        options=_NVRTC_OPTIONS + config.compile_options(),
                                        name_expressions=[config.template_name()])
                kernel = module.get_function(config.template_name())
                if config.smem_bytes > 48 * 1024:
                    kernel.max_dynamic_shared_size_bytes = config.smem_bytes
            logger.info("kernel %s ready in %.1f s", config.short_id(), time.perf_counter() - start)
            _loaded[key] = kernel
    return kernel


def local_report(item: tuple[KernelConfig, int]) -> tuple[str, bool]:
    """Compile one config for a local GPU (filling the disk cache); (report line, ok). A worker of
    `cuflash2 compile --jobs`, so it takes one picklable argument."""
    config, device_id = item
    start = time.perf_counter()
    try:
        import cupy

        arch = cupy.cuda.Device(device_id).compute_capability
        attrs = get_kernel(config, device_id).attributes
    except Exception as exc:  # report and go on: one bad kernel should not hide the others
        return f"ERROR {config.short_id()}: {exc}", False
    ok = attrs["local_size_bytes"] == 0
    return (f"{'ok   ' if ok else 'SPILL'} sm_{arch} {config.short_id():44s} regs={attrs['num_regs']:3d} "
            f"smem={config.smem_bytes:6d} local={attrs['local_size_bytes']} ({time.perf_counter() - start:.1f}s)"), ok


# --------------------------------------------------------------------------------------------
# Offline compilation (no GPU needed): NVRTC straight, with ptxas' resource report
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompileReport:
    config: KernelConfig
    arch: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    smem_bytes: int
    seconds: float
    error: str = ""
    slowdown_warnings: str = ""  # ptxas' notes that the code will run slower than written (PTXAS_SLOWDOWN)

    @property
    def ok(self) -> bool:
        return not self.error and self.stack_frame_bytes == 0 and self.spill_store_bytes == 0 \
            and self.spill_load_bytes == 0 and not self.slowdown_warnings

    @property
    def status(self) -> str:
        return "ok" if self.ok else "ERROR" if self.error else "SLOW" if self.slowdown_warnings else "SPILL"

    def line(self) -> str:
        status = self.status
        return (f"{status:5s} {self.arch:6s} {self.config.short_id():44s} regs={self.registers:3d} "
                f"smem={self.smem_bytes:6d} stack={self.stack_frame_bytes} "
                f"spill={self.spill_store_bytes}/{self.spill_load_bytes} ({self.seconds:.1f}s)")


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("CuPy is not installed (offline compilation needs it): run pip install '.[cuda12]' "
                           "in the cuflash2 checkout, or '.[cuda13]' for CUDA 13") from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); loads the library, so a missing CuPy or NVRTC raises here."""
    return tuple(_nvrtc().getVersion())


# ptxas messages that mean a silent slowdown of a Hopper kernel: "Potential Performance Loss"
# (setmaxnreg ignored, C7508; wgmma serialised), warpgroup.arrive/wait injected (C7517, C7519).
PTXAS_SLOWDOWN = re.compile(r"^.*(Performance Loss|is injected|serialized).*$", re.MULTILINE | re.IGNORECASE)


def slowdown_warnings(log: str) -> str:
    return "\n".join(m.group(0).strip() for m in PTXAS_SLOWDOWN.finditer(log))


def _parse_ptxas_log(log: str) -> dict[str, int]:
    def grab(pattern: str) -> int:
        match = re.search(pattern, log)
        return int(match.group(1)) if match else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack_frame_bytes": grab(r"(\d+) bytes stack frame"),
        "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
        "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
    }


@contextlib.contextmanager
def _offline_program(config: KernelConfig):
    """(NVRTC, a program of `config`'s source with its kernel's name expression), destroyed after."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(kernel_source(config.source_file), "cuflash2.cu", [], [])
    try:
        nvrtc.addNameExpression(program, config.template_name())
        yield nvrtc, program
    finally:
        nvrtc.destroyProgram(program)


def _offline_options(config: KernelConfig, arch: str) -> list[str]:
    return [f"-arch={arch}", *_NVRTC_OPTIONS, *config.compile_options()]


def compile_offline(config: KernelConfig, arch: str) -> CompileReport:
    """Compile `config` for `arch` (e.g. "sm_80", "sm_90") with NVRTC; no GPU needed."""
    start = time.perf_counter()
    with _offline_program(config) as (nvrtc, program):
        error = ""
        try:
            nvrtc.compileProgram(program, ["--ptxas-options=-v", *_offline_options(config, arch)])
        except nvrtc.NVRTCError:
            error = "compile error"
        log = nvrtc.getProgramLog(program)
        if error:
            error = log.strip() or error
        stats = _parse_ptxas_log(log)
    return CompileReport(config=config, arch=arch, smem_bytes=config.smem_bytes,
                         seconds=time.perf_counter() - start, error=error, slowdown_warnings=slowdown_warnings(log),
                         **stats)


@contextlib.contextmanager
def _compiled_program(config: KernelConfig, arch: str):
    """(NVRTC, the program of `config` compiled for `arch`); RuntimeError with NVRTC's log when the
    source does not compile."""
    with _offline_program(config) as (nvrtc, program):
        try:
            nvrtc.compileProgram(program, _offline_options(config, arch))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{config.template_name()} does not compile for {arch}:\n"
                               f"{nvrtc.getProgramLog(program)}") from exc
        yield nvrtc, program


def compile_cubin(config: KernelConfig, arch: str) -> bytes:
    """The cubin (ELF image) NVRTC builds for `config` on `arch` (e.g. "sm_90a"), no GPU needed: for
    reading the generated SASS with a disassembler (scripts/softmax_overlap.py). Raises RuntimeError
    with NVRTC's log when the source does not compile."""
    with _compiled_program(config, arch) as (nvrtc, program):
        return _whole_elf(nvrtc.getCUBIN(program))


def compile_ptx(config: KernelConfig, arch: str) -> str:
    """The PTX NVRTC generates for `config` on `arch`, no GPU needed: for tests that read the
    instruction mix (say, integer divisions left in a store loop). Raises RuntimeError with NVRTC's
    log when the source does not compile."""
    with _compiled_program(config, arch) as (nvrtc, program):
        ptx = nvrtc.getPTX(program)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")


def _whole_elf(image: bytes) -> bytes:
    """`image` zero-padded to the end of its ELF header tables. CuPy's getCUBIN drops the image's
    last byte, as if it ended in a string's terminating zero; the image ends in its last program
    header, whose last byte (the high byte of the alignment) is zero."""
    fields = _ELF64_HEADER.unpack_from(image)
    phoff, shoff, phentsize, phnum, shentsize, shnum = fields[5], fields[6], *fields[9:13]
    end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    return image + bytes(max(0, end - len(image)))


def offline_report(item: tuple[KernelConfig, str]) -> CompileReport:
    """compile_offline with one picklable argument (a worker of `cuflash2 compile --jobs`)."""
    return compile_offline(*item)
