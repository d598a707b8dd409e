// FlashAttention-2 backward, main kernel: one thread block per (key block, query head, batch),
// looping over the query blocks that can see its keys. Each warp owns 16 keys.
//
// Per query block (P rebuilt from the saved LSE, so no N x N matrix is ever stored):
//   S^T = K Q^T;  P^T = exp(scale * S^T - LSE);  dV += P^T dO
//   dP^T = V dO^T;  dS^T = P^T * (dP^T - D);  dK += dS^T Q
//   dQ += dS K   (dS^T goes through shared memory; the fp32 dQ partial sums are staged in shared
//                memory and added to a global accumulator, see mma_sync/dq_staging.cuh)
// The template flags select which gradients a launch produces: for large head dims dV and dK are
// produced by two launches (register budget), and deterministic mode leaves dQ to mma_sync/flash_bwd_dq.cu.
#include "common/ptx.cuh"
#include "mma_sync/swizzled_tile.cuh"
#include "mma_sync/tile_copy.cuh"
#include "common/block_mask.cuh"
#include "common/variant.cuh"
#include "mma_sync/warp_gemm.cuh"
#include "mma_sync/score_ops.cuh"
#include "mma_sync/dq_staging.cuh"
#include "mma_sync/bwd_common.cuh"

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kDq>
struct BwdTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kQTiles = kBlockM / 8;  // 8-query column tiles of S^T
    static constexpr int kDTiles = kHeadDim / 8;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;  // Q and dO
    using KTile = SwizzledTile<kBlockN, kHeadDim>;  // K and V
    using DsTile = SwizzledTile<kBlockN, kBlockM>;  // dS^T
    using DqStage = DqStaging<kBlockM, kHeadDim, true>;
    static constexpr int kQStageBytes = 2 * QTile::kBytes + 2 * kBlockM * 4;  // Q, dO, LSE, D
    static constexpr int kSmemBytes =
        2 * KTile::kBytes + kStages * kQStageBytes + (kDq ? DsTile::kBytes + DqStage::kBytes : 0);
    // dQ = dS K: warps split the (kBlockM x kHeadDim) product into 16-row tiles x column groups.
    static constexpr int kDqRowTiles = kBlockM / 16;
    static constexpr int kDqColGroups = kNWarps / kDqRowTiles;
    static constexpr int kDqCols = kHeadDim / kDqColGroups;
    static constexpr int kDqChunk = kDqCols % 32 == 0 ? 32 : 16;  // dQ accumulator: 16 or 8 registers
    static_assert(kBlockN == 16 * kNWarps, "each warp owns 16 keys");
    static_assert(kBlockM % 32 == 0 && kHeadDim % 32 == 0, "tile shape");
    static_assert(!kDq || (kNWarps % kDqRowTiles == 0 && kHeadDim % kDqColGroups == 0 && kDqCols % 16 == 0),
                  "dQ work split");
    static_assert(kStages >= 1 && kStages <= 2, "one or two Q/dO stages");
};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal, bool kVariant,
          bool kDv, bool kDk, bool kDq, bool kFloatDkv>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_kernel(CF_BWD_MAIN_PARAMS) {
    using Tr = BwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kDq>;
    static_assert(kDv || kDk, "a launch must produce dV or dK");
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z, kv_head = head / kv_group;
    const VariantArgs va = CF_VARIANT_ARGS;
    const SeqRange seq = SeqRange::make<kVariant>(va, batch, gridDim.y, seqlen_q, seqlen_k);
    const int key0 = n_block * kBlockN, keys_left = seq.seqlen_k - key0;
    if (kVariant && keys_left <= 0) return;  // varlen: past this sequence's end
    const auto mask = make_mask<kCausal, kVariant>(seq, va);
    const ScoreMod mod = ScoreMod::make(va, softmax_scale, batch, head, seq.seqlen_k - seq.seqlen_q);
    const Dropout drop = va.dropout();
    const int bh = batch * gridDim.y + head;
    const float kLog2e = 1.4426950408889634f;

    const u32 k_smem = smem_addr(smem), v_smem = k_smem + Tr::KTile::kBytes;
    const u32 stage0 = v_smem + Tr::KTile::kBytes;
    const u32 ds_smem = stage0 + kStages * Tr::kQStageBytes;
    const typename Tr::DqStage dq_stage{ds_smem + Tr::DsTile::kBytes, fp32_cols(head_dim) * 4};
    const float* stage_floats = reinterpret_cast<const float*>(smem + 2 * Tr::KTile::kBytes + 2 * Tr::QTile::kBytes);

    const u16* q_head = q + batch * q_batch_stride + head * q_head_stride + (i64)seq.q_start * q_row_stride;
    const u16* do_head = dout + batch * do_batch_stride + head * do_head_stride + (i64)seq.q_start * do_row_stride;
    const float* lse_head = lse + seq.lse_offset(head);
    const float* delta_head = delta + seq.lse_offset(head);
    const int m_begin = mask.query_block_begin(n_block, kBlockM, kBlockN);
    const int m_end = mask.query_block_end(n_block, kBlockM, kBlockN);

    // K and V stay resident; Q, dO and their row vectors (LSE, D) stream through kStages stages.
    TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, k_row_stride)
        .load(k_smem, k + batch * k_batch_stride + kv_head * k_head_stride + ((i64)seq.k_start + key0) * k_row_stride,
              keys_left, head_dim);
    if (kDk)
        TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, v_row_stride)
            .load(v_smem, v + batch * v_batch_stride + kv_head * v_head_stride + ((i64)seq.k_start + key0) * v_row_stride,
                  keys_left, head_dim);
    const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> q_loader(tid, q_row_stride);
    const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> do_loader(tid, do_row_stride);
    auto load_query_block = [&](int m_block) {
        if (m_block < m_end) {
            const u32 stage = stage0 + ((m_block - m_begin) % kStages) * Tr::kQStageBytes;
            const int row0 = m_block * kBlockM, rows_left = seq.seqlen_q - row0;
            load_query_stage<typename Tr::QTile, kBlockM, Tr::kThreads>(
                stage, q_loader, do_loader, q_head + (i64)row0 * q_row_stride, do_head + (i64)row0 * do_row_stride,
                lse_head, delta_head, row0, rows_left, head_dim, tid);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) load_query_block(m_begin + s);  // K, V ride in the first group
    if (kStages == 1) cp_async_commit();

    float acc_dk[1][Tr::kDTiles][4], acc_dv[1][Tr::kDTiles][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    const LdsmCursor<typename Tr::KTile> k_as_a(k_smem, warp * 16 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    const LdsmCursor<typename Tr::KTile> v_as_a(v_smem, warp * 16 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    const LdsmCursor<typename Tr::KTile> k_as_b(k_smem, ldsm_a_row(lane), ldsm_a_chunk(lane));  // trans: rows = keys
    const LdsmCursor<typename Tr::DsTile> ds_as_at(ds_smem, ldsm_bt_row(lane), ldsm_bt_chunk(lane));

    for (int m_block = m_begin; m_block < m_end; ++m_block) {
        const int it = m_block - m_begin, stage_idx = it % kStages;
        const u32 q_smem = stage0 + stage_idx * Tr::kQStageBytes, do_smem = q_smem + Tr::QTile::kBytes;
        const float* lse_rows = stage_floats + stage_idx * (Tr::kQStageBytes / 4);
        const float* delta_rows = lse_rows + kBlockM;
        if (kStages == 1) {
            __syncthreads();  // the single stage is free again
            load_query_block(m_block);
        }
        cp_async_wait<0>();
        __syncthreads();
        if (kStages == 2) load_query_block(m_block + 1);

        // P^T = exp2(S^T * scale_log2 - LSE * log2 e), zero where masked. Variant kernels with a
        // score modifier turn S^T into logits first (scale_log2 is then log2 e) and keep the
        // softcap's derivative for dS.
        // The softcap derivative (1 - tanh^2, in [0, 1]) is kept as packed fp16 pairs: half the
        // registers, and no coarser than the 16-bit dS it scales.
        float p[1][Tr::kQTiles][4];
        u32 dtanh[Tr::kQTiles][2];
        zero_acc(p);
        gemm_abt<T, 1, Tr::kQTiles, kHeadDim / 16>(p, k_as_a, LdsmCursor<typename Tr::QTile>(q_smem, ldsm_bt_row(lane), ldsm_bt_chunk(lane)));
        const bool needs_mask = mask.tile_needs_mask(m_block, n_block, kBlockM, kBlockN);
#pragma unroll
        for (int nt = 0; nt < Tr::kQTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int col = nt * 8 + (lane % 4) * 2 + (i & 1);
                const int key = key0 + warp * 16 + lane / 4 + (i >= 2 ? 8 : 0);
                float s = p[0][nt][i];
                if (kVariant && mod.active) {
                    float d;
                    s = mod.apply(s, m_block * kBlockM + col, key, &d);
                    if (i % 2 == 0) dtanh[nt][i / 2] = Fp16::pack(d, 0.f);
                    else dtanh[nt][i / 2] = (dtanh[nt][i / 2] & 0xffffu) | (Fp16::pack(0.f, d) & 0xffff0000u);
                }
                float pv = fast_exp2(fmaf(s, scale_log2, -lse_rows[col] * kLog2e));
                if (needs_mask && !mask.visible_in_range(m_block * kBlockM + col, key)) pv = 0.f;
                p[0][nt][i] = pv;
            }
        // Dropout: bit nt * 4 + i of `kept` says whether entry (nt, i) survives. dV needs P * Z
        // and dS needs P itself, so variant kernels producing both run the dV product after dS.
        const bool dropping = kVariant && drop.active();
        u32 kept = ~0u;
        if (dropping) {
            static_assert(Tr::kQTiles * 4 <= 32, "one bit per fragment entry");
            // This lane's keys lane / 4 and lane / 4 + 8 of one query share a Philox block (a block
            // holds keys 32 g + 8 t + 2 j + e, t = 0..3: common/philox.cuh), and so do the keys of lane ^ 4
            // (lane / 4 differs in its last bit: the same j). Each of the two lanes therefore draws
            // the block of one of its two queries (column e = its lane / 4 parity) and hands it to
            // the other: one draw per four entries instead of two.
            const int key_lo = key0 + warp * 16 + lane / 4;
            const int e_mine = (lane >> 2) & 1;
#pragma unroll
            for (int nt = 0; nt < Tr::kQTiles; ++nt) {
                const Philox4 mine = drop.block(m_block * kBlockM + nt * 8 + (lane % 4) * 2 + e_mine, key_lo, bh);
                Philox4 theirs;
#pragma unroll
                for (int w = 0; w < 4; ++w) theirs.x[w] = shfl_xor_u32(mine.x[w], 4);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    Philox4 r;  // selected word by word: a run-time choice of struct would go to local memory
#pragma unroll
                    for (int w = 0; w < 4; ++w) r.x[w] = e == e_mine ? mine.x[w] : theirs.x[w];
                    bool keep[2];
                    keep_transposed_pair(drop, r, key_lo, keep);
#pragma unroll
                    for (int hi = 0; hi < 2; ++hi)
                        if (!keep[hi]) kept &= ~(1u << (nt * 4 + 2 * hi + e));
                }
            }
        }
        auto drop_p = [&]() {
#pragma unroll
            for (int nt = 0; nt < Tr::kQTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (!((kept >> (nt * 4 + i)) & 1u)) p[0][nt][i] = 0.f;
        };
        const LdsmCursor<typename Tr::QTile> do_as_b(do_smem, ldsm_a_row(lane), ldsm_a_chunk(lane));
        if (kDv && !(kVariant && kDk)) {
            if (dropping) drop_p();
            gemm_rs<T, 1, Tr::kQTiles, Tr::kDTiles>(acc_dv, p, do_as_b);  // dV += (P Z)^T dO
        }
        if (kDk) {
            float ds[1][Tr::kQTiles][4];  // dP^T = V dO^T, then dS^T = P^T * (dP^T - D)
            zero_acc(ds);
            gemm_abt<T, 1, Tr::kQTiles, kHeadDim / 16>(ds, v_as_a, LdsmCursor<typename Tr::QTile>(do_smem, ldsm_bt_row(lane), ldsm_bt_chunk(lane)));
#pragma unroll
            for (int nt = 0; nt < Tr::kQTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float dp = ds[0][nt][i];
                    if (dropping) dp = ((kept >> (nt * 4 + i)) & 1u) ? dp * va.dropout_rescale : 0.f;
                    ds[0][nt][i] = p[0][nt][i] * (dp - delta_rows[nt * 8 + (lane % 4) * 2 + (i & 1)]);
                    if (kVariant && mod.softcap > 0.f)
                        ds[0][nt][i] *= Fp16::to_float((u16)(dtanh[nt][i / 2] >> (16 * (i % 2))));
                }
            if (kVariant && kDv) {
                if (dropping) drop_p();
                gemm_rs<T, 1, Tr::kQTiles, Tr::kDTiles>(acc_dv, p, do_as_b);  // dV += (P Z)^T dO
            }
            gemm_rs<T, 1, Tr::kQTiles, Tr::kDTiles>(acc_dk, ds, LdsmCursor<typename Tr::QTile>(q_smem, ldsm_a_row(lane), ldsm_a_chunk(lane)));
            if constexpr (kDq) {  // constexpr: the dQ path is only instantiated where it exists (sm_90)
#pragma unroll
                for (int nt = 0; nt < Tr::kQTiles; ++nt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = warp * 16 + lane / 4 + 8 * r;
                        *reinterpret_cast<u32*>(smem + (ds_smem - k_smem) + Tr::DsTile::chunk_offset(row, nt) + (lane % 4) * 4) =
                            T::pack(ds[0][nt][2 * r], ds[0][nt][2 * r + 1]);
                    }
                dq_stage.wait_buffer_free(tid);
                __syncthreads();
                // dQ[rows of this warp's tile] = dS K, column chunk by column chunk, into the staging rows.
                const int row_tile = warp % Tr::kDqRowTiles;
                const int col_group = Tr::kDqColGroups == 1 ? 0 : warp / Tr::kDqRowTiles;
                const u32 dq_buf = dq_stage.buffer(it);
#pragma unroll
                for (int c0 = 0; c0 < Tr::kDqCols; c0 += Tr::kDqChunk) {
                    float acc_dq[1][Tr::kDqChunk / 8][4];
                    zero_acc(acc_dq);
                    gemm_atb<T, 1, Tr::kDqChunk / 8, kBlockN / 16>(acc_dq, ds_as_at, 2 * row_tile, k_as_b,
                                                                    (col_group * Tr::kDqCols + c0) / 8);
#pragma unroll
                    for (int ct = 0; ct < Tr::kDqChunk / 8; ++ct)
                        dq_stage.store_fragment(dq_buf, row_tile * 16 + lane / 4,
                                                col_group * Tr::kDqCols + c0 + ct * 8 + (lane % 4) * 2, acc_dq[0][ct]);
                }
                // dq_accum: (batch, head, seqlen_q rounded up to kBlockM, fp32_cols(head_dim)) fp32.
                const i64 dq_rows = (i64)(seq.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
                dq_stage.flush(dq_buf, dq_accum + (((i64)batch * gridDim.y + head) * dq_rows + m_block * kBlockM) *
                                                      fp32_cols(head_dim), tid);
            }
        }
    }
    if (kDq) dq_stage.drain(tid);

    // Epilogue: dK carries the softmax scale (S was scaled); dV carries dropout's 1 / (1 - p).
    const int row0 = key0 + warp * 16;
    const float dv_scale = kVariant && drop.active() ? va.dropout_rescale : 1.f;
    if (kFloatDkv) {
        const i64 rs = (i64)gridDim.y * fp32_cols(head_dim);  // contiguous (batch, seqlen_k, nheads, fp32_cols)
        const i64 base = (seq.k_flat * gridDim.y + head) * fp32_cols(head_dim);
        if (kDk) store_fragment_rows<T, true>(acc_dk, static_cast<float*>(dk) + base, rs, row0, seq.seqlen_k, 0, head_dim, softmax_scale, lane);
        if (kDv) store_fragment_rows<T, true>(acc_dv, static_cast<float*>(dv) + base, rs, row0, seq.seqlen_k, 0, head_dim, dv_scale, lane);
    } else {
        u16* dk_seq = static_cast<u16*>(dk) + batch * dk_batch_stride + kv_head * dk_head_stride + (i64)seq.k_start * dk_row_stride;
        u16* dv_seq = static_cast<u16*>(dv) + batch * dv_batch_stride + kv_head * dv_head_stride + (i64)seq.k_start * dv_row_stride;
        if (kDk) store_fragment_rows<T, false>(acc_dk, dk_seq, dk_row_stride, row0, seq.seqlen_k, 0, head_dim, softmax_scale, lane);
        if (kDv) store_fragment_rows<T, false>(acc_dv, dv_seq, dv_row_stride, row0, seq.seqlen_k, 0, head_dim, dv_scale, lane);
    }
}
