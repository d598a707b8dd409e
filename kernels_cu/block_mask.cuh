// Which key blocks a query block must visit, which of them need an element-wise mask, and the
// mask itself. Causal masks are aligned to the bottom-right corner: query i sees key j iff
// j <= i + seqlen_k - seqlen_q (FlashAttention-2's convention when seqlen_q != seqlen_k).
#pragma once
#include "ptx.cuh"

template <bool kCausal>
struct BlockMask {
    int seqlen_q;
    int seqlen_k;

    CF_DEVICE int diagonal_shift() const { return seqlen_k - seqlen_q; }

    // One past the last key block holding a key visible to some row of query block m_block.
    CF_DEVICE int key_block_end(int m_block, int block_m, int block_n) const {
        int last_col = seqlen_k;  // exclusive bound on visible columns
        if (kCausal) {
            int causal_end = (m_block + 1) * block_m + diagonal_shift();
            last_col = causal_end < last_col ? causal_end : last_col;
        }
        return last_col <= 0 ? 0 : (last_col + block_n - 1) / block_n;
    }

    // Blocks entirely inside the visible region skip the element-wise mask (the common case).
    CF_DEVICE bool block_needs_mask(int m_block, int n_block, int block_m, int block_n) const {
        int col_end = (n_block + 1) * block_n;
        bool crosses_tail = col_end > seqlen_k;
        bool crosses_diagonal = kCausal && (col_end - 1 > m_block * block_m + diagonal_shift());
        return crosses_tail || crosses_diagonal;
    }

    CF_DEVICE bool visible(int row, int col) const {
        return col < seqlen_k && (!kCausal || col <= row + diagonal_shift());
    }

    // Backward: the query blocks [begin, end) holding a row that sees some key of key block n_block.
    CF_DEVICE int query_block_begin(int n_block, int block_m, int block_n) const {
        if (!kCausal) return 0;
        int first_row = n_block * block_n - diagonal_shift();  // first row that sees the block's first key
        return first_row <= 0 ? 0 : first_row / block_m;
    }
    CF_DEVICE int query_block_end(int block_m) const { return (seqlen_q + block_m - 1) / block_m; }

    // Backward: does tile (m_block, n_block) need the element-wise mask (tails or diagonal)?
    CF_DEVICE bool tile_needs_mask(int m_block, int n_block, int block_m, int block_n) const {
        return (m_block + 1) * block_m > seqlen_q || block_needs_mask(m_block, n_block, block_m, block_n);
    }
    CF_DEVICE bool visible_in_range(int row, int col) const { return row < seqlen_q && visible(row, col); }
};
