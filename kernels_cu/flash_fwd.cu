// FlashAttention-2 forward: O = softmax(scale * Q K^T) V, one thread block per (query block, head, batch).
//
// Warps split the query block (each warp owns 16 * kMTiles rows), so no reduction crosses warps.
// K and V tiles stream through a kStages-deep ring of shared-memory slots filled by cp.async;
// the sequence of tiles is K_n, V_n, K_(n-1), V_(n-1), ... (key blocks from last to first, so the
// few blocks that need a causal or tail mask come first and every later block runs unmasked).
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "block_mask.cuh"
#include "online_softmax.cuh"

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

// S[mt][nt] = Q_warp K^T over the whole head dim, Q and K read from swizzled shared memory.
template <class Tr, class T>
CF_DEVICE void gemm_qk(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const LdsmCursor<typename Tr::QTile>& q_cur,
                       const LdsmCursor<typename Tr::KVTile>& k_cur) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kDTiles / 2; ++kk) {
        u32 a[Tr::kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) ldmatrix_x4(q_cur.at(mt * 16, 2 * kk), a[mt]);
#pragma unroll
        for (int np = 0; np < Tr::kNTiles / 2; ++np) {
            u32 b[4];  // {b0, b1} of key tile 2np, then of key tile 2np + 1
            ldmatrix_x4(k_cur.at(np * 16, 2 * kk), b);
#pragma unroll
            for (int mt = 0; mt < Tr::kMTiles; ++mt) {
                T::mma(s[mt][2 * np], a[mt], b[0], b[1]);
                T::mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// O[mt] += P V: P (probabilities, fp32 accumulators of S) is repacked in registers as the A operand;
// the C layout of two adjacent 8-key tiles is exactly the A layout of one 16-key step.
template <class Tr, class T>
CF_DEVICE void gemm_pv(float (&o)[Tr::kMTiles][Tr::kDTiles][4], const float (&p)[Tr::kMTiles][Tr::kNTiles][4],
                       const LdsmCursor<typename Tr::KVTile>& v_cur) {
#pragma unroll
    for (int ks = 0; ks < Tr::kNTiles / 2; ++ks) {
        u32 a[Tr::kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
            a[mt][0] = T::pack(p[mt][2 * ks][0], p[mt][2 * ks][1]);
            a[mt][1] = T::pack(p[mt][2 * ks][2], p[mt][2 * ks][3]);
            a[mt][2] = T::pack(p[mt][2 * ks + 1][0], p[mt][2 * ks + 1][1]);
            a[mt][3] = T::pack(p[mt][2 * ks + 1][2], p[mt][2 * ks + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < Tr::kDTiles / 2; ++dp) {
            u32 b[4];  // {b0, b1} of output column tile 2dp, then of 2dp + 1
            ldmatrix_x4_trans(v_cur.at(ks * 16, 2 * dp), b);
#pragma unroll
            for (int mt = 0; mt < Tr::kMTiles; ++mt) {
                T::mma(o[mt][2 * dp], a[mt], b[0], b[1]);
                T::mma(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

template <class Tr, bool kCausal>
CF_DEVICE void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const BlockMask<kCausal>& mask, int row0, int col0,
                          int lane) {
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

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_fwd_kernel(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                 u16* __restrict__ o, float* __restrict__ lse,
                 i64 q_batch_stride, i64 q_row_stride, i64 q_head_stride,
                 i64 k_batch_stride, i64 k_row_stride, i64 k_head_stride,
                 i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride,
                 i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride,
                 int seqlen_q, int seqlen_k, int head_dim, int kv_group, float scale_log2) {
    using Tr = FwdTraits<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kCausal>;
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Causal: the last query blocks have the most keys to visit; schedule them first.
    const int m_block = kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / kv_group;
    const BlockMask<kCausal> mask{seqlen_q, seqlen_k};

    const u16* q_blk = q + batch * q_batch_stride + head * q_head_stride + (i64)m_block * kBlockM * q_row_stride;
    const u16* k_head = k + batch * k_batch_stride + kv_head * k_head_stride;
    const u16* v_head = v + batch * v_batch_stride + kv_head * v_head_stride;
    u16* o_blk = o + batch * o_batch_stride + head * o_head_stride + (i64)m_block * kBlockM * o_row_stride;
    float* lse_blk = lse + ((i64)batch * gridDim.y + head) * seqlen_q + m_block * kBlockM;
    const int rows_left = seqlen_q - m_block * kBlockM;
    const int warp_row0 = warp * Tr::kWarpRows;

    const u32 q_smem = smem_addr(smem);
    const u32 kv_smem = q_smem + Tr::QTile::kBytes;
    const int n_end = mask.key_block_end(m_block, kBlockM, kBlockN);

    float acc_o[Tr::kMTiles][Tr::kDTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
    OnlineSoftmax<Tr::kMTiles, Tr::kNTiles> softmax;
    softmax.init();

    // Tile t of the K/V stream: K of key block n_end-1-t/2 when t is even, V of it when odd.
    auto load_kv_tile = [&](int t) {
        if (t < 2 * n_end) {
            int n_block = n_end - 1 - t / 2;
            const u16* src = (t % 2 == 0 ? k_head : v_head) + (i64)n_block * kBlockN * (t % 2 == 0 ? k_row_stride : v_row_stride);
            copy_tile_async<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads>(
                kv_smem + (t % kStages) * Tr::KVTile::kBytes, src, t % 2 == 0 ? k_row_stride : v_row_stride,
                seqlen_k - n_block * kBlockN, head_dim, tid);
        }
        cp_async_commit();
    };

    if (n_end > 0) {
        copy_tile_async<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads>(q_smem, q_blk, q_row_stride, rows_left,
                                                                             head_dim, tid);
#pragma unroll
        for (int t = 0; t < kStages - 1; ++t) load_kv_tile(t);  // Q rides in the first group

        const LdsmCursor<typename Tr::QTile> q_cur(q_smem, warp_row0 + lane % 16, lane / 16);
        for (int it = 0; it < n_end; ++it) {
            const int n_block = n_end - 1 - it, t = 2 * it;
            const LdsmCursor<typename Tr::KVTile> k_cur(kv_smem + (t % kStages) * Tr::KVTile::kBytes,
                                                       (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
            const LdsmCursor<typename Tr::KVTile> v_cur(kv_smem + ((t + 1) % kStages) * Tr::KVTile::kBytes,
                                                       lane % 16, lane / 16);
            cp_async_wait<kStages - 2>();
            __syncthreads();  // K_n landed for all threads; the slot refilled next is no longer read
            load_kv_tile(t + kStages - 1);

            float s[Tr::kMTiles][Tr::kNTiles][4];
            gemm_qk<Tr, T>(s, q_cur, k_cur);

            cp_async_wait<kStages - 2>();
            __syncthreads();  // V_n landed
            load_kv_tile(t + kStages);

            if (mask.block_needs_mask(m_block, n_block, kBlockM, kBlockN))
                apply_mask<Tr, kCausal>(s, mask, m_block * kBlockM + warp_row0, n_block * kBlockN, lane);
            if (it == 0) softmax.template update<true>(s, acc_o, scale_log2);
            else softmax.template update<false>(s, acc_o, scale_log2);
            gemm_pv<Tr, T>(acc_o, s, v_cur);
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
