// Online softmax over register fragments of S = Q K^T (m16n8k16 accumulator layout); the per-row
// arithmetic is common/online_softmax.cuh's.
//
// Each lane of a warp holds, per 16-row MMA tile, two rows (lane/4 and lane/4 + 8) and per 8-column
// tile two adjacent columns. A row is spread over the 4 lanes of a quad, so row reductions are two
// xor-shuffles. The running sum is kept per lane and reduced across the quad only once, at the end.
#pragma once
#include "common/ptx.cuh"
#include "common/online_softmax.cuh"
#include "mma_sync/fragment.cuh"

template <int kMTiles, int kNTiles>
struct OnlineSoftmax {
    float row_max[kMTiles][2];  // raw (unscaled) logits
    float row_sum[kMTiles][2];  // lane-partial sums of exp2

    CF_DEVICE void init() {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) { row_max[mt][r] = -CF_INF; row_sum[mt][r] = 0.f; }
    }

    // The row sums can live in shared memory between key blocks (`sums`: this thread's first
    // slot; slot i is sums[i * kThreads], so a warp's accesses are contiguous).
    template <int kThreads>
    CF_DEVICE void store_sums(float* sums) const {
#pragma unroll
        for (int i = 0; i < 2 * kMTiles; ++i) sums[i * kThreads] = row_sum[i / 2][i % 2];
    }
    template <int kThreads>
    CF_DEVICE void load_sums(const float* sums) {
#pragma unroll
        for (int i = 0; i < 2 * kMTiles; ++i) row_sum[i / 2][i % 2] = sums[i * kThreads];
    }

    // Turns s into unnormalised probabilities and rescales the output accumulator (softmax_rescale).
    template <int kOTiles>
    CF_DEVICE void update(float (&s)[kMTiles][kNTiles][4], float (&o)[kMTiles][kOTiles][4], float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[mt][r];
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                mx = quad_max(mx);
                const SoftmaxRescale rescale = softmax_rescale(row_max[mt][r], mx, scale_log2);
                row_sum[mt][r] *= rescale.correction;
#pragma unroll
                for (int ot = 0; ot < kOTiles; ++ot) {
                    o[mt][ot][2 * r] *= rescale.correction;
                    o[mt][ot][2 * r + 1] *= rescale.correction;
                }
                row_max[mt][r] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    s[mt][nt][2 * r] = softmax_exp2(s[mt][nt][2 * r], scale_log2, rescale.max_scaled);
                    s[mt][nt][2 * r + 1] = softmax_exp2(s[mt][nt][2 * r + 1], scale_log2, rescale.max_scaled);
                    sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                }
                row_sum[mt][r] += sum;
            }
        }
    }

    // Completes the row sums across the quad; returns 1/sum per row (0 for rows that saw no key)
    // and writes the natural-log LSE (+inf for rows that saw no key).
    CF_DEVICE void finalize(float (&inv_sum)[kMTiles][2], float (&lse)[kMTiles][2], float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                softmax_finish_row(row_max[mt][r], quad_sum(row_sum[mt][r]), scale_log2, inv_sum[mt][r], lse[mt][r]);
    }
};
