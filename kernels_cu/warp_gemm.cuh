// Warp-level tensor-core GEMMs on m16n8k16 fragments. Accumulators use the MMA "C" layout:
// acc[mt][nt][0..3] holds rows (lane/4, lane/4 + 8) x columns (2*(lane%4), +1) of tile (mt, nt).
// Operands come from swizzled shared memory through an LdsmCursor, or (for A) from registers.
#pragma once
#include "ptx.cuh"
#include "smem_tile.cuh"

template <int MT, int NT>
CF_DEVICE void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
}

// Cursor roles. A row-major operand read as A (rows = M, contiguous = K):
//   LdsmCursor(tile, first_row + lane % 16, lane / 16)
// A row-major operand read as B^T (rows = N, contiguous = K), i.e. "A * B^T" products:
//   LdsmCursor(tile, (lane / 16) * 8 + lane % 8, (lane / 8) % 2)
// A row-major operand read as B (rows = K, contiguous = N), through ldmatrix.trans:
//   LdsmCursor(tile, lane % 16, lane / 16)
// A row-major operand holding A^T (rows = K, contiguous = M), through ldmatrix.trans:
//   LdsmCursor(tile, (lane / 16) * 8 + lane % 8, (lane / 8) % 2)

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
                T::mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                T::mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

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
// LdsmCursor "A" addressing): rows 0-7 and 8-15 of the first tile, then of the second.
struct FragPair {
    u32 r[4];
};
template <class T>
CF_DEVICE FragPair pack_tile_pair(const float (&c0)[4], const float (&c1)[4]) {
    return {{T::pack(c0[0], c0[1]), T::pack(c0[2], c0[3]), T::pack(c1[0], c1[1]), T::pack(c1[2], c1[3])}};
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
            T::mma(acc[mt][2 * np], a[mt], b[0], b[1]);
            T::mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
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
