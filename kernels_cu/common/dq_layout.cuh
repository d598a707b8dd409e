// Layout of the fp32 dQ accumulator in global memory: the column and row permutations a backward
// kernel may stage dQ with (mma_sync/dq_staging.cuh), which flash_bwd_convert_kernel
// (common/flash_bwd_prepost.cu) undoes when reading the accumulator back. Mirrored by the host
// (cuflash2/families/mma_sync/kernel_config.py: KernelConfig.dq_column_swizzle, dq_row_interleave).
#pragma once
#include "common/ptx.cuh"

// The dQ accumulator's column permutation: pairs (col, col + 1) move by 8 * (row % 4) columns where
// `mask` is 24 (head dims that are multiples of 32), nowhere where it is 0. Used by DqStaging when
// staging and by flash_bwd_convert_kernel when reading the accumulator back.
CF_DEVICE int dq_swizzled_col(int row, int col, int mask) { return col ^ (mask & ((row % 4) * 8)); }

// The dQ accumulator's row permutation within each group of 8 rows where `interleave` is set: row
// r of a group is kept at row 2 (r % 4) + r / 4. Used by DqStaging (kRowInterleave) when staging and
// by flash_bwd_convert_kernel when reading the accumulator back. Query blocks start at multiples of
// 8 rows, so a block's rows stay in its own range.
CF_DEVICE int dq_staged_row(int row, bool interleave) {
    return interleave ? (row & ~7) | (2 * (row & 3) + ((row >> 2) & 1)) : row;
}
