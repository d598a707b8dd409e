"""Errors at the edges (no CuPy, no NVRTC, no GPU) as one `Error: ...` line naming the fix.

Every command runs inside `main`, whose group turns these exceptions into a click.ClickException
(printed as `Error: <message>`, exit code 1) instead of a traceback. Anything else is a bug and
still raises.
"""

from __future__ import annotations

import importlib.metadata

import click

# Runnable from a checkout (the package is not on an index yet) and, for the CuPy/NVRTC wheels
# themselves, from anywhere.
EXTRA_HINT = ("run pip install '.[cuda12]' in the cuflash2 checkout (CUDA 12 driver), "
              "or pip install '.[cuda13]' (CUDA 13 driver)")
NVRTC_WHEELS = {12: "nvidia-cuda-nvrtc-cu12", 13: "'nvidia-cuda-nvrtc>=13,<14'"}


def cupy_cuda_major() -> int | None:
    """12 or 13 from the installed CuPy wheel's name (cupy-cuda12x, cupy-cuda13x), else None."""
    for major in (13, 12):
        try:
            importlib.metadata.version(f"cupy-cuda{major}x")
            return major
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cupy_missing() -> str:
    return f"CuPy is not installed: {EXTRA_HINT}"


def nvrtc_missing(detail: str = "") -> str:
    major = cupy_cuda_major()
    if major in NVRTC_WHEELS:
        fix = (f"run pip install '.[cuda{major}]' in the cuflash2 checkout, "
               f"or pip install {NVRTC_WHEELS[major]}")
        what = f"NVRTC {major} (libnvrtc.so.{major})"
    else:
        fix, what = EXTRA_HINT, "NVRTC (libnvrtc.so)"
    detail = f" ({_first_line(detail)})" if detail else ""
    return f"{what} was not found{detail}: {fix}"


def no_gpu(command: str, reason: str) -> str:
    hint = {"compile": "pass --arch (e.g. --arch sm_80,sm_90) to compile without one",
            "bench": "run it on a machine with an NVIDIA GPU (`cuflash2 info` shows what was found)"}
    return (f"`cuflash2 {command}` needs a CUDA GPU: {reason}; "
            f"{hint.get(command, 'run `cuflash2 info` to see what was found')}")


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def explain(exc: BaseException, command: str = "") -> str | None:
    """The one-line message for an edge error, or None for anything else."""
    for e in _chain(exc):
        name, text = type(e).__name__, str(e)
        if isinstance(e, ImportError) and (e.name or "").split(".")[0] in ("cupy", "cupy_backends"):
            return cupy_missing()
        if isinstance(e, RuntimeError) and text.startswith(("CuPy is not installed", "cuflash2 needs CuPy")):
            return cupy_missing()
        lowered = text.lower()
        if name == "DynamicLibNotFoundError" or ("nvrtc" in lowered and any(
                s in lowered for s in ("not found", "failed to load", "cannot open", "no such file",
                                       "could not find", "failure finding"))):
            return nvrtc_missing(text)
        if name == "CUDARuntimeError" and any(s in text for s in (
                "cudaErrorNoDevice", "cudaErrorInsufficientDriver", "cudaErrorInvalidDevice")):
            return no_gpu(command or "this command", text)
    return None


class EdgeErrorGroup(click.Group):
    """A click group whose commands report edge errors as `Error: ...` (exit 1), not tracebacks."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            message = explain(exc, ctx.invoked_subcommand or "")
            if message is None:
                raise
            raise click.ClickException(message) from exc
