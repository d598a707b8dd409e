// Copies between global memory and swizzled shared tiles (mma_sync/swizzled_tile.cuh): asynchronous
// predicated tile loads (dense, register-lean and paged) and 16-byte tile stores.
#pragma once
#include "common/ptx.cuh"
#include "common/global_io.cuh"
#include "mma_sync/swizzled_tile.cuh"

// Asynchronous global -> shared copier for kRows x kCols tiles, as one thread sees it.
// Threads are laid out over one panel (kChunksPerRow chunks wide, kThreads / kChunksPerRow rows tall)
// and step down the rows and across the panels. A thread's chunk column never changes, and its row
// only moves by multiples of a power of two above its base row, so the swizzle splits into a
// per-thread part (computed once) and a compile-time part: each copy is an add, an xor and a
// predicate instead of a full index computation. Rows >= valid_rows and columns >= valid_cols are
// zero-filled, so tails never feed garbage (or NaN) into the MMAs.
template <class Tile, int kRows, int kCols, int kThreads>
struct TileLoader {
    static constexpr int kCpr = Tile::kChunksPerRow;
    static constexpr int kPanels = kCols / Tile::kPanelCols;
    static constexpr int kRowsPerIter = kThreads / kCpr;
    static constexpr int kRowIters = (kRows + kRowsPerIter - 1) / kRowsPerIter;
    static_assert(kThreads % kCpr == 0 && (kRowsPerIter & (kRowsPerIter - 1)) == 0, "thread layout");

    int row0;          // this thread's first row
    int col0;          // this thread's column inside a panel
    int swizzled;      // chunk index xor the swizzle of row0
    i64 gmem_offset;   // row0 * row_stride + col0
    i64 iter_stride;   // kRowsPerIter * row_stride

    CF_DEVICE TileLoader(int tid, i64 row_stride) {
        row0 = tid / kCpr;
        int chunk = tid % kCpr;
        col0 = chunk * 8;
        swizzled = chunk ^ Tile::swizzle(row0);
        gmem_offset = row0 * row_stride + col0;
        iter_stride = kRowsPerIter * row_stride;
    }

    CF_DEVICE void load(u32 smem_tile, const u16* gmem_tile, int valid_rows, int valid_cols) const {
#pragma unroll
        for (int p = 0; p < kPanels; ++p) {
            const bool col_ok = p * Tile::kPanelCols + col0 < valid_cols;
#pragma unroll
            for (int it = 0; it < kRowIters; ++it) {
                const int row = row0 + it * kRowsPerIter;
                if (kRows % kRowsPerIter == 0 || row < kRows) {
                    const bool valid = col_ok && row < valid_rows;
                    const u16* src = gmem_tile + gmem_offset + it * iter_stride + p * Tile::kPanelCols;
                    // row0 < kRowsPerIter (a power of two), so swizzle(row) = swizzle(row0) ^ swizzle(it * kRowsPerIter).
                    const int chunk = swizzled ^ Tile::swizzle(it * kRowsPerIter);
                    const u32 dst = smem_tile + p * Tile::kPanelBytes + row * Tile::kRowBytes + (chunk << 4);
                    if constexpr (kVecBytes == 16) {
                        cp_async_16(dst, valid ? src : gmem_tile, valid);
                    } else {
                        load_chunk_narrow(dst, src, gmem_tile, row < valid_rows, p * Tile::kPanelCols + col0, valid_cols);
                    }
                }
            }
        }
    }
};

// TileLoader for loops that cannot spare registers (the forward's K/V stream): it keeps two 32-bit
// values per thread and derives each row's source address at the copy from the tile's address,
// which is the same for the whole block (uniform registers). TileLoader's hoisted 64-bit row
// offsets, kept live through the key loop, were what made the 4-warp forward spill.
template <class Tile, int kRows, int kCols, int kThreads>
struct LeanTileLoader {
    using Dense = TileLoader<Tile, kRows, kCols, kThreads>;
    int row0, swizzled;

    CF_DEVICE explicit LeanTileLoader(int tid) {
        row0 = tid / Dense::kCpr;
        swizzled = (tid % Dense::kCpr) ^ Tile::swizzle(row0);
    }

