// Which key blocks a query block must visit, which of them need an element-wise mask, and the
// mask itself. Masks are aligned to the bottom-right corner (FlashAttention-2's convention when
// seqlen_q != seqlen_k): with shift = seqlen_k - seqlen_q, query i sees key j iff
//     i + shift - window_left <= j <= i + shift + window_right   and   j < seqlen_k,
// causal being window_right = 0. kWindow enables the run-time window (sliding-window attention);
// without it the left side is unbounded and the right side is 0 (causal) or unbounded, known at
// compile time, so the plain kernels carry no window arithmetic.
#pragma once
#include "common/ptx.cuh"

template <bool kCausal, bool kWindow = false>
struct BlockMask {
    int seqlen_q;
    int seqlen_k;
    int window_left = 0;   // kWindow only; the host clamps "unbounded" to a large finite value
    int window_right = 0;  // kWindow only; already min(window_right, 0) when causal

    CF_DEVICE int diagonal_shift() const { return seqlen_k - seqlen_q; }
    static constexpr bool kRightBounded = kCausal || kWindow;
    CF_DEVICE int right_reach() const { return kWindow ? window_right : 0; }  // valid when kRightBounded

    // The key blocks [key_block_begin, key_block_end) hold every key visible to some row of m_block.
    CF_DEVICE int key_block_begin(int m_block, int block_m, int block_n) const {
        if (!kWindow) return 0;
        int first_col = m_block * block_m + diagonal_shift() - window_left;
        return first_col <= 0 ? 0 : first_col / block_n;
    }
    CF_DEVICE int key_block_end(int m_block, int block_m, int block_n) const {
        int last_col = seqlen_k;  // exclusive bound on visible columns
        if (kRightBounded) {
            int right_end = (m_block + 1) * block_m + diagonal_shift() + right_reach();
            last_col = right_end < last_col ? right_end : last_col;
        }
        return last_col <= 0 ? 0 : (last_col + block_n - 1) / block_n;
    }

    // Blocks entirely inside the visible region skip the element-wise mask (the common case). A
    // block can cross the right edge only at its top-right corner and the left edge only at its
    // bottom-left corner.
    CF_DEVICE bool block_needs_mask(int m_block, int n_block, int block_m, int block_n) const {
        int col_end = (n_block + 1) * block_n;
        bool crosses_tail = col_end > seqlen_k;
        bool crosses_right = kRightBounded && (col_end - 1 > m_block * block_m + diagonal_shift() + right_reach());
        bool crosses_left = kWindow && (n_block * block_n < (m_block + 1) * block_m - 1 + diagonal_shift() - window_left);
        return crosses_tail || crosses_right || crosses_left;
    }

    CF_DEVICE bool visible(int row, int col) const {
        int diag = row + diagonal_shift();
        return col < seqlen_k && (!kRightBounded || col <= diag + right_reach()) &&
               (!kWindow || col >= diag - window_left);
    }

    // Backward: the query blocks [begin, end) holding a row that sees some key of key block n_block.
    CF_DEVICE int query_block_begin(int n_block, int block_m, int block_n) const {
        if (!kRightBounded) return 0;
        int first_row = n_block * block_n - diagonal_shift() - right_reach();  // first row seeing the block's first key
        return first_row <= 0 ? 0 : first_row / block_m;
    }
    CF_DEVICE int query_block_end(int n_block, int block_m, int block_n) const {
        int blocks = (seqlen_q + block_m - 1) / block_m;
        if (!kWindow) return blocks;
        int last_row = (n_block + 1) * block_n - 1 - diagonal_shift() + window_left;  // last row seeing the last key
        if (last_row < 0) return 0;
        int end = last_row / block_m + 1;
        return end < blocks ? end : blocks;
    }

    // Backward: does tile (m_block, n_block) need the element-wise mask (tails, diagonal, window)?
    CF_DEVICE bool tile_needs_mask(int m_block, int n_block, int block_m, int block_n) const {
        return (m_block + 1) * block_m > seqlen_q || block_needs_mask(m_block, n_block, block_m, block_n);
    }
    CF_DEVICE bool visible_in_range(int row, int col) const { return row < seqlen_q && visible(row, col); }
};

// Where a thread block's (query or key) block, head and batch entry sit in the launch grid.
// Plain order: (blocks, heads, batch). Grouped order, for causal grids, whose blocks' work grows
// (forward: query blocks) or shrinks (backward: key blocks) with the block index: (G, blocks,
// chunks), chunk c holding the (head, batch) groups c*G .. c*G + G - 1 (group = batch * nheads +
// head). Blocks start in linear order (blockIdx.x fastest), so within each chunk every group's
// longest block starts before any shorter one; the host sizes G so that a chunk spans about one
// wave of the GPU (KernelConfig.grid): the last wave then holds short blocks, while the blocks
// running at once still share the K/V (forward) or Q/dO/dQ (backward) of few groups in L2.
// With one chunk per group (G = 1) the grouped order is the plain one.
template <bool kGrouped>
struct BlockGrid {
    // Grouped ids are computed (a division), not special registers the compiler can re-read at any
    // time: kernels short of registers recompute them after their main loop instead of keeping them.
    static constexpr bool kComputedIds = kGrouped;
    int block, head, batch;

    static CF_DEVICE BlockGrid at(unsigned bx, unsigned by, unsigned bz, unsigned nheads) {
        if (!kGrouped) return {(int)bx, (int)by, (int)bz};
        const unsigned group = bz * gridDim.x + bx;  // < 2^32: batch and nheads are each < 2^16
        return {(int)by, (int)(group % nheads), (int)(group / nheads)};
    }
    static CF_DEVICE BlockGrid here(int nheads) { return at(blockIdx.x, blockIdx.y, blockIdx.z, nheads); }
    static CF_DEVICE int heads(int nheads) { return kGrouped ? nheads : (int)gridDim.y; }
    static CF_DEVICE int blocks() { return kGrouped ? (int)gridDim.y : (int)gridDim.x; }
};
