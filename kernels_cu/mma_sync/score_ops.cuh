// Element-wise steps on score tiles held as m16n8k16 accumulators (S, P): score modifiers, the
// attention mask and dropout, each walking a lane's registers (the accumulator coordinates of
// mma_sync/fragment.cuh, written out) and applying the layout-independent rule of common/ (ScoreMod in
// common/variant.cuh, BlockMask::visible in common/block_mask.cuh, Dropout in common/philox.cuh).
#pragma once
#include "common/ptx.cuh"
#include "common/block_mask.cuh"
#include "common/philox.cuh"
#include "common/variant.cuh"
#include "mma_sync/fragment.cuh"

// Masked-out scores become -inf (exp2 -> 0).
template <class Tr, class Mask>
CF_DEVICE void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const Mask& mask, int row0, int col0, int lane) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int row = row0 + mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                int col = col0 + nt * 8 + (lane & 3) * 2 + (i & 1);
                if (!mask.visible(row, col)) s[mt][nt][i] = -CF_INF;
            }
}

// Softcap / ALiBi (variant kernels only): raw products -> natural-log-domain logits.
template <class Tr>
CF_DEVICE void apply_score_mod(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const ScoreMod& mod, int row0, int col0,
                               int lane) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                s[mt][nt][i] = mod.apply(s[mt][nt][i], row0 + mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0),
                                         col0 + nt * 8 + (lane & 3) * 2 + (i & 1));
}

// Dropout (variant kernels): zero the dropped entries of P = exp(S - max). The row sums already
// hold every entry (the softmax is over all keys); the 1 / (1 - p) of the kept ones is folded into
// the final normalisation. Key blocks start at multiples of 32 and span 4k column tiles, so a lane's
// entries of one row in tiles 4g..4g+3 are one Philox block (common/philox.cuh), slot 2 (nt % 4) + e.
template <class Tr>
CF_DEVICE void apply_dropout(float (&p)[Tr::kMTiles][Tr::kNTiles][4], const Dropout& drop, int bh, int row0,
                             int col0, int lane) {
    static_assert(Tr::kNTiles % 4 == 0, "dropout draws cover four 8-key tiles (key blocks of 32k keys)");
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + lane / 4 + 8 * r;
#pragma unroll
            for (int g = 0; g < Tr::kNTiles / 4; ++g) {
                const Philox4 rnd = drop.block(row, col0 + g * 32 + (lane % 4) * 2, bh);
#pragma unroll
                for (int t = 0; t < 4; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (!drop.keep(rnd, 2 * t + e)) p[mt][4 * g + t][2 * r + e] = 0.f;
            }
        }
}

// Dropout over a transposed fragment (rows = keys, columns = queries; the backward's P^T): keys col
// and col + 8 with col % 16 < 8 (the two rows a lane holds) are numbers 2 w + col % 2 and
// 2 (w + 1) + col % 2 of one block (common/philox.cuh), w = 2 ((col / 16) % 2): one select per key,
// where Dropout::number() with a run-time slot would need three.
CF_DEVICE void keep_transposed_pair(const Dropout& drop, const Philox4& r, int col, bool (&kept)[2]) {
    const bool upper = (col >> 4) & 1;
    const int shift = 16 * (col & 1);
    kept[0] = (((upper ? r.x[2] : r.x[0]) >> shift) & 0xffffu) >= drop.drop_threshold;
    kept[1] = (((upper ? r.x[3] : r.x[1]) >> shift) & 0xffffu) >= drop.drop_threshold;
}
