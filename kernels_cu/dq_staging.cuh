// dQ partial sums of one query block leave the main backward kernel through shared memory: the
// warps' MMA fragments are staged there as fp32 rows, then added to the global fp32 accumulator
// whole rows at a time by the bulk-copy engine of sm_90 (one cp.reduce.async.bulk per row instead
// of a scalar atomic per element, which measured 1.4x slower than recomputing dQ in a separate
// kernel). Two buffers let one query block's rows drain while the next block's are computed.
#pragma once
#include "ptx.cuh"

template <int kBlockM, int kHeadDim, int kThreads>
struct DqStaging {
    // +32 bytes per row: the 8 rows of one fragment store then fall into 2 bank wavefronts, not 8.
    static constexpr int kRowBytes = kHeadDim * 4 + 32;
    static constexpr int kBufferBytes = kBlockM * kRowBytes;
    static constexpr int kBytes = 2 * kBufferBytes;
    static_assert(kBlockM <= kThreads, "one issuing thread per staged row");

    u32 base;

    CF_DEVICE u32 buffer(int iteration) const { return base + (iteration & 1) * kBufferBytes; }

    // Call before the barrier that precedes writing buffer(iteration): the rows sent from that
    // buffer two iterations ago must have been read out.
    CF_DEVICE void wait_buffer_free(int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid < kBlockM) bulk_wait_read<1>();
#endif
    }

    // Rows (row, row + 8), columns (col, col + 1) of an MMA accumulator fragment.
    CF_DEVICE void store_fragment(u32 buf, int row, int col, const float (&frag)[4]) const {
        st_shared_f32x2(buf + row * kRowBytes + col * 4, frag[0], frag[1]);
        st_shared_f32x2(buf + (row + 8) * kRowBytes + col * 4, frag[2], frag[3]);
    }

    // Adds the staged rows [0, valid_rows) x [0, head_dim) to dq_rows[row * row_stride + col].
    // Every thread calls it after storing its fragments (it synchronises the block).
    CF_DEVICE void flush(u32 buf, float* dq_rows, i64 row_stride, int valid_rows, int head_dim, int tid) const {
#if CF_HAS_BULK_REDUCE
        fence_proxy_async_smem();
        __syncthreads();
        if (tid < kBlockM) {
            if (tid < valid_rows) bulk_reduce_add_f32(dq_rows + tid * row_stride, buf + tid * kRowBytes, head_dim * 4);
            bulk_commit();
        }
#else
        static_assert(kBlockM < 0, "dQ accumulation in the main backward kernel needs sm_90 (the planner "
                                   "uses the dQ kernel on older GPUs)");
#endif
    }

    // Before the kernel exits: shared memory must outlive the reductions reading it.
    CF_DEVICE void drain(int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid < kBlockM) bulk_wait_all();
#endif
    }
};
