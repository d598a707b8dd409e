// Global-memory accesses of one row piece at the call's vector width (kVecBytes, common/ptx.cuh),
// independent of any shared-memory or MMA layout.
#pragma once
#include "common/ptx.cuh"

// Rows that are only 8-, 4- or 2-byte aligned (a head dim of 100, 60 or 59 in a contiguous tensor)
// cannot take 16-byte accesses. The shared-memory layout stays the same: each 16-byte chunk holding
// columns [col, col + 8) of a row is filled by 16 / kVecBytes pieces. kVecBytes divides head_dim * 2,
// so each piece is wholly inside the row's head_dim columns (copied) or wholly past it (zero-filled,
// never read: the next row, or the end of the allocation, may start there).

// Chunk [col, col + 8) of a row whose source is `src` (column col); `fallback` is any valid address,
// handed to the zero-filling copies. Widths 8 and 4: cp.async pieces, asynchronous like the 16-byte
// path. Width 2 (cp.async has no 2-byte form): plain 16-bit loads into registers and one 16-byte
// shared store, synchronous; the kernels' cp.async waits and barriers order it all the same.
// (Templates on the width, so that the branches of other widths are never instantiated.)
template <int kBytes = kVecBytes>
CF_DEVICE void load_chunk_narrow(u32 dst, const u16* src, const u16* fallback, bool row_ok, int col, int valid_cols) {
    static_assert(kBytes < 16, "the 16-byte path copies whole chunks with cp_async_16");
    if constexpr (kBytes == 2) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 lo = row_ok && col + 2 * i < valid_cols ? src[2 * i] : 0u;
            const u32 hi = row_ok && col + 2 * i + 1 < valid_cols ? src[2 * i + 1] : 0u;
            w[i] = lo | (hi << 16);
        }
        st_shared_v4(dst, w[0], w[1], w[2], w[3]);
    } else {
        constexpr int kElems = kBytes / 2;
#pragma unroll
        for (int piece = 0; piece < 16 / kBytes; ++piece) {
            const bool ok = row_ok && col + piece * kElems < valid_cols;
            cp_async_narrow<kBytes>(dst + piece * kBytes, ok ? src + piece * kElems : fallback, ok);
        }
    }
}

// Chunk [col, col + 8) of a global row into registers with kVecBytes loads; columns >= valid_cols
// read as zero and are not touched.
template <int kBytes = kVecBytes>
CF_DEVICE Chunk16 load_chunk_global(const u16* src, int col, int valid_cols) {
    if constexpr (kBytes == 16) {
        return *reinterpret_cast<const Chunk16*>(src);
    } else {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (kBytes == 2) {
                const u32 lo = col + 2 * i < valid_cols ? src[2 * i] : 0u;
                const u32 hi = col + 2 * i + 1 < valid_cols ? src[2 * i + 1] : 0u;
                w[i] = lo | (hi << 16);
            } else {
                w[i] = col + 2 * i < valid_cols ? *reinterpret_cast<const u32*>(src + 2 * i) : 0u;
            }
        }
        return Chunk16{w[0], w[1], w[2], w[3]};
    }
}

// The first n = 2 * kWords columns [col, col + n) of a register run `w` (two elements a word) into a
// global row with kVecBytes stores (n * 2 bytes at once when the width allows), skipping columns >=
// valid_cols. col is a multiple of n, or of kVecBytes / 2 when smaller.
template <int kWords>
CF_DEVICE void store_run_global(u16* dst, const u32 (&w)[kWords], int col, int valid_cols) {
    constexpr int kBytes = 4 * kWords < kVecBytes ? 4 * kWords : kVecBytes;  // per store
    if constexpr (kBytes == 16) {
        if (col < valid_cols) *reinterpret_cast<Chunk16*>(dst) = Chunk16{w[0], w[1], w[2], w[3]};
    } else if constexpr (kBytes == 8) {
#pragma unroll
        for (int i = 0; i < kWords; i += 2)
            if (col + 2 * i < valid_cols) *reinterpret_cast<uint2*>(dst + 2 * i) = make_uint2(w[i], w[i + 1]);
    } else if constexpr (kBytes == 4) {
#pragma unroll
        for (int i = 0; i < kWords; ++i)
            if (col + 2 * i < valid_cols) *reinterpret_cast<u32*>(dst + 2 * i) = w[i];
    } else {
#pragma unroll
        for (int e = 0; e < 2 * kWords; ++e)
            if (col + e < valid_cols) dst[e] = (u16)(w[e / 2] >> (16 * (e % 2)));
    }
}

// Columns (col, col + 1) of a row (col even, < head_dim) as one packed register: a 4-byte store,
// or two 2-byte ones where rows are only 2-byte aligned, the second only inside head_dim (odd head
// dims). With kVecBytes >= 4 the head dim is even, so the pair is whole.
template <int kBytes = kVecBytes>
CF_DEVICE void store_pair_global(u16* dst, u32 packed, int col, int head_dim) {
    if constexpr (kBytes >= 4) {
        *reinterpret_cast<u32*>(dst) = packed;
    } else {
        dst[0] = (u16)(packed & 0xffff);
        if (col + 1 < head_dim) dst[1] = (u16)(packed >> 16);
    }
}

