"""On/off environment switches (CUFLASH2_HANG_CHECK, CUFLASH2_ZERO_TMA_SCRATCH, CUFLASH2_CHECK_KVCACHE):
on unless unset, empty or "0"; and three-way ones (CUFLASH2_SPLIT_TAIL): forced on, forced off, or
left to the library."""

from __future__ import annotations

import os


def switch_on(variable: str) -> bool:
    """Whether the environment variable `variable` is set to something other than "" or "0"."""
    return os.environ.get(variable, "") not in ("", "0")


def switch_setting(variable: str) -> bool | None:
    """None when the environment variable `variable` is unset or empty (the library decides), else
    whether it is something other than "0"."""
    value = os.environ.get(variable, "")
    return None if value == "" else value != "0"


__all__ = ["switch_on", "switch_setting"]
