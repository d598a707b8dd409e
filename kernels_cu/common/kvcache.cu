// KV-cache helpers for flash_attn_with_kvcache:
//   rotary_copy_kernel        new k/v rows -> the cache (paged or not), or q -> a rotated copy,
//                             applying rotary embeddings on the way;
//   flash_fwd_combine_kernel  split-KV partial results -> the output, weighted by their LSEs.
#include "common/ptx.cuh"
#include "common/global_io.cuh"

// dst[row(b, i), h, c] = rotary(src[b, i, h, :], position(b, i))[c], one thread per element.
// Rows go to the end of the cache (cache_seqlens[b] + i, through the page table when paged) or to
// row i of a plain destination. Rotary positions are absolute cache rows, cache_seqlens[b] (+ i when
// positions_per_row), whatever the left padding (flash-attn's convention). Rotary pairs are (2j, 2j+1) when interleaved, else (j, j + rotary_dim / 2);
// cos/sin are fp32 (rotary_rows, rotary_dim / 2); columns past rotary_dim are copied.
// Memory safety without reading device values on the host: rows past dst_rows, page or batch
// indices outside [0, dst_entries) are not written, and positions are clamped to the cos/sin table.
template <class T>
__global__ void __launch_bounds__(256)
rotary_copy_kernel(const u16* __restrict__ src, i64 src_batch_stride, i64 src_row_stride, i64 src_head_stride,
                   u16* __restrict__ dst, i64 dst_batch_stride, i64 dst_row_stride, i64 dst_head_stride,
                   int seqlen, int nheads, int head_dim, const int* __restrict__ cache_seqlens,
                   const int* __restrict__ dst_batch_idx,
                   const int* __restrict__ block_table, i64 block_table_stride, int page_size, int dst_rows,
                   int dst_entries, int dst_at_cache_end, const float* __restrict__ cos, const float* __restrict__ sin,
                   int rotary_rows, int rotary_dim, int interleaved, int positions_per_row) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int batch = blockIdx.y;
    if (idx >= (i64)seqlen * nheads * head_dim) return;
    const int c = (int)(idx % head_dim);
    const int h = (int)((idx / head_dim) % nheads);
    const int i = (int)(idx / ((i64)head_dim * nheads));
    const u16* x = src + batch * src_batch_stride + (i64)i * src_row_stride + h * src_head_stride;
    const int cached = cache_seqlens != nullptr ? cache_seqlens[batch] : 0;

    float value = T::to_float(x[c]);
    if (cos != nullptr && c < rotary_dim) {
        const int half = rotary_dim / 2;
        int j, partner;
        bool first;
        if (interleaved) {
            j = c / 2, partner = c ^ 1, first = (c % 2 == 0);
        } else {
            first = c < half, j = first ? c : c - half, partner = first ? c + half : c - half;
        }
        i64 pos = (i64)cached + (positions_per_row ? i : 0);
        pos = pos < 0 ? 0 : (pos >= rotary_rows ? rotary_rows - 1 : pos);
        const float cs = cos[pos * half + j], sn = sin[pos * half + j];
        const float other = T::to_float(x[partner]);
        value = first ? value * cs - other * sn : other * sn + value * cs;
    }

    const int row = dst_at_cache_end ? cached + i : i;
    if (row < 0 || row >= dst_rows) return;
    u16* out;
    if (block_table != nullptr) {
        const int page = block_table[batch * block_table_stride + row / page_size];
        if ((unsigned)page >= (unsigned)dst_entries) return;
        out = dst + page * dst_batch_stride + (i64)(row % page_size) * dst_row_stride;
    } else {
        const int b = dst_batch_idx != nullptr ? dst_batch_idx[batch] : batch;
        if ((unsigned)b >= (unsigned)dst_entries) return;
        out = dst + b * dst_batch_stride + (i64)row * dst_row_stride;
    }
    out[h * dst_head_stride + c] = (u16)(T::pack(value, 0.f) & 0xffff);
}

