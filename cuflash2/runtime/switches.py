"""On/off environment switches (CUFLASH2_HANG_CHECK, CUFLASH2_ZERO_TMA_SCRATCH, CUFLASH2_CHECK_KVCACHE):
on unless unset, empty or "0"."""

from __future__ import annotations

import os


def switch_on(variable: str) -> bool:
    """Whether the environment variable `variable` is set to something other than "" or "0"."""
    return os.environ.get(variable, "") not in ("", "0")


__all__ = ["switch_on"]
