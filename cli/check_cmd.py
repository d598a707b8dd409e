"""`cuflash2 check`: correctness sweep against an fp32 reference with FA2's tolerance rule."""

from __future__ import annotations

import math
import sys
import time

import click

from cuflash2 import checks

from . import gpu
from .options import parse_dtypes

BACKWARD_MISSING = "backward checks skipped: cuflash2.flash_attn_backward is not available in this version"


class ResultPrinter:
    """Prints result rows as they arrive, in columns sized up front."""

    NUM = 9

    def __init__(self, case_width: int):
        self.case_width = max(case_width, len("case"))
        self.header = (f"{'case':<{self.case_width}}  {'max err':>{self.NUM}}  {'naive err':>{self.NUM}}  "
                       f"{'ratio':>6}  {'limit':>5}  result")

    def start(self) -> None:
        click.echo(self.header)
        click.echo("-" * len(self.header))

    def row(self, r: checks.CheckResult) -> None:
        ratio = "-" if math.isnan(r.max_err) else ("inf" if math.isinf(r.ratio) else f"{r.ratio:.2f}")
        limit = f"{r.multiplier:g}x" if r.multiplier else "-"
        text = (f"{r.case_id:<{self.case_width}}  {_num(r.max_err):>{self.NUM}}  {_num(r.naive_err):>{self.NUM}}  "
                f"{ratio:>6}  {limit:>5}  {r.status}")
        click.echo(text + (f"  {r.note}" if r.note else ""))


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _plan(quick: bool, dtypes: list[str], pattern: str | None):
    """(xp, cases, skip_on) for this machine: the GPU sweep, or the NumPy path without a GPU."""
    backward = checks.has_backward()
    if not backward:
        click.echo(BACKWARD_MISSING)
    cp, reason = gpu.find_gpu()
    if cp is None:
        click.echo(f"GPU checks skipped: {reason}.")
        click.echo("Running the NumPy-path checks (CPU, small shapes) against the float64 reference instead.")
        import numpy as np

        # the CPU backward may not exist even where the GPU one does: that is a skip, not a failure
        xp, cases, skip_on = np, checks.numpy_cases(dtypes, backward), (NotImplementedError, TypeError)
    else:
        info = gpu.gpu_info(cp)
        click.echo(f"GPU checks on {info.name} ({info.arch}), {'quick' if quick else 'full'} sweep.")
        xp, cases, skip_on = cp, checks.gpu_cases(quick, dtypes, backward), ()
    if pattern:
        cases = [c for c in cases if pattern in c.case_id()]
    return xp, cases, skip_on


def _run(xp, cases, skip_on) -> list[checks.CheckResult]:
    suffix = max((4 if c.kind == "bwd" else 0 for c in cases), default=0)  # ":dq"
    printer = ResultPrinter(max((len(c.case_id()) for c in cases), default=4) + suffix)
    printer.start()
    results = []
    for case in cases:
        for result in checks.run_case(xp, case, skip_on if case.kind == "bwd" else ()):
            printer.row(result)
            results.append(result)
    return results


@click.command("check")
@click.option("--quick/--full", default=True, show_default=True,
              help="Quick sweep (under a minute on an H200) or every head dim and shape class.")
@click.option("--dtype", "dtypes", default="bf16,fp16", show_default=True, callback=parse_dtypes,
              metavar="DT[,DT...]", help="Comma-separated: bf16, fp16.")
@click.option("-k", "pattern", default=None, metavar="TEXT", help="Only the cases whose id contains this text.")
def check_command(quick: bool, dtypes: list[str], pattern: str | None) -> None:
    """Check correctness against an fp32 reference (FA2's tolerance rule).

    A case passes when its max error is at most 2x (forward) or 3x (gradients) the max error of the
    same computation done naively in the input precision, plus 1e-5 (for gradients: 1e-5 times the
    case's largest gradient). Exits 1 on any failure. Without a GPU, checks the NumPy path instead
    (and says so).
    """
    start = time.perf_counter()
    xp, cases, skip_on = _plan(quick, dtypes, pattern)
    if not cases:
        raise click.UsageError(f"no case matches -k {pattern!r}")
    results = _run(xp, cases, skip_on)
    failed = sum(r.status == "FAIL" for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    click.echo(f"\n{len(results) - failed - skipped} passed, {failed} failed, {skipped} skipped "
               f"in {time.perf_counter() - start:.1f} s")
    if failed:
        sys.exit(1)
