// Shared by the two dK/dV backward kernels (mma_sync/flash_bwd.cu, mma_sync/flash_bwd_fused.cu): their argument list
// (the host launches either with the same arguments; nheads serves the grouped grid order of causal
// fused grids, BlockGrid in common/block_mask.cuh), the load of one query block's stage and the
// store of dK/dV accumulator rows.
#pragma once
#include "common/ptx.cuh"
#include "mma_sync/swizzled_tile.cuh"
#include "mma_sync/tile_copy.cuh"
#include "common/variant.cuh"
#include "mma_sync/warp_gemm.cuh"

#define CF_BWD_MAIN_PARAMS                                                                                   \
    const u16 *__restrict__ q, const u16 *__restrict__ k, const u16 *__restrict__ v,                        \
        const u16 *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ delta,       \
        float *__restrict__ dq_accum, void *__restrict__ dk, void *__restrict__ dv, i64 q_batch_stride,     \
        i64 q_row_stride, i64 q_head_stride, i64 k_batch_stride, i64 k_row_stride, i64 k_head_stride,       \
        i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride, i64 do_batch_stride, i64 do_row_stride,    \
        i64 do_head_stride, i64 dk_batch_stride, i64 dk_row_stride, i64 dk_head_stride, i64 dv_batch_stride, \
        i64 dv_row_stride, i64 dv_head_stride, int seqlen_q, int seqlen_k, int head_dim, int kv_group,     \
        float scale_log2, float softmax_scale, CF_VARIANT_PARAMS, int nheads

// Rows (row0 + mt * 16 + lane / 4 (+8)) x columns (col0 + 8 * chunk(nt) + 2 * (lane % 4)) of a kMT x
// kTiles block of MMA accumulator fragments, scaled, stored as T (16-bit, with row stride) or as fp32
// (GQA: a contiguous (batch, seqlen_k, nheads, fp32_cols(head_dim)) buffer summed over each group
// later; its rows are padded to whole pairs, so the fp32 pairs need no check of col + 1).
// chunk(nt): tile pairs kPairStride chunks apart (2: adjacent tiles; see ColumnShare). Rows past
// valid_rows and columns past head_dim are not stored.
template <class T, bool kFloatOut, int kPairStride = 2, int kMT, int kTiles>
CF_DEVICE void store_fragment_rows(const float (&acc)[kMT][kTiles][4], void* out, i64 row_stride, int row0,
                                   int valid_rows, int col0, int head_dim, float scale, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + lane / 4 + 8 * r;
            if (row >= valid_rows) continue;
#pragma unroll
            for (int nt = 0; nt < kTiles; ++nt) {
                const int col = col0 + ((nt / 2) * kPairStride + nt % 2) * 8 + (lane % 4) * 2;
                if (col >= head_dim) continue;
                const float x = acc[mt][nt][2 * r] * scale, y = acc[mt][nt][2 * r + 1] * scale;
                if (kFloatOut) {
                    *reinterpret_cast<float2*>(static_cast<float*>(out) + row * row_stride + col) = make_float2(x, y);
                } else {
                    const u32 packed = T::pack(x, y);  // (before the address, as the plain store evaluates it)
                    store_pair_global(static_cast<u16*>(out) + row * row_stride + col, packed, col, head_dim);
                }
            }
        }
}

// A warp's 32-row accumulator block (2 x kTiles 16x8 fragments: rows row0 + [0, 32), the columns of
// share `share` of a ColumnShare `Cols`) scaled, rounded to T and written into a swizzled shared tile
// with stmatrix, for a block-wide 16-byte store afterwards (store_tile).
template <class T, class Tile, class Cols, int kTiles>
CF_DEVICE void stage_fragments(u32 tile, const float (&acc)[2][kTiles][4], int row0, int share, float scale,
                               int lane) {
    const OffsetCursor<Tile> cur = Cols::cursor(LdsmCursor<Tile>(tile, row0 + ldsm_a_row(lane), ldsm_a_chunk(lane)), share);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int np = 0; np < kTiles / 2; ++np) {
            float lo[4], hi[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) lo[i] = acc[mt][2 * np][i] * scale, hi[i] = acc[mt][2 * np + 1][i] * scale;
            stmatrix_x4(cur.cursor.at(mt * 16, cur.chunk0 + Cols::kPairStride * np), pack_tile_pair<T>(lo, hi).r);
        }
}

// Half of one query block's stage: the rows [row0, row0 + kBlockM) of Q or dO into `tile`
// (zero-filled from rows_left on) and the block's LSE or D values (fp32, kBlockM) into `values`.
template <int kBlockM, int kThreads, class QLoader>
CF_DEVICE void load_query_half(u32 tile, u32 values, const QLoader& loader, const u16* rows, const float* values_head,
                               int row0, int rows_left, int head_dim, int tid) {
    loader.load(tile, rows, rows_left, head_dim);
    for (int row = tid; row < kBlockM; row += kThreads)
        cp_async_4(values + row * 4, row < rows_left ? values_head + row0 + row : values_head, row < rows_left);
}

// One query block's stage: Q and dO rows [row0, row0 + kBlockM) (zero-filled from rows_left on),
// then the block's LSE and D values (fp32, kBlockM each) right after the two tiles.
template <class QTile, int kBlockM, int kThreads, class QLoader>
CF_DEVICE void load_query_stage(u32 stage, const QLoader& q_loader, const QLoader& do_loader, const u16* q_rows,
                                const u16* do_rows, const float* lse_head, const float* delta_head, int row0,
                                int rows_left, int head_dim, int tid) {
    q_loader.load(stage, q_rows, rows_left, head_dim);
    do_loader.load(stage + QTile::kBytes, do_rows, rows_left, head_dim);
    for (int i = tid; i < 2 * kBlockM; i += kThreads) {
        const int row = i % kBlockM;
        const float* src = (i < kBlockM ? lse_head : delta_head) + row0 + row;
        cp_async_4(stage + 2 * QTile::kBytes + i * 4, row < rows_left ? src : lse_head, row < rows_left);
    }
}
