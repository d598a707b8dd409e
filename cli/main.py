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
@click.option("--head-dims", default=None, help="Comma-separated head dims (default: every bucket).")
@click.option("--dtypes", default="bf16,fp16", show_default=True, help="Comma-separated: bf16, fp16.")
@click.option("--kernels", type=click.Choice(["all", "fwd", "bwd"]), default="all", show_default=True,
              help="Forward, backward, or both kernel families.")
def compile_command(arch: str | None, head_dims: str | None, dtypes: str, kernels: str) -> None:
    """Compile every kernel instantiation; report registers, smem, stack and spills."""
    dims = _parse_int_list(head_dims, "--head-dims") or list(cfg.HEAD_DIM_BUCKETS)
    dtype_list = [d.strip() for d in dtypes.split(",") if d.strip()]
    for d in dtype_list:
        if d not in cfg.DTYPES:
            raise click.BadParameter(f"expected bf16 or fp16, got {d!r}", param_hint="--dtypes")
    for dim in dims:
        if dim < 8 or dim > cfg.MAX_HEAD_DIM or dim % 8:
            raise click.BadParameter(f"expected multiples of 8 in [8, 256], got {dim}", param_hint="--head-dims")
    kinds = ("fwd", "bwd") if kernels == "all" else (kernels,)
    if arch is None:
        failures = _compile_local(dims, dtype_list, kinds)
    else:
        failures = _compile_offline(_parse_archs(arch), dims, dtype_list, kinds)
    if failures:
        click.echo(f"{failures} kernel(s) failed (compile error, spill or stack frame)", err=True)
        sys.exit(1)


def _configs(arch: int, dims: list[int], dtypes: list[str], kinds: tuple[str, ...] = ("fwd", "bwd")
             ) -> list[cfg.KernelConfig]:
    """Every instantiation the library can launch for these head dims and dtypes on `arch`."""
    unique: dict[cfg.KernelConfig, None] = {}
    for dim in dims:
        for dtype in dtypes:
            for causal in (False, True):
                if "fwd" in kinds:
                    unique[cfg.forward_config(dim, dtype, causal, arch)] = None
                if "bwd" in kinds:
                    for atomic_dq in (False, True):
                        for gqa in (False, True):
                            plan = cfg.backward_plan(dim, dtype, causal, arch, gqa=gqa, atomic_dq=atomic_dq)
                            unique.update(dict.fromkeys(plan.kernels()))
    return sorted(unique, key=lambda c: c.short_id())


def _compile_offline(archs: list[int], dims: list[int], dtypes: list[str], kinds) -> int:
    from cuflash2.compiler import compile_offline

    failures = 0
    for arch in archs:
        for config in _configs(arch, dims, dtypes, kinds):
            report = compile_offline(config, f"sm_{arch}")
            click.echo(report.line())
            if report.error:
                click.echo(report.error, err=True)
            failures += not report.ok
    return failures


def _compile_local(dims: list[int], dtypes: list[str], kinds) -> int:
    import time

    from cuflash2.compiler import get_kernel
    from cuflash2.interop import import_cupy

    cp = import_cupy()
    if not cp.cuda.is_available():
        raise click.UsageError("no GPU found: pass --arch (e.g. --arch sm_80,sm_90) to compile without one")
    device = cp.cuda.Device()
    arch = int(device.compute_capability)
    failures = 0
    for config in _configs(arch, dims, dtypes, kinds):
        start = time.perf_counter()
        try:
            kernel = get_kernel(config, device.id)
            attrs = kernel.attributes
            click.echo(f"ok    sm_{arch} {config.short_id():44s} regs={attrs['num_regs']:3d} "
                       f"smem={config.smem_bytes:6d} local={attrs['local_size_bytes']} "
                       f"({time.perf_counter() - start:.1f}s)")
            failures += attrs["local_size_bytes"] > 0
        except Exception as exc:  # report and go on: one bad kernel should not hide the others
            click.echo(f"ERROR sm_{arch} {config.short_id()}: {exc}")
            failures += 1
    return failures


main.add_command(info_command)
main.add_command(check_command)
main.add_command(bench_command)


if __name__ == "__main__":
    main()
