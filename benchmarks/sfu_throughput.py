"""Cycles per warp instruction of the softmax's special-function and conversion instructions on an sm_90 GPU.

The forward's softmax takes one exp2 per score (MUFU.EX2) and packs P to 16 bits (F2FP). This times
each instruction alone and in the mixes the softmax issues, with two warps on each SM sub-partition
(so that the pipe, not one warp's issue, is the limit): independent instructions in inline PTX, in
a loop of 4,096 iterations, cycles from clock64, the median over the warps of one block per SM.
Two instructions on different pipes take the time of the slower one together; on the same pipe,
the sum. Needs CuPy and an sm_90 GPU:

    python benchmarks/sfu_throughput.py
"""

import cupy as cp
import numpy as np

# One flag per instruction family; a mode is a set of flags, each family issued per iteration as
# independent instructions (no chain from one to the next within the iteration).
EX2_F32, CVT_BF16X2, CVT_F16X2, EX2_F16X2, FFMA = 1, 2, 4, 8, 16
SOURCE = r"""
extern "C" __global__ void pipes(float* sink, long long* cycles, int iters, int mode) {
    float x[16];
    unsigned h[16];
    for (int i = 0; i < 16; ++i) {
        x[i] = -0.001f * (threadIdx.x + i);
        h[i] = 0x3c003c00u + i;
    }
    __syncthreads();
    const long long start = clock64();
    for (int it = 0; it < iters; ++it) {
        if (mode & 1) {
#pragma unroll
            for (int i = 0; i < 16; ++i) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[i]));
        }
        if (mode & 2) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned r;
                asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x[2 * i]), "f"(x[2 * i + 1]));
                h[i] ^= r;
            }
        }
        if (mode & 4) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned r;
                asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x[2 * i]), "f"(x[2 * i + 1]));
                h[8 + i] ^= r;
            }
        }
        if (mode & 8) {
#pragma unroll
            for (int i = 0; i < 8; ++i) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(h[i]));
        }
        if (mode & 16) {
#pragma unroll
            for (int i = 0; i < 16; ++i) asm volatile("fma.rn.ftz.f32 %0, %0, 0f3F7FBE77, 0fBA83126F;" : "+f"(x[i]));
        }
    }
    const long long stop = clock64();
    float s = 0.f;
    unsigned u = 0;
    for (int i = 0; i < 16; ++i) {
        s += x[i];
        u ^= h[i];
    }
    sink[blockIdx.x * blockDim.x + threadIdx.x] = s + (float)(u & 1);  // keeps every result live
    if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = stop - start;
}
"""
# Instructions per iteration of each family.
PER_ITERATION = {EX2_F32: 16, CVT_BF16X2: 8, CVT_F16X2: 8, EX2_F16X2: 8, FFMA: 16}
MODES = [
    ("ex2.approx.f32", EX2_F32),
    ("cvt.rn.bf16x2.f32", CVT_BF16X2),
    ("cvt.rn.f16x2.f32", CVT_F16X2),
    ("ex2.approx.f16x2", EX2_F16X2),
    ("fma.rn.f32", FFMA),
    ("ex2.f32 + cvt.bf16x2", EX2_F32 | CVT_BF16X2),
    ("ex2.f32 + cvt.f16x2", EX2_F32 | CVT_F16X2),
    ("ex2.f32 + fma", EX2_F32 | FFMA),
    ("cvt.f16x2 + ex2.f16x2", CVT_F16X2 | EX2_F16X2),
]
ITERATIONS = 4096
WARPS_PER_SUBPARTITION = 2


def main() -> None:
    device = cp.cuda.Device()
    sms = device.attributes["MultiProcessorCount"]
    major, minor = device.compute_capability[0], device.compute_capability[1:]
    kernel = cp.RawModule(code=SOURCE, options=(f"-arch=sm_{major}{minor}",)).get_function("pipes")
    warps = 4 * WARPS_PER_SUBPARTITION
    sink = cp.zeros(sms * 32 * warps, cp.float32)
    cycles = cp.zeros(sms * warps, cp.int64)
    print(f"{WARPS_PER_SUBPARTITION} warps per SM sub-partition, {ITERATIONS} iterations, {sms} blocks")
    print(f"{'instructions':24s} {'cycles/iteration':>17s} {'instructions/iteration':>23s} {'cycles/instruction':>19s}")
    for name, mode in MODES:
        for _ in range(2):  # the first launch warms up
            kernel((sms,), (32 * warps,), (sink, cycles, np.int32(ITERATIONS), np.int32(mode)))
        cp.cuda.runtime.deviceSynchronize()
        per_iteration = float(cp.median(cycles.astype(cp.float64))) / ITERATIONS
        issued = WARPS_PER_SUBPARTITION * sum(n for flag, n in PER_ITERATION.items() if mode & flag)
        print(f"{name:24s} {per_iteration:17.1f} {issued:23d} {per_iteration / issued:19.2f}")


if __name__ == "__main__":
    main()
