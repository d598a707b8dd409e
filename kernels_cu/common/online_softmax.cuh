// The per-row arithmetic of the online softmax, independent of how a kernel spreads a row over
// threads and registers (the m16n8k16 fragment walk: mma_sync/online_softmax.cuh).
//
// A row keeps a running maximum (raw, unscaled logits) and a running sum of exponentials.
// Exponentials are exp2 with the softmax scale folded in: p = exp2(s * scale_log2 - max * scale_log2),
// one FFMA and one EX2 per element.
#pragma once
#include "common/ptx.cuh"

// When a row's maximum grows from old_max to new_max: the scaled maximum every later exponential
// subtracts, and the factor exp2(old_max - new_max) (scaled) that rescales the row's sum and output
// so far. A row whose max is still -inf (nothing visible yet) subtracts 0 instead, so exp2(-inf) = 0
// and no NaN appears; the first block needs no special case: its correction is exp2(-inf) = 0 times
// a zero sum and accumulator.
struct SoftmaxRescale {
    float max_scaled;
    float correction;
};
CF_DEVICE SoftmaxRescale softmax_rescale(float old_max, float new_max, float scale_log2) {
    const float max_scaled = (new_max == -CF_INF) ? 0.f : new_max * scale_log2;
    return {max_scaled, fast_exp2(old_max * scale_log2 - max_scaled)};
}

// Unnormalised probability of raw logit s in a row whose scaled maximum is max_scaled.
CF_DEVICE float softmax_exp2(float s, float scale_log2, float max_scaled) {
    return fast_exp2(fmaf(s, scale_log2, -max_scaled));
}

// A finished row (sum complete over all its threads): 1/sum (0 for a row that saw no key) and the
// natural-log LSE (+inf for a row that saw no key).
CF_DEVICE void softmax_finish_row(float row_max, float sum, float scale_log2, float& inv_sum, float& lse) {
    const float kLn2 = 0.6931471805599453f;
    const bool empty = (sum == 0.f);
    inv_sum = empty ? 0.f : 1.f / sum;
    lse = empty ? CF_INF : (row_max * scale_log2 + fast_log2(sum)) * kLn2;
}
