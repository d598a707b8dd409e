// Deterministic dQ: one thread block per (query block, head, batch), looping over key blocks in a
// fixed order and accumulating dQ in registers, so no atomics and bit-identical results.
// Used by deterministic=True (the main backward kernel then skips dQ).
//   S = Q K^T;  P = exp(scale * S - LSE);  dP = dO V^T;  dS = P * (dP - D);  dQ += dS K
#include "common/ptx.cuh"
#include "mma_sync/swizzled_tile.cuh"
#include "mma_sync/tile_copy.cuh"
#include "common/block_mask.cuh"
#include "common/variant.cuh"
#include "mma_sync/warp_gemm.cuh"

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct BwdDqTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kNTiles = kBlockN / 8;
    static constexpr int kDTiles = kHeadDim / 8;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;   // Q and dO
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;  // K and V (two slots each way)
    static constexpr int kSmemBytes = 2 * QTile::kBytes + 2 * KVTile::kBytes;
    static_assert(kBlockM == 16 * kNWarps, "each warp owns 16 query rows");
};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dq_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    const u16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    u16* __restrict__ dq,
                    i64 q_batch_stride, i64 q_row_stride, i64 q_head_stride,
                    i64 k_batch_stride, i64 k_row_stride, i64 k_head_stride,
                    i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride,
                    i64 do_batch_stride, i64 do_row_stride, i64 do_head_stride,
                    i64 dq_batch_stride, i64 dq_row_stride, i64 dq_head_stride,
                    int seqlen_q, int seqlen_k, int head_dim, int kv_group, float scale_log2, float softmax_scale,
                    CF_VARIANT_PARAMS) {
    using Tr = BwdDqTraits<kHeadDim, kBlockM, kBlockN, kNWarps>;
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z, kv_head = head / kv_group;
    const VariantArgs va = CF_VARIANT_ARGS;
    const SeqRange seq = SeqRange::make<kVariant>(va, batch, gridDim.y, seqlen_q, seqlen_k);
    const int row0 = m_block * kBlockM, rows_left = seq.seqlen_q - row0;
    if (kVariant && rows_left <= 0) return;  // varlen: past this sequence's end
    const auto mask = make_mask<kCausal, kVariant>(seq, va);
    const ScoreMod mod = ScoreMod::make(va, softmax_scale, batch, head, seq.seqlen_k - seq.seqlen_q);
    const Dropout drop = va.dropout();
    const int bh = batch * gridDim.y + head;
    const float kLog2e = 1.4426950408889634f;

    const u32 q_smem = smem_addr(smem), do_smem = q_smem + Tr::QTile::kBytes;
    const u32 kv_smem = do_smem + Tr::QTile::kBytes;  // slot 0: K, slot 1: V
    const u16* k_head = k + batch * k_batch_stride + kv_head * k_head_stride + (i64)seq.k_start * k_row_stride;
    const u16* v_head = v + batch * v_batch_stride + kv_head * v_head_stride + (i64)seq.k_start * v_row_stride;
    const int n_begin = mask.key_block_begin(m_block, kBlockM, kBlockN);
    const int n_end = mask.key_block_end(m_block, kBlockM, kBlockN);

    float acc_dq[1][Tr::kDTiles][4];
    zero_acc(acc_dq);
    // This lane's two rows: LSE (log2 units) and D.
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + warp * 16 + lane / 4 + 8 * r;
        const i64 at = seq.lse_offset(head) + row;
        row_lse[r] = row < seq.seqlen_q ? lse[at] * kLog2e : CF_INF;
        row_delta[r] = row < seq.seqlen_q ? delta[at] : 0.f;
    }

    if (n_end > n_begin) {
        const i64 q_row = (i64)seq.q_start + row0;
        TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads>(tid, q_row_stride)
            .load(q_smem, q + batch * q_batch_stride + head * q_head_stride + q_row * q_row_stride, rows_left, head_dim);
        TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads>(tid, do_row_stride)
            .load(do_smem, dout + batch * do_batch_stride + head * do_head_stride + q_row * do_row_stride, rows_left, head_dim);
        const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> k_loader(tid, k_row_stride);
        const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> v_loader(tid, v_row_stride);
        const LdsmCursor<typename Tr::QTile> q_as_a(q_smem, warp * 16 + ldsm_a_row(lane), ldsm_a_chunk(lane));
        const LdsmCursor<typename Tr::QTile> do_as_a(do_smem, warp * 16 + ldsm_a_row(lane), ldsm_a_chunk(lane));
        const LdsmCursor<typename Tr::KVTile> k_as_bt(kv_smem, ldsm_bt_row(lane), ldsm_bt_chunk(lane));
        const LdsmCursor<typename Tr::KVTile> v_as_bt(kv_smem + Tr::KVTile::kBytes, ldsm_bt_row(lane), ldsm_bt_chunk(lane));
        const LdsmCursor<typename Tr::KVTile> k_as_b(kv_smem, ldsm_a_row(lane), ldsm_a_chunk(lane));

        for (int n_block = n_begin; n_block < n_end; ++n_block) {
            const int key0 = n_block * kBlockN;
            __syncthreads();  // previous K/V fully consumed
            k_loader.load(kv_smem, k_head + (i64)key0 * k_row_stride, seq.seqlen_k - key0, head_dim);
            v_loader.load(kv_smem + Tr::KVTile::kBytes, v_head + (i64)key0 * v_row_stride, seq.seqlen_k - key0, head_dim);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();

            float p[1][Tr::kNTiles][4], ds[1][Tr::kNTiles][4];
            zero_acc(p);
            zero_acc(ds);
            gemm_abt<T, 1, Tr::kNTiles, kHeadDim / 16>(p, q_as_a, k_as_bt);    // S = Q K^T
            gemm_abt<T, 1, Tr::kNTiles, kHeadDim / 16>(ds, do_as_a, v_as_bt);  // dP = dO V^T
            const bool needs_mask = mask.block_needs_mask(m_block, n_block, kBlockM, kBlockN);
            // Dropout draws (common/philox.cuh): a lane's entries of one row in four consecutive 8-key
            // tiles share a block; blocks of 16 keys (kNTiles 2) use half of one.
            constexpr int kDraws = (Tr::kNTiles + 3) / 4;
            Philox4 rnd[2][kDraws];
            if (kVariant && drop.active()) {
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int g = 0; g < kDraws; ++g)
                        rnd[r][g] = drop.block(row0 + warp * 16 + lane / 4 + 8 * r, key0 + g * 32 + (lane % 4) * 2, bh);
            }
#pragma unroll
            for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = i / 2;
                    const int row = row0 + warp * 16 + lane / 4 + 8 * r, col = key0 + nt * 8 + (lane % 4) * 2 + (i & 1);
                    float s = p[0][nt][i], dtanh = 1.f;
                    if (kVariant && mod.active) s = mod.apply(s, row, col, &dtanh);  // logits (scale_log2 = log2 e)
                    float pv = fast_exp2(fmaf(s, scale_log2, -row_lse[r]));
                    if (needs_mask && !mask.visible(row, col)) pv = 0.f;
                    float dp = ds[0][nt][i];
                    if (kVariant && drop.active())  // dS = P * (Z dP / (1 - p) - D)
                        dp = drop.keep(rnd[r][nt / 4], Tr::kNTiles % 4 == 0 ? 2 * (nt % 4) + (i & 1) : Dropout::slot_of(col))
                                 ? dp * va.dropout_rescale : 0.f;
                    ds[0][nt][i] = pv * (dp - row_delta[r]);
                    if (kVariant) ds[0][nt][i] *= dtanh;
                }
            gemm_rs<T, 1, Tr::kNTiles, Tr::kDTiles>(acc_dq, ds, k_as_b);  // dQ += dS K
        }
    }
    // Epilogue: scale and store this warp's rows.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + warp * 16 + lane / 4 + 8 * r;
        if (row >= seq.seqlen_q) continue;
        u16* dst = dq + batch * dq_batch_stride + head * dq_head_stride + ((i64)seq.q_start + row) * dq_row_stride;
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
            const int col = dt * 8 + (lane % 4) * 2;
            if (col < head_dim) {
                const u32 packed = T::pack(acc_dq[0][dt][2 * r] * softmax_scale, acc_dq[0][dt][2 * r + 1] * softmax_scale);
                store_pair_global(dst + col, packed, col, head_dim);
            }
        }
    }
}
