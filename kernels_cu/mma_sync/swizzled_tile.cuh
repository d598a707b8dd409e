// Swizzled shared-memory tiles of 16-bit elements and their ldmatrix addressing (which 16-byte chunk
// each lane reads): the layout the mma.sync kernels stage their operands in.
#pragma once
#include "common/ptx.cuh"

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
