// Fragment coordinates of mma.sync m16n8k16 (mma_sync/mma.cuh): which rows and columns of a tile
// a lane's registers hold, row reductions over a quad, how accumulators become A operands, and the
// lane addressing of ldmatrix x4 for each operand role.
//
// Accumulator (C/D) of a 16 x 8 tile: 4 floats per lane. Register i holds row lane / 4 (i = 0, 1)
// or lane / 4 + 8 (i = 2, 3), column 2 (lane % 4) + i % 2. The four lanes of a quad (lane / 4
// equal) share rows; a row is spread over a quad, two adjacent columns a lane.
//
// The kernels' register walks (mma_sync/*.cu, score_ops.cuh, bwd_common.cuh) write these sums out
// inline, with the association and spelling they were tuned with (lane >> 2 where the lane id is
// opaque to the compiler): routed through the acc_* functions below, the same sums compiled to
// different PTX (operands of adds swapped, a different schedule in the dQ kernel), and a change
// that only reorganises source must leave the generated code identical (scripts/ptx_fingerprint.py).
#pragma once
#include "common/ptx.cuh"

// ---- accumulator coordinates ---------------------------------------------------------------------
// Offsets of the lane's registers from the tile's first row / the first column of a run of 8-column
// tiles; callers add where the tile starts.
// Row of accumulator register i of `lane`.
CF_DEVICE int acc_row(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
// Column of accumulator register i of `lane` in 8-column tile n.
CF_DEVICE int acc_col(int lane, int n, int i) { return n * 8 + (lane % 4) * 2 + (i & 1); }
// Registers 2 r and 2 r + 1 hold one row (r = 0: lane / 4, r = 1: lane / 4 + 8) and two adjacent
// columns, the first of which (in tile n) is acc_pair_col.
CF_DEVICE int acc_pair_row(int lane, int r) { return lane / 4 + 8 * r; }
CF_DEVICE int acc_pair_col(int lane, int n) { return n * 8 + (lane % 4) * 2; }

template <int MT, int NT>
CF_DEVICE void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
}

// ---- row reductions over a quad ------------------------------------------------------------------
// A row of an accumulator tile lives in the four lanes of a quad: two xor-shuffles reduce it.
CF_DEVICE float quad_max(float x) {
    x = fmaxf(x, shfl_xor(x, 1));
    x = fmaxf(x, shfl_xor(x, 2));
    return x;
}
CF_DEVICE float quad_sum(float x) {
    x += shfl_xor(x, 1);
    x += shfl_xor(x, 2);
    return x;
}

// ---- accumulators as 16-bit operands -------------------------------------------------------------
// Converts fp32 accumulators of two adjacent 8-column tiles into one 16-wide A fragment: the C
// layout of tiles (2ks, 2ks+1) is exactly the A layout of k-step ks, so no data moves between lanes.
template <class T, int KT>
CF_DEVICE void acc_to_a_frag(u32 (&a)[4], const float (&c)[KT][4], int ks) {
    a[0] = T::pack(c[2 * ks][0], c[2 * ks][1]);
    a[1] = T::pack(c[2 * ks][2], c[2 * ks][3]);
    a[2] = T::pack(c[2 * ks + 1][0], c[2 * ks + 1][1]);
    a[3] = T::pack(c[2 * ks + 1][2], c[2 * ks + 1][3]);
}

// Two adjacent 8-column accumulator tiles as the four registers of stmatrix_x4 / ldmatrix_x4 (the
// "A" addressing below): rows 0-7 and 8-15 of the first tile, then of the second.
struct FragPair {
    u32 r[4];
};
template <class T>
CF_DEVICE FragPair pack_tile_pair(const float (&c0)[4], const float (&c1)[4]) {
    return {{T::pack(c0[0], c0[1]), T::pack(c0[2], c0[3]), T::pack(c1[0], c1[1]), T::pack(c1[2], c1[3])}};
}

// ---- ldmatrix x4 addressing: the row and chunk parity each lane supplies ---------------------------
// "A" addressing, a 16 x 16 block as matrices (rows 0-7, chunk 0), (rows 8-15, chunk 0), (rows 0-7,
// chunk 1), (rows 8-15, chunk 1): an A operand (rows = M, contiguous = K), or a B operand read with
// ldmatrix.trans (rows = K, contiguous = N).
CF_DEVICE int ldsm_a_row(int lane) { return lane % 16; }
CF_DEVICE int ldsm_a_chunk(int lane) { return lane / 16; }
// "B^T" addressing, two 8-row tiles: matrices (rows 0-7, chunk 0), (rows 0-7, chunk 1), (rows 8-15,
// chunk 0), (rows 8-15, chunk 1): the {b0, b1} of two 8-column B tiles stored as B^T (rows = N,
// contiguous = K), or an A operand stored as A^T (rows = K, contiguous = M) read with ldmatrix.trans.
CF_DEVICE int ldsm_bt_row(int lane) { return (lane / 16) * 8 + lane % 8; }
CF_DEVICE int ldsm_bt_chunk(int lane) { return (lane / 8) % 2; }

// The first lane of its quad: one lane per accumulator row (row-wide values after quad_sum).
CF_DEVICE bool quad_leader(int lane) { return lane % 4 == 0; }
