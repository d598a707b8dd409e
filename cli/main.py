"""`cuflash2` command-line interface."""

from __future__ import annotations

import os
import sys

import click

import cuflash2
from cuflash2 import families
from cuflash2.families import mma_sync as cfg
from cuflash2.runtime.device import CUPY_MISSING

from .bench_cmd import bench_command
from .check_cmd import check_command
from .errors import EdgeErrorGroup
from .info_cmd import info_command
from .progress import CompileSummary, Progress


def _parse_int_list(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None


def _parse_archs(text: str) -> list[int]:
    archs = []
    for part in text.split(","):
        part = part.strip().lower().removeprefix("sm_").removesuffix("a")
        if not part.isdigit() or int(part) < 80:
            raise click.BadParameter(f"expected archs like sm_80,sm_90 (>= sm_80), got {text!r}", param_hint="--arch")
        archs.append(int(part))
    return archs


@click.group(cls=EdgeErrorGroup)
@click.version_option(version=cuflash2.__version__, message="%(version)s")
def main() -> None:
    """cuflash2: FlashAttention-2 kernels compiled at run time by NVRTC."""


def _default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@main.command("compile")
@click.option("--arch", default=None, help="Target archs, e.g. sm_80,sm_90 (no GPU needed): these builds are "
                                           "checked (registers, spills), not cached. Default: compile for the "
                                           "local GPU and fill the kernel cache.")
@click.option("--head-dims", default=None, help="Comma-separated head dims, 1 to 256 (default: every bucket). Each "
                                                "compiles at the vector width of a contiguous tensor of that head dim.")
@click.option("--dtypes", default="bf16,fp16", show_default=True, help="Comma-separated: bf16, fp16.")
@click.option("--kernels", type=click.Choice(["all", "fwd", "bwd"]), default="all", show_default=True,
              help="Forward, backward, or both kernel families.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=_default_jobs, show_default="the CPU count",
              help="Compile in this many processes at once.")
def compile_command(arch: str | None, head_dims: str | None, dtypes: str, kernels: str, jobs: int) -> None:
    """Compile every kernel instantiation (plain and variant); report registers, smem, stack and
    spills, then a summary. Exits 1 on any compile error, spill or stack frame.

    Without --arch this fills the kernel cache for the local GPU, so later calls start at once (the
    first call of each variant otherwise compiles it, a few seconds each). With --arch the kernels
    are built for other GPUs, no GPU needed, to check them: those builds are not cached.
    On a terminal a progress bar shows n/N, elapsed time and ETA; otherwise plain lines.
    """
    dims = _parse_int_list(head_dims, "--head-dims") or list(cfg.HEAD_DIM_BUCKETS)
    dtype_list = [d.strip() for d in dtypes.split(",") if d.strip()]
    for d in dtype_list:
        if d not in cfg.DTYPES:
            raise click.BadParameter(f"expected bf16 or fp16, got {d!r}", param_hint="--dtypes")
    for dim in dims:
        if dim < 1 or dim > cfg.MAX_HEAD_DIM:
            raise click.BadParameter(f"expected head dims in [1, {cfg.MAX_HEAD_DIM}], got {dim}",
                                     param_hint="--head-dims")
    kinds = ("fwd", "bwd") if kernels == "all" else (kernels,)
    if arch is None:
        summary = _compile_local(dims, dtype_list, kinds, jobs)
    else:
        summary = _compile_offline(_parse_archs(arch), dims, dtype_list, kinds, jobs)
    click.echo(summary.line())
    if summary.failed or summary.spills:
        sys.exit(1)


def _configs(arch: int, dims: list[int], dtypes: list[str], kinds: tuple[str, ...] = ("fwd", "bwd")) -> list:
    """Every instantiation the library can launch for these head dims and dtypes on `arch`, over the
    kernel families (families.compile_configs)."""
    return families.compile_configs(arch, dims, dtypes, kinds)


def _run_all(worker, items, jobs: int):
    """worker(item) for every item, in `jobs` fresh processes (CUDA and NVRTC are process-safe;
    spawn, not fork, so no CUDA context is inherited). Yields results in order."""
    jobs = min(jobs, len(items))
    if jobs <= 1:
        yield from map(worker, items)
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(worker, items)


def _compile_offline(archs: list[int], dims: list[int], dtypes: list[str], kinds, jobs: int = 1) -> CompileSummary:
    from cuflash2.runtime.compiler import nvrtc_version, offline_report

    nvrtc_version()  # no CuPy or no NVRTC: one error now, not one per kernel (cli.errors words it)
    items = [(config, f"sm_{arch}") for arch in archs for config in _configs(arch, dims, dtypes, kinds)]
    summary = CompileSummary(len(items), jobs=min(jobs, len(items)), what=", ".join(f"sm_{a}" for a in archs),
                             cached=False)
    with Progress(len(items)) as progress:
        for report in _run_all(offline_report, items, jobs):
            status = report.status
            progress.emit(report.line(), report.error)
            summary.add(status)
    return summary


def _compile_local(dims: list[int], dtypes: list[str], kinds, jobs: int = 1) -> CompileSummary:
    from cuflash2.runtime.compiler import local_report, nvrtc_version

    from . import errors, gpu

    cp, reason = gpu.find_gpu()
    if cp is None:
        if reason == CUPY_MISSING:
            raise click.ClickException(errors.cupy_missing())
        raise click.ClickException(errors.no_gpu("compile", reason))
    nvrtc_version()
    device = cp.cuda.Device()
    arch = int(device.compute_capability)
    items = [(c, device.id) for c in _configs(arch, dims, dtypes, kinds)]
    summary = CompileSummary(len(items), jobs=min(jobs, len(items)), what=f"sm_{arch} (GPU {device.id})",
                             cached=True)
    with Progress(len(items)) as progress:
        for line, ok in _run_all(local_report, items, jobs):
            status = "ok" if ok else ("SPILL" if line.startswith("SPILL") else "ERROR")
            progress.emit(line)
            summary.add(status)
    return summary


main.add_command(info_command)
main.add_command(check_command)
main.add_command(bench_command)


if __name__ == "__main__":
    main()
