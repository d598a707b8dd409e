// FlashAttention-2's optional features, as run-time parameters of the kernels instantiated with
// kVariant = true (the plain kernels, kVariant = false, compile all of this away):
//   varlen   packed sequences described by cumulative lengths cu_seqlens_q/k (int32, batch + 1);
//   window   sliding-window mask (common/block_mask.cuh);
//   softcap  s = softcap * tanh(scale * q.k / softcap);
//   ALiBi    s -= slope[batch, head] * |i + seqlen_k - seqlen_q - j|;
//   dropout  P entries dropped by a Philox mask (common/philox.cuh), the kept ones scaled by 1 / (1 - p).
#pragma once
#include "common/ptx.cuh"
#include "common/block_mask.cuh"
#include "common/philox.cuh"

// Scalar kernel arguments of the optional features, gathered in one struct on the device side.
struct VariantArgs {
    const int* cu_seqlens_q;  // varlen: nullptr for fixed-length batches
    const int* cu_seqlens_k;
    int window_left, window_right;
    float softcap;             // 0: off
    const float* alibi_slopes; // nullptr: off; (batch, nheads) with batch stride alibi_batch_stride
    i64 alibi_batch_stride;
    i64 dropout_seed;
    i64 dropout_offset;        // low 32 bits used
    int dropout_threshold;     // drop probability x 65536; 0: off
    float dropout_rescale;     // 1 / (1 - drop probability)
    // When set, (seed, offset) are read from this device pair instead: a framework's generator
    // wrote them on the stream, so CUDA-graph replays draw new masks without a host round trip.
    const i64* dropout_rng_state;

    CF_DEVICE Dropout dropout() const {
        i64 seed = dropout_seed, offset = dropout_offset;
        if (dropout_threshold != 0 && dropout_rng_state != nullptr) seed = dropout_rng_state[0], offset = dropout_rng_state[1];
        return Dropout{(u32)seed, (u32)((unsigned long long)seed >> 32), (u32)offset, (u32)dropout_threshold};
    }
};

#define CF_VARIANT_PARAMS                                                                            \
    const int *__restrict__ cu_seqlens_q, const int *__restrict__ cu_seqlens_k, int window_left,     \
        int window_right, float softcap, const float *__restrict__ alibi_slopes, i64 alibi_batch_stride, \
        i64 dropout_seed, i64 dropout_offset, int dropout_threshold, float dropout_rescale,               \
        const i64 *__restrict__ dropout_rng_state
#define CF_VARIANT_ARGS                                                                                  \
    VariantArgs {                                                                                        \
        cu_seqlens_q, cu_seqlens_k, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride, \
            dropout_seed, dropout_offset, dropout_threshold, dropout_rescale, dropout_rng_state          \
    }

// Where batch entry `batch` lives. Fixed-length batches: the batch strides address it and the
// (batch, nheads, seqlen_q) LSE layout applies. Varlen: every tensor is a packed (total, nheads,
// dim) view (batch strides 0), a sequence starts at row cu_seqlens[batch], and the LSE is
// (nheads, total_q), FA2's varlen layout.
struct SeqRange {
    int seqlen_q, seqlen_k;
    int q_start, k_start;  // first row of this sequence in the packed view (0 when fixed-length)
    i64 q_flat, k_flat;    // first row in the (batch * seqlen) flattening of fp32 scratch buffers
    i64 lse_stride_h;      // LSE/D elements between heads
    i64 lse_base;          // LSE/D index of (this batch, head 0, row 0)

    template <bool kVariant>
    CF_DEVICE static SeqRange make(const VariantArgs& va, int batch, int nheads, int seqlen_q, int seqlen_k) {
        SeqRange r;
        if (kVariant && va.cu_seqlens_q != nullptr) {
            r.q_start = va.cu_seqlens_q[batch];
            r.k_start = va.cu_seqlens_k[batch];
            r.seqlen_q = va.cu_seqlens_q[batch + 1] - r.q_start;
            r.seqlen_k = va.cu_seqlens_k[batch + 1] - r.k_start;
            r.q_flat = r.q_start;
            r.k_flat = r.k_start;
            r.lse_stride_h = seqlen_q;  // varlen: the host passes total_q (rows of the packed q) here
            r.lse_base = r.q_start;
        } else {
            r.q_start = r.k_start = 0;
            r.seqlen_q = seqlen_q;
            r.seqlen_k = seqlen_k;
            r.q_flat = (i64)batch * seqlen_q;
            r.k_flat = (i64)batch * seqlen_k;
            r.lse_stride_h = seqlen_q;
            r.lse_base = (i64)batch * nheads * seqlen_q;
        }
        return r;
    }
    CF_DEVICE i64 lse_offset(int head) const { return lse_base + head * lse_stride_h; }
};

// The KV-cache forward (flash_attn_with_kvcache): per-sequence cache lengths, an optional map from
// batch entry to cache entry, left padding, an optional page table, and split-KV partial outputs.
struct KvCacheArgs {
    const int* cache_seqlens;    // (batch,) or nullptr (every cache entry full): lengths before appending
    int seqlen_new;              // rows appended by this call: sequence b has cache_seqlens[b] + seqlen_new keys
    const int* cache_batch_idx;  // (batch,) or nullptr: which cache entry batch b reads
    const int* cache_leftpad;    // (batch,) or nullptr: first valid cache row of each sequence
    const int* block_table;      // (batch, max_pages) or nullptr (not paged)
    i64 block_table_stride;
    int page_size;
    int cache_rows;     // rows per cache entry (paged: pages per sequence x page size)
    int cache_entries;  // cache entries (paged: pages); indices outside are treated as empty
    int num_splits;    // > 1: each split writes fp32 partial results, combined afterwards
    float* o_partial;  // (num_splits, batch, nheads, seqlen_q, head_dim)
    float* lse_partial;  // (num_splits, batch, nheads, seqlen_q)
};

