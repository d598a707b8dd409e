"""Progress and the closing summary of `cuflash2 compile`.

On a terminal a bar on stderr (n/N, elapsed, ETA) is redrawn under the per-kernel lines; anywhere
else (a pipe, a log file, CI) only the plain per-kernel lines and the summary are printed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import click

BAR_WIDTH = 24


def is_terminal() -> bool:
    stream = sys.stderr
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def clock(seconds: float) -> str:
    """75 -> '1:15', 3725 -> '1:02:05'."""
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def bar_text(done: int, total: int, elapsed: float) -> str:
    filled = BAR_WIDTH * done // total if total else BAR_WIDTH
    eta = elapsed / done * (total - done) if done else None
    return (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:>{len(str(total))}}/{total}  "
            f"elapsed {clock(elapsed)}  ETA {clock(eta) if eta is not None else '?'}")


class Progress:
    """emit() one finished item's line; on a terminal the bar follows it."""

    def __init__(self, total: int, tty: bool | None = None):
        self.total, self.done = total, 0
        self.tty = is_terminal() if tty is None else tty
        self.start = time.monotonic()

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc) -> None:
        if self.tty:
            click.echo("\r\033[K", nl=False, err=True, color=True)

    def emit(self, line: str, detail: str = "") -> None:
        self.done += 1
        if self.tty:
            click.echo("\r\033[K", nl=False, err=True, color=True)
        click.echo(line)
        if detail:
            click.echo(detail, err=True)
        self._draw()

    def _draw(self) -> None:
        if self.tty:
            click.echo(bar_text(self.done, self.total, time.monotonic() - self.start), nl=False, err=True)


@dataclasses.dataclass
class CompileSummary:
    total: int
    jobs: int
    what: str
    cached: bool
    ok: int = 0
    failed: int = 0
    spills: int = 0
    start: float = dataclasses.field(default_factory=time.monotonic)

    def add(self, status: str) -> None:
        if status == "ok":
            self.ok += 1
        elif status == "SPILL":
            self.spills += 1
        else:
            self.failed += 1

    def line(self) -> str:
        where = "in the kernel cache" if self.cached else "checked, not cached"
        return (f"{self.ok + self.failed + self.spills}/{self.total} kernels for {self.what}: {self.ok} ok, "
                f"{self.failed} failed, {self.spills} spills (or stack frames) in "
                f"{time.monotonic() - self.start:.1f} s, {self.jobs} job{'s' if self.jobs != 1 else ''} "
                f"({where})")
