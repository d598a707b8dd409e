// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a counter-based
// generator, so any thread can draw the random numbers of any (counter, key) directly, and the
// backward pass regenerates exactly the forward's dropout mask whatever its tile shapes.
#pragma once
#include "ptx.cuh"

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

// Dropout mask of attention: entry (row, col) of head bh = batch * nheads + head is kept iff byte
// col % 16 of philox(counter = (col / 16, row, bh, offset), key = seed) is >= drop_threshold (the
// drop probability is drop_threshold / 256). One Philox call covers 16 consecutive keys of a row.
struct Dropout {
    u32 seed_lo, seed_hi, offset;
    u32 drop_threshold;  // 0: off

    CF_DEVICE bool active() const { return drop_threshold != 0; }
    CF_DEVICE Philox4 bytes16(int row, int key_group, int bh) const {
        return philox4x32_10((u32)key_group, (u32)row, (u32)bh, offset, seed_lo, seed_hi);
    }
    // Byte i (0..15) of the block. The index depends on the lane, so the word is picked with
    // selects: indexing r.x with it would put the block in local memory.
    static CF_DEVICE u32 byte_of(const Philox4& r, int i) {
        const u32 word = i < 8 ? (i < 4 ? r.x[0] : r.x[1]) : (i < 12 ? r.x[2] : r.x[3]);
        return (word >> (8 * (i & 3))) & 0xffu;
    }
    CF_DEVICE bool keep(const Philox4& r, int i) const { return byte_of(r, i) >= drop_threshold; }
};
