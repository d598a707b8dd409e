// FlashAttention-2 forward: O = softmax(scale * Q K^T) V, one thread block per (query block, head, batch).
//
// Warps split the query block (each warp owns 16 * kMTiles rows), so no reduction crosses warps.
// K and V tiles stream through a kStages-deep ring of shared-memory slots filled by cp.async;
// the sequence of tiles is K_n, V_n, K_(n-1), V_(n-1), ... (key blocks from last to first, so the
// few blocks that need a causal or tail mask come first and every later block runs unmasked).
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "block_mask.cuh"
#include "variant.cuh"
#include "online_softmax.cuh"
#include "warp_gemm.cuh"

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal>
struct FwdTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);  // 16-row MMA tiles per warp
    static constexpr int kNTiles = kBlockN / 8;               // 8-key column tiles of S
    static constexpr int kDTiles = kHeadDim / 8;              // 8-wide column tiles of O
    static constexpr int kWarpRows = 16 * kMTiles;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;
    static constexpr int kSmemBytes = QTile::kBytes + kStages * KVTile::kBytes;
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row tiles");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
    static_assert(kStages >= 2, "the K/V ring needs at least two slots");
};

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

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_fwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 u16* __restrict__ o, float* __restrict__ lse,
                 i64 q_batch_stride, i64 q_row_stride, i64 q_head_stride,
                 i64 k_batch_stride, i64 k_row_stride, i64 k_head_stride,
                 i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride,
                 i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride,
                 int seqlen_q, int seqlen_k, int head_dim, int kv_group, float scale_log2, float softmax_scale,
                 CF_VARIANT_PARAMS) {
    using Tr = FwdTraits<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kCausal>;
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Causal: the last query blocks have the most keys to visit; schedule them first.
    const int m_block = kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / kv_group;
    const VariantArgs va = CF_VARIANT_ARGS;
    const SeqRange seq = SeqRange::make<kVariant>(va, batch, gridDim.y, seqlen_q, seqlen_k);
    if (kVariant && m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence's end
    const auto mask = make_mask<kCausal, kVariant>(seq, va);
    const ScoreMod mod = ScoreMod::make(va, softmax_scale, batch, head, seq.seqlen_k - seq.seqlen_q);

    const u16* q_blk = q + batch * q_batch_stride + head * q_head_stride +
                       ((i64)seq.q_start + m_block * kBlockM) * q_row_stride;
    const u16* k_head = k + batch * k_batch_stride + kv_head * k_head_stride + (i64)seq.k_start * k_row_stride;
    const u16* v_head = v + batch * v_batch_stride + kv_head * v_head_stride + (i64)seq.k_start * v_row_stride;
    u16* o_blk = o + batch * o_batch_stride + head * o_head_stride + ((i64)seq.q_start + m_block * kBlockM) * o_row_stride;
    float* lse_blk = lse + seq.lse_offset(head) + m_block * kBlockM;
    const int rows_left = seq.seqlen_q - m_block * kBlockM;
    const int warp_row0 = warp * Tr::kWarpRows;

    const u32 q_smem = smem_addr(smem);
    const u32 kv_smem = q_smem + Tr::QTile::kBytes;
    // Key blocks n_end - 1 down to n_begin (a sliding window skips the blocks left of it).
    const int n_begin = mask.key_block_begin(m_block, kBlockM, kBlockN);
    const int n_end = mask.key_block_end(m_block, kBlockM, kBlockN);
    const int n_blocks = n_end - n_begin;

    float acc_o[Tr::kMTiles][Tr::kDTiles][4];
    zero_acc(acc_o);
    OnlineSoftmax<Tr::kMTiles, Tr::kNTiles> softmax;
    softmax.init();

    // Tile t of the K/V stream: K of key block n_end-1-t/2 when t is even, V of it when odd.
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> k_loader(tid, k_row_stride);
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> v_loader(tid, v_row_stride);
    auto load_kv_tile = [&](int t) {
        if (t < 2 * n_blocks) {
            const int n_block = n_end - 1 - t / 2;
            const u32 slot = kv_smem + (t % kStages) * Tr::KVTile::kBytes;
            if (t % 2 == 0) k_loader.load(slot, k_head + (i64)n_block * kBlockN * k_row_stride, seq.seqlen_k - n_block * kBlockN, head_dim);
            else v_loader.load(slot, v_head + (i64)n_block * kBlockN * v_row_stride, seq.seqlen_k - n_block * kBlockN, head_dim);
        }
        cp_async_commit();
    };

    if (n_blocks > 0) {
        TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads>(tid, q_row_stride).load(q_smem, q_blk, rows_left, head_dim);
#pragma unroll
        for (int t = 0; t < kStages - 1; ++t) load_kv_tile(t);  // Q rides in the first group

        const LdsmCursor<typename Tr::QTile> q_cur(q_smem, warp_row0 + lane % 16, lane / 16);
        for (int it = 0; it < n_blocks; ++it) {
            const int n_block = n_end - 1 - it, t = 2 * it;
            const LdsmCursor<typename Tr::KVTile> k_cur(kv_smem + (t % kStages) * Tr::KVTile::kBytes,
                                                       (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
            const LdsmCursor<typename Tr::KVTile> v_cur(kv_smem + ((t + 1) % kStages) * Tr::KVTile::kBytes,
                                                       lane % 16, lane / 16);
            cp_async_wait<kStages - 2>();
            __syncthreads();  // K_n landed for all threads; the slot refilled next is no longer read
            load_kv_tile(t + kStages - 1);

            float s[Tr::kMTiles][Tr::kNTiles][4];  // S = Q K^T
            zero_acc(s);
            gemm_abt<T, Tr::kMTiles, Tr::kNTiles, kHeadDim / 16>(s, q_cur, k_cur);

            cp_async_wait<kStages - 2>();
            __syncthreads();  // V_n landed
            load_kv_tile(t + kStages);

            const int row0 = m_block * kBlockM + warp_row0, col0 = n_block * kBlockN;
            if (kVariant && mod.active) apply_score_mod<Tr>(s, mod, row0, col0, lane);
            if (mask.block_needs_mask(m_block, n_block, kBlockM, kBlockN)) apply_mask<Tr>(s, mask, row0, col0, lane);
            softmax.update(s, acc_o, scale_log2);
            gemm_rs<T, Tr::kMTiles, Tr::kNTiles, Tr::kDTiles>(acc_o, s, v_cur);  // O += P V
        }
    }

    // Epilogue: normalise, write LSE, stage O through this warp's own rows of the Q tile (only this
    // warp ever read them) and store it with 16-byte writes.
    float inv_sum[Tr::kMTiles][2], row_lse[Tr::kMTiles][2];
    softmax.finalize(inv_sum, row_lse, scale_log2);
    cp_async_wait<0>();
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            int row = warp_row0 + mt * 16 + lane / 4 + 8 * r;
#pragma unroll
            for (int dt = 0; dt < Tr::kDTiles; ++dt) {
                u32 packed = T::pack(acc_o[mt][dt][2 * r] * inv_sum[mt][r], acc_o[mt][dt][2 * r + 1] * inv_sum[mt][r]);
                *reinterpret_cast<u32*>(smem + Tr::QTile::chunk_offset(row, dt) + (lane % 4) * 4) = packed;
            }
            if (lane % 4 == 0 && row < rows_left) lse_blk[row] = row_lse[mt][r];
        }
    __syncwarp();
    store_tile<typename Tr::QTile, Tr::kWarpRows, kHeadDim, 32>(smem, warp_row0, o_blk + warp_row0 * o_row_stride,
                                                                 o_row_stride, rows_left - warp_row0, head_dim, lane);
}
