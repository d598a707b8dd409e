// Warp-level tensor-core GEMMs on m16n8k16 fragments (coordinates: mma_sync/fragment.cuh).
// Accumulators use the MMA "C" layout: acc[mt][nt][0..3] holds rows (lane/4, lane/4 + 8) x columns
// (2*(lane%4), +1) of tile (mt, nt). Operands come from swizzled shared memory through an LdsmCursor,
// or (for A) from registers.
#pragma once
#include "common/ptx.cuh"
#include "mma_sync/mma.cuh"
#include "mma_sync/fragment.cuh"
#include "mma_sync/swizzled_tile.cuh"

// Operand cursors (mma_sync/fragment.cuh: ldmatrix x4 addressing), rows from first_row of a tile:
//   A, or B read through ldmatrix.trans:    LdsmCursor(tile, first_row + ldsm_a_row(lane), ldsm_a_chunk(lane))
//   B^T, or A^T read through ldmatrix.trans: LdsmCursor(tile, first_row + ldsm_bt_row(lane), ldsm_bt_chunk(lane))
// (The row sums are written out where the cursor is made: inside a helper taking first_row as an
// argument, the compiler orders the add's operands the other way round. Cursors whose B^T rows
// start at a run-time row keep first_row + (lane / 16) * 8 + lane % 8 in that association.)

// acc[MT][NT] += A * B^T with A (MT*16 x KSteps*16) and B (NT*8 x KSteps*16) both row-major in smem.
template <class T, int MT, int NT, int KSteps, class ATile, class BTile>
CF_DEVICE void gemm_abt(float (&acc)[MT][NT][4], const LdsmCursor<ATile>& a_cur, const LdsmCursor<BTile>& b_cur) {
    static_assert(NT % 2 == 0, "B tiles are loaded in pairs");
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a_cur.at(mt * 16, 2 * ks), a[mt]);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];  // {b0, b1} of tile 2np, then of tile 2np + 1
            ldmatrix_x4(b_cur.at(np * 16, 2 * ks), b);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_m16n8k16<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma_m16n8k16<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// One k-step of acc[MT][NT] += A * B for A fragments in registers and B (16 x NT*8, row-major in
// smem, rows from 16 * ks, columns from chunk b_chunk0) read with ldmatrix.trans. Tile pair np of B
// starts kPairStride chunks after pair np - 1 (2: adjacent; more: ColumnShare's interleaved shares).
template <class T, int kPairStride = 2, int MT, int NT, class BTile>
CF_DEVICE void mma_row_major_b(float (&acc)[MT][NT][4], const u32 (&a)[MT][4], const LdsmCursor<BTile>& b_cur,
                               int ks, int b_chunk0) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        u32 b[4];  // {b0, b1} of tile 2np, then of tile 2np + 1
        ldmatrix_x4_trans(b_cur.at(ks * 16, b_chunk0 + kPairStride * np), b);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma_m16n8k16<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
            mma_m16n8k16<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
    }
}

// acc[MT][NT] += A * B with A in registers (fp32 accumulators, MT x KT 8-wide tiles, rounded to T)
// and B (KT*8 x NT*8) row-major in smem, read with ldmatrix.trans. B columns start at chunk b_chunk0.
template <class T, int MT, int KT, int NT, class BTile>
CF_DEVICE void gemm_rs(float (&acc)[MT][NT][4], const float (&a_acc)[MT][KT][4], const LdsmCursor<BTile>& b_cur,
                       int b_chunk0 = 0) {
    static_assert(KT % 2 == 0 && NT % 2 == 0, "tiles come in pairs");
#pragma unroll
    for (int ks = 0; ks < KT / 2; ++ks) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a_frag<T, KT>(a[mt], a_acc[mt], ks);
        mma_row_major_b<T>(acc, a, b_cur, ks, b_chunk0);
    }
}

// acc[MT][NT] += A * B with A (MT*16 x KSteps*16) row-major in smem and B (KSteps*16 x NT*8) row-major
// in smem, read with ldmatrix.trans from column chunk b_chunk0 (pairs kPairStride chunks apart).
template <class T, int MT, int NT, int KSteps, int kPairStride = 2, class ATile, class BTile>
CF_DEVICE void gemm_ab(float (&acc)[MT][NT][4], const LdsmCursor<ATile>& a_cur, const LdsmCursor<BTile>& b_cur,
                       int b_chunk0) {
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a_cur.at(mt * 16, 2 * ks), a[mt]);
        mma_row_major_b<T, kPairStride>(acc, a, b_cur, ks, b_chunk0);
    }
}

// acc[MT][NT] += A * B with A^T (KSteps*16 x MT*16) and B (KSteps*16 x NT*8) row-major in smem, both
// read with ldmatrix.trans. A rows start at a_chunk0 (in 8-column chunks), B columns at b_chunk0
// (pairs kPairStride chunks apart).
template <class T, int MT, int NT, int KSteps, int kPairStride = 2, class ATile, class BTile>
CF_DEVICE void gemm_atb(float (&acc)[MT][NT][4], const LdsmCursor<ATile>& at_cur, int a_chunk0,
                        const LdsmCursor<BTile>& b_cur, int b_chunk0) {
#pragma unroll
    for (int ks = 0; ks < KSteps; ++ks) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 r[4];  // matrices: (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
            ldmatrix_x4_trans(at_cur.at(ks * 16, a_chunk0 + 2 * mt), r);
            a[mt][0] = r[0]; a[mt][1] = r[1]; a[mt][2] = r[2]; a[mt][3] = r[3];
        }
        mma_row_major_b<T, kPairStride>(acc, a, b_cur, ks, b_chunk0);
    }
}
