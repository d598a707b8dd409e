// Rows of an MMA accumulator regrouped across a quad for 16-byte stores, independent of the MMA
// instruction: in the m16n8 accumulator layout (mma.sync, and wgmma's per-warp rows) the four lanes
// of a quad hold one row, lane q = lane % 4 holding columns 2q and 2q + 1 of every 8-column group.
// Stored as is, a warp writes 8 rows of 16 bytes per instruction: half sectors, which the memory
// pipeline takes slowly. Transposed across the quad, lane q holds all 8 columns of one group, and
// a warp writes 8 rows of 64 contiguous bytes per 16-byte store.
#pragma once
#include "common/ptx.cuh"

// (a, b) -> (b, a) when `swap`, without indexing registers by a runtime value.
CF_DEVICE void swap_if(bool swap, u32& a, u32& b) {
    const u32 first = swap ? b : a;
    b = swap ? a : b;
    a = first;
}

// One 4 x 4 block of packed column pairs, transposed over the quad. On entry v[i] holds columns
// 8i + 2q and 8i + 2q + 1 (q = lane % 4) of four consecutive 8-column groups i; on exit v[c] holds
// columns 8q + 2c and 8q + 2c + 1: the 16 bytes of group q. Two exchanges of two values each.
CF_DEVICE void quad_transpose(u32 (&v)[4], int lane) {
    const bool high_pair = lane & 2, odd = lane & 1;
    // Lanes q and q ^ 2: the lower pair keeps groups 0-1 and hands over 2-3, the upper the reverse.
    // Then v[0], v[1] hold groups g, g + 1 (g = 2 * high_pair) at pair q, v[2], v[3] at pair q ^ 2.
    swap_if(high_pair, v[0], v[2]);
    swap_if(high_pair, v[1], v[3]);
    v[2] = shfl_xor_u32(v[2], 2);
    v[3] = shfl_xor_u32(v[3], 2);
    // Lanes q and q ^ 1: each keeps its own group g + odd and hands over the other. Then v[t] holds
    // pair q ^ t of group q.
    swap_if(odd, v[0], v[1]);
    swap_if(odd, v[2], v[3]);
    v[1] = shfl_xor_u32(v[1], 1);
    v[3] = shfl_xor_u32(v[3], 1);
    // v[c] <- v[c ^ q]: pairs in column order.
    swap_if(odd, v[0], v[1]);
    swap_if(odd, v[2], v[3]);
    swap_if(high_pair, v[0], v[2]);
    swap_if(high_pair, v[1], v[3]);
}