// out[b, i, h, :] = sum_s exp(lse_s - lse) o_s with lse = log sum_s exp(lse_s), over the splits that
// saw a key (lse_s finite); rows no split saw get out 0 and lse +inf. One warp per (b, h, i).
// Decoding has few rows (batch x heads) and up to kMaxCombineSplits splits, so the work is spread
// over the splits, not only the columns: lane j holds the LSEs of splits j, j + 32, ... (a warp
// reduction gives the row's LSE), and the partial outputs are read as independent 16-byte loads,
// each lane owning 4 columns. Every split writes every row of its partials (0 where it saw no key),
// so no load depends on a weight.
constexpr int kMaxCombineSplits = 128;
constexpr int kCombineSplitsPerLane = kMaxCombineSplits / 32;

template <class T>
__global__ void __launch_bounds__(256)
flash_fwd_combine_kernel(const float* __restrict__ o_partial, const float* __restrict__ lse_partial,
                         u16* __restrict__ out, float* __restrict__ lse, i64 o_batch_stride, i64 o_row_stride,
                         i64 o_head_stride, int num_splits, int batch, int nheads, int seqlen_q, int head_dim) {
    const i64 row_id = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;  // over (b, h, i)
    const int lane = threadIdx.x % 32;
    const i64 rows = (i64)batch * nheads * seqlen_q;
    if (row_id >= rows) return;
    const i64 split_stride = rows;  // partial buffers are (split, b, h, i[, d]) contiguous
    float split_lse[kCombineSplitsPerLane];
    float lse_max = -CF_INF;
#pragma unroll
    for (int k = 0; k < kCombineSplitsPerLane; ++k) {
        const int s = lane + 32 * k;
        split_lse[k] = s < num_splits ? lse_partial[s * split_stride + row_id] : CF_INF;
        if (split_lse[k] != CF_INF) lse_max = fmaxf(lse_max, split_lse[k]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) lse_max = fmaxf(lse_max, shfl_xor(lse_max, offset));
    const bool empty = lse_max == -CF_INF;
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kCombineSplitsPerLane; ++k)
        if (split_lse[k] != CF_INF) total += __expf(split_lse[k] - lse_max);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) total += shfl_xor(total, offset);
    const float row_lse = empty ? CF_INF : lse_max + __logf(total);
    float weight[kCombineSplitsPerLane];  // of split lane + 32 k
#pragma unroll
    for (int k = 0; k < kCombineSplitsPerLane; ++k)
        weight[k] = split_lse[k] == CF_INF || empty ? 0.f : __expf(split_lse[k] - row_lse);

    const int b = (int)(row_id / ((i64)nheads * seqlen_q));
    const int h = (int)((row_id / seqlen_q) % nheads);
    const int i = (int)(row_id % seqlen_q);
    if (lane == 0) lse[row_id] = row_lse;
    u16* dst = out + b * o_batch_stride + (i64)i * o_row_stride + h * o_head_stride;
    // Every lane runs every pass (the shuffles need the whole warp); lanes past the columns idle.
    // The partials' rows hold fp32_cols(head_dim) columns, a multiple of 8 (zeros past head_dim).
    const int cols = fp32_cols(head_dim);
    for (int c0 = 0; c0 < cols; c0 += 128) {
        const int c = c0 + 4 * lane;
        const bool active = c < cols;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        const float* o_col = o_partial + row_id * cols + c;
        // Groups of 8 splits: 8 loads in flight before the first is used. Split indices past the
        // last are clamped (a valid address) and carry weight 0.
#pragma unroll
        for (int k = 0; k < kCombineSplitsPerLane; ++k) {
            for (int j0 = 0; j0 < 32 && 32 * k + j0 < num_splits; j0 += 8) {
                float4 o[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const i64 s = min(32 * k + j0 + j, num_splits - 1);
                    o[j] = active ? *reinterpret_cast<const float4*>(o_col + s * split_stride * cols)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float w = __shfl_sync(0xffffffffu, weight[k], j0 + j);
                    acc.x += w * o[j].x, acc.y += w * o[j].y, acc.z += w * o[j].z, acc.w += w * o[j].w;
                }
            }
        }
        if (active) {
            uint2 packed;
            packed.x = T::pack(acc.x, acc.y);
            packed.y = T::pack(acc.z, acc.w);
            if constexpr (kVecBytes == 16) {
                *reinterpret_cast<uint2*>(dst + c) = packed;
            } else {
                const u32 w[2] = {packed.x, packed.y};
                store_run_global(dst + c, w, c, head_dim);
            }
        }
    }
}
