// Backward pre- and post-processing: D = rowsum(dO * O), and the fp32 -> output conversion of the
// gradient accumulators (scaling dQ, summing dK/dV over the query heads of a GQA group).
#include "common/ptx.cuh"
#include "common/dq_layout.cuh"
#include "common/global_io.cuh"
#include "common/row_dot.cuh"

// D[b, h, i] = sum_c dO[b, i, h, c] * O[b, i, h, c] in fp32. 8 lanes per row, 16-byte loads
// (kVecBytes-wide pieces of each 8-column chunk where rows are less aligned; zeros past head_dim).
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256)
flash_bwd_dot_do_o_kernel(const u16* __restrict__ dout, const u16* __restrict__ out, float* __restrict__ delta,
                          i64 do_batch_stride, i64 do_row_stride, i64 do_head_stride,
                          i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride,
                          int seqlen_q, int nheads, int head_dim) {
    const int lane8 = threadIdx.x % 8;
    const i64 row_id = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 8;  // over (head, row) of one batch
    const int batch = blockIdx.y;
    const i64 local = row_id;
    const bool active = local < (i64)nheads * seqlen_q;
    const int head = active ? (int)(local / seqlen_q) : 0, row = active ? (int)(local % seqlen_q) : 0;
    const u16* dop = dout + batch * do_batch_stride + row * do_row_stride + head * do_head_stride;
    const u16* op = out + batch * o_batch_stride + row * o_row_stride + head * o_head_stride;
    const float acc = sum_over_8_lanes(active ? row_dot_part<T>(dop, op, lane8, head_dim) : 0.f);
    if (active && lane8 == 0) delta[((i64)batch * nheads + head) * seqlen_q + row] = acc;
}

// out[b, s, h, c] = scale * sum_{g < group} acc[b, s, h * group + g, c] for an fp32 accumulator
// with the given strides (elements; dQ: (b, h, s, c), GQA dK/dV: (b, s, h * group, c)). A dQ
// accumulator may hold its columns and rows permuted (col_swizzle, row_interleave: common/dq_layout.cuh);
// the row permutation needs the accumulator's rows padded to a multiple of 8. One thread per 4
// columns of a row (16-byte loads, 8-byte stores: the accumulator's rows hold fp32_cols(head_dim)
// columns, a multiple of 8, its strides multiples of 4 floats; the output takes kVecBytes-wide
// stores of the columns below head_dim); a block covers blockDim.x / (cols / 4) rows of one head:
// grid (row blocks, heads, batches), so that no thread divides a 64-bit index. (One thread per
// column pair with 64-bit index arithmetic was compute-bound, at twice FA2's time:
// docs/design-notes.md, 'Backward pipeline'.)
template <class T>
__global__ void __launch_bounds__(256)
flash_bwd_convert_kernel(const float* __restrict__ acc, u16* __restrict__ out,
                         i64 acc_batch_stride, i64 acc_row_stride, i64 acc_head_stride,
                         i64 out_batch_stride, i64 out_row_stride, i64 out_head_stride,
                         int seqlen, int nheads, int head_dim, int group, float scale, int col_swizzle,
                         int row_interleave) {
    const int quads = fp32_cols(head_dim) / 4, rows_per_block = blockDim.x / quads;
    const int local_row = threadIdx.x / quads;
    const int row = blockIdx.x * rows_per_block + local_row, head = blockIdx.y, batch = blockIdx.z;
    if (local_row >= rows_per_block || row >= seqlen) return;
    const int c = (threadIdx.x - local_row * quads) * 4;
    // The column permutation moves pairs by multiples of 8 columns: a quad stays whole.
    const int c_acc = dq_swizzled_col(row, c, col_swizzle);
    const int row_acc = dq_staged_row(row, row_interleave);
    const float* src = acc + batch * acc_batch_stride + row_acc * acc_row_stride + (i64)head * group * acc_head_stride + c_acc;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int g = 0; g < group; ++g) {
        const float4 part = *reinterpret_cast<const float4*>(src + g * acc_head_stride);
        sum.x += part.x;
        sum.y += part.y;
        sum.z += part.z;
        sum.w += part.w;
    }
    const uint2 packed = make_uint2(T::pack(sum.x * scale, sum.y * scale), T::pack(sum.z * scale, sum.w * scale));
    u16* dst = out + batch * out_batch_stride + row * out_row_stride + head * out_head_stride + c;
    if constexpr (kVecBytes == 16) {
        *reinterpret_cast<uint2*>(dst) = packed;
    } else {
        const u32 w[2] = {packed.x, packed.y};
        store_run_global(dst, w, c, head_dim);
    }
}