    CF_DEVICE void load(u32 smem_tile, const u16* gmem_tile, i64 row_stride, int valid_rows, int valid_cols) const {
        // Opaque: computed here, at every load, instead of once before the loop and kept live.
        const int row_base = opaque_int(row0);
        const int col0 = (opaque_int(threadIdx.x) % Dense::kCpr) * 8;
        // Row row_base + it * kRowsPerIter is valid iff it * kRowsPerIter < rows_here.
        const int rows_here = valid_rows - row_base;
        const u16* row_src = gmem_tile + row_base * row_stride + col0;
#pragma unroll
        for (int it = 0; it < Dense::kRowIters; ++it) {
            const int row = row_base + it * Dense::kRowsPerIter;
            if (kRows % Dense::kRowsPerIter == 0 || row < kRows) {
                const int chunk = swizzled ^ Tile::swizzle(it * Dense::kRowsPerIter);
#pragma unroll
                for (int p = 0; p < Dense::kPanels; ++p) {
                    const bool valid = it * Dense::kRowsPerIter < rows_here && p * Tile::kPanelCols + col0 < valid_cols;
                    const u32 dst = smem_tile + p * Tile::kPanelBytes + row * Tile::kRowBytes + (chunk << 4);
                    if constexpr (kVecBytes == 16) {
                        cp_async_16(dst, valid ? row_src + p * Tile::kPanelCols : gmem_tile, valid);
                    } else {
                        load_chunk_narrow(dst, row_src + p * Tile::kPanelCols, gmem_tile, it * Dense::kRowsPerIter < rows_here,
                                          p * Tile::kPanelCols + col0, valid_cols);
                    }
                }
                row_src += Dense::kRowsPerIter * row_stride;
            }
        }
    }
};

// TileLoader for a paged KV cache: logical row r of a sequence lives in page pages[r / page_size]
// at row r % page_size, so each row gets its own address (any page size works). Same thread layout
// and swizzle as TileLoader; rows past valid_rows are zero-filled and never looked up.
template <class Tile, int kRows, int kCols, int kThreads>
struct PagedTileLoader {
    using Dense = TileLoader<Tile, kRows, kCols, kThreads>;
    int row0, col0, swizzled;

    CF_DEVICE explicit PagedTileLoader(int tid) {
        row0 = tid / Dense::kCpr;
        int chunk = tid % Dense::kCpr;
        col0 = chunk * 8;
        swizzled = chunk ^ Tile::swizzle(row0);
    }

    // Rows [first_row, first_row + kRows) of the sequence whose page list is `pages`; `head_base`
    // points at this head's column 0 of page 0.
    // Page ids outside [0, num_pages) read as zeros.
    CF_DEVICE void load(u32 smem_tile, const u16* head_base, i64 page_stride, i64 row_stride, const int* pages,
                        int page_size, int num_pages, int first_row, int valid_rows, int valid_cols) const {
#pragma unroll
        for (int it = 0; it < Dense::kRowIters; ++it) {
            const int row = row0 + it * Dense::kRowsPerIter;
            if (kRows % Dense::kRowsPerIter == 0 || row < kRows) {
                bool row_ok = row < valid_rows;
                const u16* src_row = head_base;
                if (row_ok) {
                    const int logical = first_row + row;
                    const int page = pages[logical / page_size];
                    row_ok = (unsigned)page < (unsigned)num_pages;
                    src_row += row_ok ? page * page_stride + (i64)(logical % page_size) * row_stride : 0;
                }
                const int chunk = swizzled ^ Tile::swizzle(it * Dense::kRowsPerIter);
#pragma unroll
                for (int p = 0; p < Dense::kPanels; ++p) {
                    const bool valid = row_ok && p * Tile::kPanelCols + col0 < valid_cols;
                    const u32 dst = smem_tile + p * Tile::kPanelBytes + row * Tile::kRowBytes + (chunk << 4);
                    if constexpr (kVecBytes == 16) {
                        cp_async_16(dst, valid ? src_row + col0 + p * Tile::kPanelCols : head_base, valid);
                    } else {
                        load_chunk_narrow(dst, src_row + col0 + p * Tile::kPanelCols, head_base, row_ok,
                                          p * Tile::kPanelCols + col0, valid_cols);
                    }
                }
            }
        }
    }
};

// Copy rows [row0, row0 + kRowsCopied) of a swizzled shared tile to global memory with 16-byte
// stores (kVecBytes-wide pieces where rows are less aligned), skipping rows >= valid_rows and
// columns >= valid_cols. `lane`/`kLanes` spread the chunks
// over the threads taking part (a warp or the whole block).
template <class Tile, int kRowsCopied, int kCols, int kLanes>
CF_DEVICE void store_tile(const char* smem_tile, int row0, u16* gmem, i64 row_stride, int valid_rows,
                          int valid_cols, int lane) {
    constexpr int kChunks = kCols / 8;
    constexpr int kTotal = kRowsCopied * kChunks;
    constexpr int kIters = (kTotal + kLanes - 1) / kLanes;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        int idx = it * kLanes + lane;
        if (kTotal % kLanes == 0 || idx < kTotal) {
            int row = idx / kChunks;
            int chunk = idx % kChunks;
            if (row < valid_rows && chunk * 8 < valid_cols) {
                Chunk16 v = *reinterpret_cast<const Chunk16*>(smem_tile + Tile::chunk_offset(row0 + row, chunk));
                if constexpr (kVecBytes == 16) {
                    *reinterpret_cast<Chunk16*>(gmem + row * row_stride + chunk * 8) = v;
                } else {
                    const u32 w[4] = {v.x, v.y, v.z, v.w};
                    store_run_global(gmem + row * row_stride + chunk * 8, w, chunk * 8, valid_cols);
                }
            }
        }
    }
}