#define CF_KVCACHE_PARAMS                                                                                \
    const int *__restrict__ cache_seqlens, int seqlen_new, const int *__restrict__ cache_batch_idx,      \
        const int *__restrict__ cache_leftpad, const int *__restrict__ block_table, i64 block_table_stride, \
        int page_size, int cache_rows, int cache_entries, int num_splits, float *__restrict__ o_partial,   \
        float *__restrict__ lse_partial
#define CF_KVCACHE_ARGS                                                                                 \
    KvCacheArgs {                                                                                       \
        cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table, block_table_stride,     \
            page_size, cache_rows, cache_entries, num_splits, o_partial, lse_partial                    \
    }

// Sequence range of batch entry `batch` in the KV-cache forward: keys [leftpad, cache_seqlens[b] + seqlen_new).
// Lengths are clamped to the cache and a cache index outside it gives an empty sequence, so bad
// values in device arrays (which the host does not read) cannot make the kernel read out of bounds.
// Paged varlen (flash_attn_varlen_func with block_table; va.cu_seqlens_q set): q is packed, sequence
// b's queries are rows cu_seqlens_q[b] : cu_seqlens_q[b + 1], its keys are the first
// cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages (clamped to the page table), and the LSE
// is (nheads, total_q) with total_q passed as seqlen_q, as in the varlen forward.
CF_DEVICE SeqRange kvcache_seq_range(const KvCacheArgs& kc, const VariantArgs& va, int batch, int nheads,
                                     int seqlen_q) {
    SeqRange r;
    if (va.cu_seqlens_q != nullptr) {
        r.q_start = va.cu_seqlens_q[batch];
        r.seqlen_q = va.cu_seqlens_q[batch + 1] - r.q_start;
        r.seqlen_k = min(max(va.cu_seqlens_k[batch + 1] - va.cu_seqlens_k[batch], 0), kc.cache_rows);
        r.k_start = 0;
        r.q_flat = r.q_start;
        r.k_flat = 0;  // unused: no backward
        r.lse_stride_h = seqlen_q;
        r.lse_base = r.q_start;
        return r;
    }
    const int leftpad = kc.cache_leftpad != nullptr ? max(kc.cache_leftpad[batch], 0) : 0;
    const int entry = kc.cache_batch_idx != nullptr ? kc.cache_batch_idx[batch] : batch;
    const bool entry_ok = kc.block_table != nullptr || (unsigned)entry < (unsigned)kc.cache_entries;
    const i64 keys = kc.cache_seqlens != nullptr ? (i64)kc.cache_seqlens[batch] + kc.seqlen_new : kc.cache_rows;
    const int end = entry_ok ? (int)min(keys, (i64)kc.cache_rows) : 0;
    r.seqlen_q = seqlen_q;
    r.seqlen_k = max(end - leftpad, 0);
    r.q_start = 0;
    r.k_start = leftpad;
    r.q_flat = (i64)batch * seqlen_q;
    r.k_flat = 0;  // unused: no backward
    r.lse_stride_h = seqlen_q;
    r.lse_base = (i64)batch * nheads * seqlen_q;
    return r;
}

template <bool kCausal, bool kVariant>
CF_DEVICE BlockMask<kCausal, kVariant> make_mask(const SeqRange& seq, const VariantArgs& va) {
    BlockMask<kCausal, kVariant> mask{seq.seqlen_q, seq.seqlen_k};
    if (kVariant) {
        mask.window_left = va.window_left;
        mask.window_right = va.window_right;
    }
    return mask;
}

CF_DEVICE float tanh_accurate(float x) { return tanhf(x); }

// Score modifiers applied to the raw products q.k before the softmax. When active they turn the
// scores into natural-log-domain logits (the softmax then scales by log2(e) only), so the plain
// scale folding of the kernels stays untouched when they are off.
struct ScoreMod {
    float softmax_scale;
    float softcap;      // 0: off
    float alibi_slope;  // 0: off
    int shift;          // seqlen_k - seqlen_q
    bool active;

    CF_DEVICE static ScoreMod make(const VariantArgs& va, float softmax_scale, int batch, int head, int shift) {
        ScoreMod m;
        m.softmax_scale = softmax_scale;
        m.softcap = va.softcap;
        m.alibi_slope = va.alibi_slopes != nullptr ? va.alibi_slopes[batch * va.alibi_batch_stride + head] : 0.f;
        m.shift = shift;
        m.active = va.softcap > 0.f || va.alibi_slopes != nullptr;
        return m;
    }

    // Logit of raw product s at (row, col); *dtanh receives d(logit)/d(scale * s) for the
    // backward (1 - tanh^2 with softcap, else 1).
    CF_DEVICE float apply(float s, int row, int col, float* dtanh = nullptr) const {
        float logit;
        if (softcap > 0.f) {
            float t = tanh_accurate(s * softmax_scale / softcap);
            logit = softcap * t;
            if (dtanh) *dtanh = 1.f - t * t;
        } else {
            logit = s * softmax_scale;
            if (dtanh) *dtanh = 1.f;
        }
        return logit - alibi_slope * fabsf((float)(row + shift - col));
    }
};
