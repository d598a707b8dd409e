// Division by a value fixed at launch, as a multiply-high, an add and a shift (Granlund and
// Montgomery's round-up method): an integer division by a runtime value costs about twenty
// instructions and a divergent fix-up, which per-tile index arithmetic pays several times over.
// The host picks the constants (cuflash2/runtime/fast_div.py: fast_divisor) and passes them in the
// launch parameters; the kernel then divides any 0 <= n < 2^31 exactly.
#pragma once
#include "common/ptx.cuh"

struct FastDiv {
    u32 mul;    // ceil(2^(32 + shift) / d) - 2^32, below 2^32
    u32 shift;  // ceil(log2 d)
    int d;      // the divisor itself, for remainders

    // n / d for 0 <= n < 2^31 (then the sum below stays under 2^32).
    CF_DEVICE int div(int n) const { return (int)((__umulhi((u32)n, mul) + (u32)n) >> shift); }
    // n = quotient * d + remainder.
    CF_DEVICE void divmod(int n, int& quotient, int& remainder) const {
        quotient = div(n);
        remainder = n - quotient * d;
    }
};
