"""Launch constants that let a kernel divide by a runtime value with a multiply-high and a shift
(kernels_cu/common/fast_div.cuh: FastDiv)."""

from __future__ import annotations

import struct

#: FastDiv's layout: mul, shift, divisor.
LAYOUT = struct.Struct("<IIi")
MAX_DIVIDEND = 2 ** 31 - 1


def fast_divisor(d: int) -> tuple[int, int, int]:
    """(mul, shift, d) with n // d == (((n * mul) >> 32) + n) >> shift for 0 <= n < 2^31."""
    if not 1 <= d <= MAX_DIVIDEND:
        raise ValueError(f"fast_divisor: divisor must be in [1, 2^31), got {d}")
    shift = (d - 1).bit_length()  # ceil(log2 d)
    mul = ((1 << (32 + shift)) + d - 1) // d - (1 << 32)  # ceil(2^(32+shift) / d) - 2^32
    return mul, shift, d

