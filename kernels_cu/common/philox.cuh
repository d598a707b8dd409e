// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a counter-based
// generator, so any thread can draw the random numbers of any (counter, key) directly, and the
// backward pass regenerates exactly the forward's dropout mask whatever its tile shapes.
#pragma once
#include "common/ptx.cuh"

struct Philox4 {
    u32 x[4];
};

CF_DEVICE Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
    const u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
        const u32 hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
    }
    return Philox4{{c0, c1, c2, c3}};
}

// Dropout mask of attention. Entry (row, col) of head bh = batch * nheads + head draws a 16-bit
// number and is kept iff it is >= drop_threshold (the drop probability is drop_threshold / 65536,
// within 2^-17 of the requested one). One Philox call yields eight 16-bit numbers: those of the
// keys col = 32 g + 8 t + 2 j + e (t = 0..3, e = 0..1) of one row, for fixed g = col / 32 and
// j = (col / 2) % 4. That grouping is a function of (row, col) alone, so any kernel layout draws
// the same mask. It was chosen for the m16n8k16 accumulator, where one lane holds exactly those
// columns of a row across four consecutive 8-column tiles, so a row-major fragment needs one call
// per eight entries (and a transposed one, holding keys lane / 4 + 8 h, one per four: the fragment
// walks are in mma_sync/score_ops.cuh).
struct Dropout {
    u32 seed_lo, seed_hi, offset;
    u32 drop_threshold;  // 0: off

    CF_DEVICE bool active() const { return drop_threshold != 0; }
    // The Philox block deciding entry (row, col).
    CF_DEVICE Philox4 block(int row, int col, int bh) const {
        const u32 group = ((u32)col >> 5) * 4u + (((u32)col >> 1) & 3u);
        return philox4x32_10(group, (u32)row, (u32)bh, offset, seed_lo, seed_hi);
    }
    // Which of the block's eight numbers belongs to column col: (col / 8) % 4 * 2 + col % 2.
    static CF_DEVICE int slot_of(int col) { return ((col >> 3) & 3) * 2 + (col & 1); }
    // Number `slot` (0..7) of the block. Callers pass slots known at compile time where they can:
    // indexing r.x with a run-time value would put the block in local memory, so it is selected.
    static CF_DEVICE u32 number(const Philox4& r, int slot) {
        const u32 word = slot < 4 ? (slot < 2 ? r.x[0] : r.x[1]) : (slot < 6 ? r.x[2] : r.x[3]);
        return (word >> (16 * (slot & 1))) & 0xffffu;
    }
    CF_DEVICE bool keep(const Philox4& r, int slot) const { return number(r, slot) >= drop_threshold; }
    // Whether entry (row, col) of head bh survives: the decision every layout must reproduce (kernels
    // draw one block for all the entries of a lane that share it instead).
    CF_DEVICE bool keeps(int row, int col, int bh) const { return keep(block(row, col, bh), slot_of(col)); }
};
