// The mma.sync tensor-core instruction of the m16n8k16 family, fp32 accumulation, per element type.
// D = A * B + D. A: 16x16 row-major fragment (4 regs), B: 16x8 column-major fragment (2 regs),
// D: 16x8 accumulator (4 floats); fragment coordinates: mma_sync/fragment.cuh.
#pragma once
#include "common/ptx.cuh"

template <class T>
CF_DEVICE void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
CF_DEVICE void mma_m16n8k16<Bf16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
CF_DEVICE void mma_m16n8k16<Fp16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
