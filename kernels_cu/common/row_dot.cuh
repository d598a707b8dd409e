// D = rowsum(dO * O) of one row, spread over 8 lanes: the per-row input of the backward kernels
// (flash_bwd_dot_do_o_kernel, and the Hopper backward's flash_bwd_rows_sm90).
#pragma once
#include "common/global_io.cuh"

// This lane's part of sum_c a[c] * b[c] over c < head_dim: 8-column chunks lane8 * 8 + 64 i with
// kVecBytes-wide loads (zeros past head_dim). The 8 lanes' parts add up with sum_over_8_lanes.
template <class T>
CF_DEVICE float row_dot_part(const u16* a, const u16* b, int lane8, int head_dim) {
    float acc = 0.f;
    for (int c = lane8 * 8; c < head_dim; c += 64) {
        Chunk16 x = load_chunk_global(a + c, c, head_dim);
        Chunk16 y = load_chunk_global(b + c, c, head_dim);
        const u16* xh = reinterpret_cast<const u16*>(&x);
        const u16* yh = reinterpret_cast<const u16*>(&y);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(T::to_float(xh[e]), T::to_float(yh[e]), acc);
    }
    return acc;
}

// The sum over each aligned group of 8 lanes (every lane of the warp takes part).
CF_DEVICE float sum_over_8_lanes(float x) {
    x += shfl_xor(x, 1);
    x += shfl_xor(x, 2);
    x += shfl_xor(x, 4);
    return x;
}
