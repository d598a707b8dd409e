"""Click callbacks shared by the commands: comma lists parsed and checked before any GPU work."""

from __future__ import annotations

import click

from cuflash2.families import mma_sync as cfg

COMPARE_CHOICES = ("torch-flash", "torch-cudnn", "torch-efficient")


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def parse_dtypes(ctx, param, value: str) -> list[str]:
    dtypes = _split(value)
    bad = [d for d in dtypes if d not in cfg.DTYPES]
    if bad or not dtypes:
        raise click.BadParameter(f"expected a comma list of {', '.join(cfg.DTYPES)}, got {value!r}")
    return list(dict.fromkeys(dtypes))


def parse_positive_ints(ctx, param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        numbers = [int(part) for part in _split(value)]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or any(n < 1 for n in numbers):
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return numbers


def parse_head_dims(ctx, param, value: str | None) -> list[int] | None:
    dims = parse_positive_ints(ctx, param, value)
    for dim in dims or ():
        if dim < 8 or dim > cfg.MAX_HEAD_DIM or dim % 8:
            raise click.BadParameter(f"expected multiples of 8 in [8, {cfg.MAX_HEAD_DIM}], got {dim}")
    return dims


def parse_compare(ctx, param, value: str | None) -> list[str]:
    names = _split(value)
    bad = [n for n in names if n not in COMPARE_CHOICES]
    if bad:
        raise click.BadParameter(f"unknown implementation {bad[0]!r}: expected a comma list of "
                                 f"{', '.join(COMPARE_CHOICES)}")
    return list(dict.fromkeys(names))


def positive_int(ctx, param, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"expected a positive integer, got {value}")
    return value
