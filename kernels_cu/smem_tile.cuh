// Shared-memory tiles: swizzled layout, ldmatrix addressing, and predicated global <-> shared copies.
#pragma once
#include "ptx.cuh"

// A kRows x kCols tile of 16-bit elements. Columns are stored in panels of 64 (or 32 when kCols is
// not a multiple of 64); inside a panel a row is one run of 16-byte chunks. The chunk index is
// XOR-ed with row bits so that the 8 rows read by one ldmatrix phase (same logical chunk) land in
// 8 different 16-byte bank groups: ldmatrix and cp.async are then free of bank conflicts.
template <int kRows, int kCols>
struct SwizzledTile {
    static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 columns");
    static constexpr int kPanelCols = (kCols % 64 == 0) ? 64 : 32;
    static constexpr int kChunksPerRow = kPanelCols / 8;     // 8 or 4 chunks per panel row
    static constexpr int kRowsPer128B = 8 / kChunksPerRow;   // rows sharing one 128-byte line
    static constexpr int kRowBytes = kPanelCols * 2;
    static constexpr int kPanelBytes = kRows * kRowBytes;
    static constexpr int kBytes = kRows * kCols * 2;

    // Only row % 8 matters, so rows that differ by a multiple of 8 share their swizzle.
    static CF_DEVICE int swizzle(int row) { return (row / kRowsPer128B) % kChunksPerRow; }

    // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of `row`.
    static CF_DEVICE int chunk_offset(int row, int chunk) {
        int panel = chunk / kChunksPerRow;
        return panel * kPanelBytes + row * kRowBytes + ((chunk % kChunksPerRow) ^ swizzle(row)) * 16;
    }
};

// Per-lane ldmatrix address generator. A lane always reads the same row (up to multiples of 8,
// which keep the swizzle) and the same parity of chunk, so the swizzle is folded once into
// `lane_xor` and each address is base + constant + (constant ^ lane_xor) * 16.
template <class Tile>
struct LdsmCursor {
    u32 row_addr;
    int lane_xor;
    CF_DEVICE LdsmCursor(u32 tile_addr, int row, int lane_chunk)
        : row_addr(tile_addr + row * Tile::kRowBytes), lane_xor(lane_chunk ^ Tile::swizzle(row)) {}
    // Address of logical chunk (chunk_even + lane_chunk) in row (row + row_offset);
    // row_offset must be a multiple of 8 and chunk_even even (both compile-time in practice).
    CF_DEVICE u32 at(int row_offset, int chunk_even) const {
        int panel = chunk_even / Tile::kChunksPerRow;
        return row_addr + panel * Tile::kPanelBytes + row_offset * Tile::kRowBytes +
               (((chunk_even % Tile::kChunksPerRow) ^ lane_xor) << 4);
    }
    // The same cursor with its columns starting `chunks` chunks further right, for at() calls whose
    // chunk_even stays below kSpan. `chunks` (known only at run time, say a warp's column offset) is
    // a multiple of kSpan, a power of two, so adding it never carries into the bits of chunk_even:
    // its panel folds into the row address and its remainder into the lane's xor, and at() keeps
    // compile-time offsets instead of computing a panel per call. (ColumnShare also uses it with
    // chunks < kChunksPerRow and at() offsets that are multiples of kChunksPerRow: no shared bits.)
    template <int kSpan>
    CF_DEVICE LdsmCursor shifted(int chunks) const {
        static_assert(kSpan > 0 && (kSpan & (kSpan - 1)) == 0, "kSpan must be a power of two");
        LdsmCursor moved = *this;
        moved.row_addr += (chunks / Tile::kChunksPerRow) * Tile::kPanelBytes;
        moved.lane_xor ^= chunks % Tile::kChunksPerRow;
        return moved;
    }
};

// A cursor for at() calls spanning kTiles chunks from a runtime column offset `chunks` (a multiple
// of kTiles): folded into the cursor (LdsmCursor::shifted) when kTiles is a power of two, so that
// at() keeps compile-time offsets; otherwise left to the caller, who adds chunk0 to every at().
template <class Tile>
struct OffsetCursor {
    LdsmCursor<Tile> cursor;
    int chunk0;
};
template <int kTiles, class Tile>
CF_DEVICE OffsetCursor<Tile> offset_columns(const LdsmCursor<Tile>& cursor, int chunks) {
    if constexpr ((kTiles & (kTiles - 1)) == 0) {
        return {cursor.template shifted<kTiles>(chunks), 0};
    } else {
        return {cursor, chunks};
    }
}

// A warp's share of a tile's columns: kTiles 8-column tiles (kTiles / 2 pairs), one of kShares equal
// shares of the row. Shares are contiguous (share s from chunk s * kTiles) unless kTiles is not a
// power of two and the shares' first pairs fill a panel row exactly (2 * kShares == kChunksPerRow:
// head dims 96 and 192, 6 tiles a share). Then the shares interleave by pairs: pair np of share s
// sits at chunk 2 s + np * 2 kShares. Its run-time part 2 s stays inside a panel row and folds into
// the lane's xor once (LdsmCursor::shifted: the compile-time parts, multiples of kChunksPerRow, share
// no bits with it), so every ldmatrix address is the cursor plus a constant, where a contiguous
// 6-tile share needs a run-time panel and xor per ldmatrix. (ncu had counted 12% more instructions
// than FA2's head-dim-192 backward for the same MMAs, all integer; interleaving measured 1.005-1.024x
// at head dim 96 and 0.995-1.001x at 192: docs/design-notes.md, 'Head dims 96 and 192'.)
template <int kTiles, int kShares, int kChunksPerRow>
struct ColumnShare {
    static constexpr bool kInterleaved = (kTiles & (kTiles - 1)) != 0 && 2 * kShares == kChunksPerRow;
    static constexpr int kPairStride = kInterleaved ? 2 * kShares : 2;  // chunks from one pair to the next
    // First chunk of tile t (0 <= t < kTiles) of share `share`.
    static CF_DEVICE int chunk(int share, int t) {
        return kInterleaved ? 2 * share + (t / 2) * kPairStride + t % 2 : share * kTiles + t;
    }
    // The share's cursor: pair np at at(row, chunk0 + np * kPairStride).
    template <class Tile>
    static CF_DEVICE OffsetCursor<Tile> cursor(const LdsmCursor<Tile>& tile_cursor, int share) {
        static_assert(Tile::kChunksPerRow == kChunksPerRow, "a share of this tile's rows");
        if constexpr (kInterleaved) {
            return {tile_cursor.template shifted<2>(2 * share), 0};
        } else {
            return offset_columns<kTiles>(tile_cursor, share * kTiles);
        }
    }
};

// ---- narrow global accesses (vector widths below 16 bytes: kVecBytes, ptx.cuh) -------------------
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
