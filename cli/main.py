"""`cuflash2` command-line interface."""

from __future__ import annotations

import sys

import click

import cuflash2
from cuflash2 import config as cfg

from .bench_cmd import bench_command
from .check_cmd import check_command
from .info_cmd import info_command


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


@click.group()
@click.version_option(version=cuflash2.__version__, message="%(version)s")
def main() -> None:
    """cuflash2: FlashAttention-2 kernels compiled at run time by NVRTC."""


@main.command("compile")
@click.option("--arch", default=None, help="Target archs, e.g. sm_80,sm_90 (no GPU needed). "
                                           "Default: precompile for the local GPU.")
@click.option("--head-dims", default=None, help="Comma-separated head dims, 1 to 256 (default: every bucket). Each "
                                                "compiles at the vector width of a contiguous tensor of that head dim.")
@click.option("--dtypes", default="bf16,fp16", show_default=True, help="Comma-separated: bf16, fp16.")
@click.option("--kernels", type=click.Choice(["all", "fwd", "bwd"]), default="all", show_default=True,
              help="Forward, backward, or both kernel families.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Compile in this many processes at once.")
def compile_command(arch: str | None, head_dims: str | None, dtypes: str, kernels: str, jobs: int) -> None:
    """Compile every kernel instantiation (plain and variant); report registers, smem, stack and
    spills. Without --arch this fills the kernel cache for the local GPU, so later calls start at once."""
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
        failures = _compile_local(dims, dtype_list, kinds, jobs)
    else:
        failures = _compile_offline(_parse_archs(arch), dims, dtype_list, kinds, jobs)
    if failures:
        click.echo(f"{failures} kernel(s) failed (compile error, spill or stack frame)", err=True)
        sys.exit(1)


def _configs(arch: int, dims: list[int], dtypes: list[str], kinds: tuple[str, ...] = ("fwd", "bwd")
             ) -> list[cfg.KernelConfig]:
    """Every instantiation the library can launch for these head dims and dtypes on `arch`, at the
    vector width of contiguous tensors of each head dim (cfg.vector_width)."""
    unique: dict[cfg.KernelConfig, None] = {}
    for dim in dims:
        vec = cfg.vector_width(dim)
        unique.update(dict.fromkeys(cfg.with_vector_width(c, vec) for c in _configs_of_dim(arch, dim, dtypes, kinds)))
    return sorted(unique, key=lambda c: c.short_id())


def _configs_of_dim(arch: int, dim: int, dtypes: list[str], kinds: tuple[str, ...]) -> list[cfg.KernelConfig]:
    unique: dict[cfg.KernelConfig, None] = {}
    for dtype in dtypes:
        for causal in (False, True):
            for variant in (False, True):
                if "fwd" in kinds:
                    for seqlen in cfg.FWD_SEQLEN_CLASSES:  # the tiles chosen by length too
                        unique[cfg.forward_config(dim, dtype, causal, arch, variant, seqlen)] = None
                    for rows in (64, cfg.KVCACHE_SHORT_ROWS, cfg.DECODE_ROWS):
                        unique[cfg.kvcache_config(dim, dtype, causal, arch, rows)] = None
                    unique.update(dict.fromkeys(cfg.kvcache_helper_configs(dtype)))
            if "bwd" in kinds:
                for options in cfg.backward_plan_options(arch):
                    for gqa in (False, True):
                        if options.get("fused") and not cfg.fused_backward_supported(
                                cfg.head_dim_bucket(dim), arch, causal=causal, gqa=gqa):
                            continue
                        plan = cfg.backward_plan(dim, dtype, causal, arch, gqa=gqa, **options)
                        unique.update(dict.fromkeys(plan.kernels()))
    return list(unique)


def _run_all(worker, items, jobs: int):
    """worker(item) for every item, in `jobs` fresh processes (CUDA and NVRTC are process-safe;
    spawn, not fork, so no CUDA context is inherited). Yields results in order."""
    if jobs == 1:
        yield from map(worker, items)
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(worker, items)


def _compile_offline(archs: list[int], dims: list[int], dtypes: list[str], kinds, jobs: int = 1) -> int:
    from cuflash2.compiler import offline_report

    failures = 0
    items = [(config, f"sm_{arch}") for arch in archs for config in _configs(arch, dims, dtypes, kinds)]
    for report in _run_all(offline_report, items, jobs):
        click.echo(report.line())
        if report.error:
            click.echo(report.error, err=True)
        failures += not report.ok
    return failures


def _compile_local(dims: list[int], dtypes: list[str], kinds, jobs: int = 1) -> int:
    from cuflash2.compiler import local_report
    from cuflash2.interop import import_cupy

    cp = import_cupy()
    if not cp.cuda.is_available():
        raise click.UsageError("no GPU found: pass --arch (e.g. --arch sm_80,sm_90) to compile without one")
    device = cp.cuda.Device()
    arch = int(device.compute_capability)
    failures = 0
    for line, ok in _run_all(local_report, [(c, device.id) for c in _configs(arch, dims, dtypes, kinds)], jobs):
        click.echo(line)
        failures += not ok
    return failures


main.add_command(info_command)
main.add_command(check_command)
main.add_command(bench_command)


if __name__ == "__main__":
    main()
