// dQ partial sums of one query block leave the main backward kernel through shared memory: the
// warps' MMA fragments are staged there as fp32 rows, then the whole block (kBlockM rows, contiguous
// in the global accumulator) is added to global memory by one bulk reduction of sm_90's copy
// engine. Per-element fp32 atomics measured 1.4x slower than recomputing dQ in a separate kernel,
// and one bulk operation per row was bound by the number of operations. Two buffers let one query
// block drain while the next is computed; with one (a kernel short of shared memory), the next
// block's stores wait until the reduction has read the buffer out.
#pragma once
#include "common/ptx.cuh"
#include "common/dq_layout.cuh"

// Unswizzled, unpadded rows put the 8 rows of a fragment store on the same banks (8 wavefronts per
// warp store instead of 2). Two cures, both mirrored by the host (cuflash2/families/mma_sync/kernel_config.py):
//   kSwizzle: permute columns as swizzled_col says (KernelConfig.dq_column_swizzle, undone by the
//     convert kernel). Costs registers: a store's offset is no longer an immediate.
//   kPadBytes: bytes after each row, in shared memory and in the global accumulator alike
//     (KernelConfig.dq_row_pitch; the convert kernel reads rows by their stride); with a
//     compile-time row_bytes the offsets stay immediates. A 64-bit store is served per half-warp
//     (4 rows x 32 bytes): with 32 bytes of padding those rows start 8 banks apart and the store
//     takes the minimum 2 wavefronts; with 16 bytes they start 4 banks apart and it takes 4, unless
//     kRowInterleave stages the 4 rows of a half-warp two rows apart (dq_staged_row): 8 banks again,
//     at no cost in registers (a thread's rows keep one offset), undone by the convert kernel.
// kBufferStride: bytes from one buffer to the other; by default they are adjacent (kBytes in all),
// but a kernel short of shared memory can stage dQ over memory of its own that is free by then, or
// use one buffer (stride 0) and wait for each reduction to read it out (mma_sync/flash_bwd_fused.cu).
template <int kBlockM, int kHeadDim, bool kSwizzle, int kPadBytes = 0,
          int kBufferStride = kBlockM * (kHeadDim * 4 + kPadBytes), bool kRowInterleave = false>
struct DqStaging {
    static constexpr int kBufferBytes = kBlockM * (kHeadDim * 4 + kPadBytes);
    static constexpr int kBytes = (kBufferStride == 0 ? 1 : 2) * kBufferBytes;  // both buffers, or the one
    static_assert(kBufferStride >= kBufferBytes || kBufferStride == 0, "two buffers that do not overlap, or one");
    static_assert(kPadBytes % 16 == 0 && !(kSwizzle && kPadBytes), "bulk copies move 16-byte units; one cure");
    static_assert(!kRowInterleave || kBlockM % 8 == 0, "whole groups of 8 rows");

    u32 base;
    int row_bytes;  // pitch of the staged rows and of the global accumulator's (head_dim * 4, or the
                    // kernel's width * 4 + kPadBytes)

    CF_DEVICE u32 buffer(int iteration) const { return base + (iteration & 1) * kBufferStride; }

    // Call before the barrier that precedes writing buffer(iteration): the reduction issued from
    // that buffer two iterations ago must have read it out.
    CF_DEVICE void wait_buffer_free(int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid == 0) bulk_wait_read<1>();
#endif
    }

    // Where a column lands in a staged row, and in the global accumulator, which the bulk reduction
    // fills byte for byte (flash_bwd_convert_kernel undoes it). With kSwizzle, each pair (col, col + 1)
    // moves by 8 * (row % 4) columns, which spreads a fragment store over all 32 banks; only when
    // head_dim is a multiple of 32, so that a moved column stays inside its row.
    CF_DEVICE int swizzled_col(int row, int col) const {
        return dq_swizzled_col(row, col, kSwizzle && row_bytes % 128 == 0 ? 24 : 0);
    }

    // Rows (row, row + 8), columns (col, col + 1) of an MMA accumulator fragment. With unpadded rows
    // (row_bytes = head_dim * 4) columns past head_dim are dropped; padded rows span the kernel's
    // full width, whose columns past head_dim hold zeros (K's zero-filled columns).
    CF_DEVICE void store_fragment(u32 buf, int row, int col, const float (&frag)[4]) const {
        if (col * 4 >= row_bytes - kPadBytes) return;  // (never with the padded rows of full width)
        const int byte = swizzled_col(row, col) * 4;  // the same for row + 8
        const int staged = dq_staged_row(row, kRowInterleave);  // row + 8 lands 8 rows further, too
        st_shared_f32x2(buf + staged * row_bytes + byte, frag[0], frag[1]);
        st_shared_f32x2(buf + (staged + 8) * row_bytes + byte, frag[2], frag[3]);
    }

    // Adds the staged block to dq_block[0 : kBlockM * row_bytes / 4] (rows past the sequence's end
    // land in the accumulator's padding rows; the never-written pad bytes of padded rows add
    // whatever shared memory held into pad columns that nothing reads). Every thread calls it after
    // storing its fragments.
    CF_DEVICE void flush(u32 buf, float* dq_block, int tid) const {
        order_stores_before_bulk();
        __syncthreads();
        issue(buf, dq_block, tid);
    }

    // The two halves of flush, for kernels that already have a barrier between them: every thread
    // that stored fragments calls order_stores_before_bulk, then after a barrier issue() sends the block.
    CF_DEVICE void order_stores_before_bulk() const {
#if CF_HAS_BULK_REDUCE
        fence_proxy_async_smem();
#endif
    }
    CF_DEVICE void issue(u32 buf, float* dq_block, int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid == 0) {
            bulk_reduce_add_f32(dq_block, buf, kBlockM * row_bytes);
            bulk_commit();
        }
#else
        static_assert(kBlockM < 0, "dQ accumulation in the main backward kernel needs sm_90 (the planner "
                                   "uses the dQ kernel on older GPUs)");
#endif
    }

    // Before thread tid's next writes to any buffer a reduction may still be reading (kernels that
    // stage dQ over memory of their own: every issued reduction has read its source).
    CF_DEVICE void wait_all_read(int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid == 0) bulk_wait_read<0>();
#endif
    }

    // Before the kernel exits: shared memory must outlive the reductions reading it.
    CF_DEVICE void drain(int tid) const {
#if CF_HAS_BULK_REDUCE
        if (tid == 0) bulk_wait_all();
#endif
    }
};
