// FlashAttention-2 backward in one kernel (sm_90): dK, dV and dQ from a single pass, with
// FlashAttention-2's warp layout. One thread block per (key block, query head, batch), 8 warps. The
// block's keys form groups of 32 (4 groups of a 128-key block up to head dim 128, 2 groups of a
// 64-key block above); the warps sharing a key group split the other dimension between them
// (column group c of kColGroups): warp w works on key group w % kKeyGroups, column group w / kKeyGroups.
// Causal grids take the grouped order (BlockGrid, common/block_mask.cuh). Per query block of kBlockM rows:
//   S^T = K Q^T, dP^T = V dO^T                 keys of the group x queries of column group c
//   P^T = exp(scale S^T - LSE), dS^T = P^T (dP^T - D)  -> shared memory (16-bit), for every warp
//   dV += P^T dO, dK += dS^T Q                 keys of the group x head-dim columns of column group c
//                                              (interleaved by tile pairs at head dims 96 and 192:
//                                              ColumnShare, mma_sync/swizzled_tile.cuh)
//   dQ  = dS K                                 32 query rows (16 at head dim 96) x a column group
//                                              per warp, staged in fp32 and added to the global
//                                              accumulator by one bulk reduction per query block
//                                              (mma_sync/dq_staging.cuh)
// Every fragment read from shared memory feeds two 16-row MMA tiles (the dQ product's dS fragments
// one, at head dim 96); the main backward kernel (mma_sync/flash_bwd.cu, one 16-key tile per warp) feeds
// one, and recomputes S and dP for dQ in a second kernel.
// Plain attention only (causal or not, MHA or GQA); the optional features use mma_sync/flash_bwd.cu.
#include "common/ptx.cuh"
#include "mma_sync/swizzled_tile.cuh"
#include "mma_sync/tile_copy.cuh"
#include "common/block_mask.cuh"
#include "common/variant.cuh"
#include "mma_sync/warp_gemm.cuh"
#include "mma_sync/dq_staging.cuh"
#include "mma_sync/bwd_common.cuh"

template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct FusedBwdTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpKeys = 32;                     // two MMA row tiles
    static constexpr int kKeyGroups = kBlockN / kWarpKeys;
    static constexpr int kColGroups = kNWarps / kKeyGroups;  // warps sharing a key group
    static constexpr int kSTiles = kBlockM / kColGroups / 8;  // 8-query tiles of a warp's S^T part
    static constexpr int kDTiles = kHeadDim / kColGroups / 8; // 8-column tiles of a warp's dK/dV part
    // dQ = dS K: each warp computes kDqWarpRows query rows x kDqTiles 8-column tiles. 32 rows unless
    // that leaves an odd number of tiles per warp (head dim 96: 3), then 16 rows (FA2's d96 layout:
    // 4 x 2 warps over 64 x 96).
    static constexpr int kDqTilesAt32Rows = kHeadDim / (kNWarps / (kBlockM / 32)) / 8;
    static constexpr int kDqWarpRows = kDqTilesAt32Rows % 2 == 0 ? 32 : 16;
    static constexpr int kDqMTiles = kDqWarpRows / 16;
    static constexpr int kDqRowGroups = kBlockM / kDqWarpRows;
    static constexpr int kDqColGroups = kNWarps / kDqRowGroups;
    static constexpr int kDqTiles = kHeadDim / kDqColGroups / 8;
    // The columns of a warp's dK / dV (kDTiles of column group c) and dQ (kDqTiles) parts: contiguous,
    // or interleaved by tile pairs at head dims 96 and 192 (6 tiles a warp; see ColumnShare).
    using DkvCols = ColumnShare<kDTiles, kColGroups, SwizzledTile<kBlockM, kHeadDim>::kChunksPerRow>;
    using DqCols = ColumnShare<kDqTiles, kDqColGroups, SwizzledTile<kBlockN, kHeadDim>::kChunksPerRow>;
    // Head dim 64: P^T stays in registers (16-bit) through the dP product, for dS^T, and masking
    // waits until after the exponentials, so that no branch separates those from the S^T product:
    // the compiler then overlaps the exponentials with the product's MMAs, as FA2's build does
    // (ncu: the exponentials ran as a phase of their own while the tensor cores idled;
    // 1.035-1.067x; docs/design-notes.md, 'Backward pipeline'). Above 64 that spills or measured
    // slower (d128: 0.97x); there dS^T reads P^T back.
    static constexpr bool kPInRegisters = kHeadDim <= 64;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;  // Q and dO
    using KTile = SwizzledTile<kBlockN, kHeadDim>;  // K and V
    using PTile = SwizzledTile<kBlockN, kBlockM>;   // P^T and dS^T
    // dQ staging without bank conflicts (mma_sync/dq_staging.cuh): padding after each row, a compile-time pitch
    // of the kernel's width; the host allocates the accumulator alike (KernelConfig.dq_row_pitch).
    // A fragment store (st.shared.v2: 4 rows of 32 bytes per half-warp) is conflict-free when rows
    // start 8 banks apart, i.e. 32 bytes of padding; 16 bytes leave it 2-way (4 wavefronts instead of
    // 2, ncu: 25% of the d64 kernel's shared-store wavefronts). Where 32 bytes would cost the kernel
    // its own two dQ buffers (d128: 2 KB short), it keeps 16 and interleaves rows (kDqRowInterleave).
    // (The column swizzle costs registers: from head dim 128 up, and with 128-row query blocks, it spills.)
    static constexpr int kPlainStageBytes = 2 * QTile::kBytes + 2 * kBlockM * 4;  // Q, dO, LSE, D
    static constexpr int kFixedBytes = 2 * KTile::kBytes + 2 * PTile::kBytes;     // K, V, P^T, dS^T
    static constexpr int kSmemLimit = 227 * 1024;  // sm_90's per-block opt-in maximum (d128 uses all of it)
    static constexpr int kOwnDqBuffersBase = kFixedBytes + 2 * kPlainStageBytes + 2 * kBlockM * kHeadDim * 4;
    static constexpr int kDqPadBytes =
        kOwnDqBuffersBase + 2 * kBlockM * 16 <= kSmemLimit && kOwnDqBuffersBase + 2 * kBlockM * 32 > kSmemLimit ? 16 : 32;
    static constexpr int kDqRowBytes = kHeadDim * 4 + kDqPadBytes;
    // dQ staging: two fp32 buffers of its own where they fit next to K, V, two Q/dO stages and P^T
    // / dS^T (kDqBuffers = 2: d128), one where only one fits (d64 with 128-row blocks: 32 + 66 + 64
    // + 36 KB; d192), else over the stage just consumed (kDqInStage, d256: 64 + 129 + 16 KB leave
    // no room: its Q, dO, LSE and D bytes take the fp32 dQ rows, the padding a little more; one
    // barrier more per block, before dQ). With one buffer or in-stage, the copy engine must have
    // read the previous block's dQ out before the P/dS barrier (see the loop). One buffer instead
    // of in-stage measured 1.03-1.04x at d64 and 1.07-1.09x at d192 (docs/design-notes.md, 'dQ
    // staging').
    static constexpr int kDqBufferBytes = kBlockM * kDqRowBytes;
    static constexpr int kDqBuffers = kFixedBytes + 2 * kPlainStageBytes + 2 * kDqBufferBytes <= kSmemLimit ? 2
                                      : kFixedBytes + 2 * kPlainStageBytes + kDqBufferBytes <= kSmemLimit  ? 1
                                                                                                         : 0;
    static constexpr bool kDqInStage = kDqBuffers == 0;
    static constexpr int kQStageBytes = cmax(kPlainStageBytes, kDqInStage ? kDqBufferBytes : 0);
    // With 16 bytes of padding, the staged rows are interleaved within groups of 8 so that the four
    // rows of a half-warp's store still start 8 banks apart (mma_sync/dq_staging.cuh; host:
    // KernelConfig.dq_row_interleave).
    static constexpr bool kDqRowInterleave = kDqPadBytes == 16;
    using DqStage = DqStaging<kBlockM, kHeadDim, false, kDqPadBytes,
                              kDqInStage ? kQStageBytes : kDqBuffers == 2 ? kDqBufferBytes : 0, kDqRowInterleave>;
    static constexpr int kSmemBytes = kFixedBytes + 2 * kQStageBytes + kDqBuffers * kDqBufferBytes;
    static_assert(kNWarps == 8 && kBlockN % kWarpKeys == 0 && kNWarps % kKeyGroups == 0, "32-key warps, 8 of them");
    static_assert(kQStageBytes % 128 == 0 && kSmemBytes <= kSmemLimit, "stages stay aligned, and fit");
    static_assert(kSTiles % 2 == 0 && kDTiles % 2 == 0 && kDqTiles % 2 == 0 && kDqColGroups * kDqRowGroups == kNWarps,
                  "tile shape");
};

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kCausal, bool kFloatDkv>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_fused_kernel(CF_BWD_MAIN_PARAMS) {
    using Tr = FusedBwdTraits<kHeadDim, kBlockM, kBlockN, kNWarps>;
    // dQ = dS K is computed kDqChunk 8-column tiles at a time. Wider passes give the tensor cores
    // more independent accumulators per k-step (the product is latency-bound with 2 tiles) and
    // reload the dS fragments less often, but keep more registers live: 4 tiles measured 1.04-1.10x
    // at head dims 64 and 128 once the P^T / dS^T stores (stmatrix) and the loop-invariant addresses
    // stopped taking registers (docs/design-notes.md, 'dQ staging'). Warps of 6 tiles (head dims 96 and 192)
    // take all 6 in one pass: in 3 passes of 2 the d192 product re-read its dS fragments 3 times
    // (13.6% more ldmatrix than FA2's kernel under ncu), and one pass still compiles spill-free.
    constexpr int kDqChunk = Tr::kDqTiles % 4 == 0 ? 4 : Tr::kDqTiles;
    constexpr bool kSplitPrologue = kCausal || kHeadDim > 128;  // (see the prologue)
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int key_group = warp % Tr::kKeyGroups, col_group = warp / Tr::kKeyGroups;
    using Grid = BlockGrid<kCausal>;  // causal: the first (longest) key blocks of a chunk of groups start first
    const Grid at = Grid::here(nheads);
    const int n_block = at.block, head = at.head, batch = at.batch, kv_head = head / kv_group;
    const VariantArgs va = CF_VARIANT_ARGS;
    const SeqRange seq = SeqRange::make<false>(va, batch, Grid::heads(nheads), seqlen_q, seqlen_k);
    const auto mask = make_mask<kCausal, false>(seq, va);
    const int key0 = n_block * kBlockN, keys_left = seq.seqlen_k - key0;
    const float kLog2e = 1.4426950408889634f;

    const u32 k_smem = smem_addr(smem), v_smem = k_smem + Tr::KTile::kBytes;
    const u32 stage0 = v_smem + Tr::KTile::kBytes;
    const u32 pt_smem = stage0 + 2 * Tr::kQStageBytes, dst_smem = pt_smem + Tr::PTile::kBytes;
    const typename Tr::DqStage dq_stage{Tr::kDqInStage ? stage0 : dst_smem + Tr::PTile::kBytes, Tr::kDqRowBytes};

    // Per-block addresses are recomputed where used (a few integer ops) rather than kept live
    // through the loop next to the dK / dV accumulators.
    // dq_accum: (batch, head, seqlen_q rounded up to kBlockM, kDqRowBytes / 4) fp32
    auto dq_block = [&](int m_block) {
        const i64 rows = (i64)(seq.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
        return dq_accum + (((i64)batch * Grid::heads(nheads) + head) * rows + (i64)m_block * kBlockM) * (Tr::kDqRowBytes / 4);
    };
    const int m_begin = mask.query_block_begin(n_block, kBlockM, kBlockN);
    const int m_end = mask.query_block_end(n_block, kBlockM, kBlockN);

    // K and V stay resident; Q, dO and their row vectors (LSE, D) stream through two stages.
    auto load_query_block = [&](int m_block) {
        if (m_block < m_end) {
            // Loaders built per call: their per-thread offsets are cheap to recompute and would
            // otherwise stay live through the whole loop next to the dK/dV accumulators.
            const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> q_loader(tid, q_row_stride);
            const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> do_loader(tid, do_row_stride);
            const u32 stage = stage0 + ((m_block - m_begin) % 2) * Tr::kQStageBytes;
            const int row0 = m_block * kBlockM, rows_left = seq.seqlen_q - row0;
            const u16* q_head = q + batch * q_batch_stride + head * q_head_stride;
            const u16* do_head = dout + batch * do_batch_stride + head * do_head_stride;
            const float* lse_head = lse + seq.lse_offset(head);
            const float* delta_head = delta + seq.lse_offset(head);
            load_query_stage<typename Tr::QTile, kBlockM, Tr::kThreads>(
                stage, q_loader, do_loader, q_head + (i64)row0 * q_row_stride, do_head + (i64)row0 * do_row_stride,
                lse_head, delta_head, row0, rows_left, head_dim, tid);
        }
        cp_async_commit();
    };
    // Prologue in two groups (kSplitPrologue): K with the first block's Q and LSE (all that S^T and
    // P^T need), then V with its dO and D, which land while the first S^T product runs. Measured
    // about 1.01x (1.01-1.03x at head dim 256) from seqlen 512 to 8k against one group; not taken
    // for non-causal head dims 64 and 128, whose loops the compiler then scheduled worse (0.98-0.99x
    // at 4k; docs/design-notes.md, 'Backward pipeline').
    if (kSplitPrologue && m_begin < m_end) {
        const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> q_loader(tid, q_row_stride);
        const TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads> do_loader(tid, do_row_stride);
        const int row0 = m_begin * kBlockM, rows_left = seq.seqlen_q - row0;
        const u32 values = stage0 + 2 * Tr::QTile::kBytes;  // LSE, then D
        TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, k_row_stride)
            .load(k_smem, k + batch * k_batch_stride + kv_head * k_head_stride + (i64)key0 * k_row_stride, keys_left, head_dim);
        load_query_half<kBlockM, Tr::kThreads>(stage0, values, q_loader,
                                               q + batch * q_batch_stride + head * q_head_stride + (i64)row0 * q_row_stride,
                                               lse + seq.lse_offset(head), row0, rows_left, head_dim, tid);
        cp_async_commit();
        TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, v_row_stride)
            .load(v_smem, v + batch * v_batch_stride + kv_head * v_head_stride + (i64)key0 * v_row_stride, keys_left, head_dim);
        load_query_half<kBlockM, Tr::kThreads>(stage0 + Tr::QTile::kBytes, values + kBlockM * 4, do_loader,
                                               dout + batch * do_batch_stride + head * do_head_stride + (i64)row0 * do_row_stride,
                                               delta + seq.lse_offset(head), row0, rows_left, head_dim, tid);
        cp_async_commit();
    } else if (!kSplitPrologue) {  // one group (the K / V loads are spelled out in both branches:
                                   // shared as lambdas, they changed the d128 build's machine code)
        TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, k_row_stride)
            .load(k_smem, k + batch * k_batch_stride + kv_head * k_head_stride + (i64)key0 * k_row_stride, keys_left, head_dim);
        TileLoader<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(tid, v_row_stride)
            .load(v_smem, v + batch * v_batch_stride + kv_head * v_head_stride + (i64)key0 * v_row_stride, keys_left, head_dim);
        load_query_block(m_begin);
    }

    float acc_dk[2][Tr::kDTiles][4], acc_dv[2][Tr::kDTiles][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    const int warp_key0 = key_group * Tr::kWarpKeys;           // first key of this warp (in the block)
    const int warp_query0 = col_group * (kBlockM / Tr::kColGroups);  // first query of this warp's S^T part
    const LdsmCursor<typename Tr::KTile> k_as_a(k_smem, warp_key0 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    const LdsmCursor<typename Tr::KTile> v_as_a(v_smem, warp_key0 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    const LdsmCursor<typename Tr::PTile> pt_as_a(pt_smem, warp_key0 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    const LdsmCursor<typename Tr::PTile> dst_as_a(dst_smem, warp_key0 + ldsm_a_row(lane), ldsm_a_chunk(lane));
    // This warp's part of P^T / dS^T (keys of the group x queries of column group c), addressed for
    // stmatrix / ldmatrix: pt_frag.at(mt * 16, 2 * np) is tile pair (2 np, 2 np + 1) of row tile mt.
    const auto pt_frag = pt_as_a.template shifted<Tr::kSTiles>(warp_query0 / 8);
    const auto dst_frag = dst_as_a.template shifted<Tr::kSTiles>(warp_query0 / 8);
    // Q / dO read as B for dV and dK: this warp's columns.
    auto dkv_b_operand = [&](u32 tile) {
        return Tr::DkvCols::cursor(LdsmCursor<typename Tr::QTile>(tile, ldsm_a_row(lane), ldsm_a_chunk(lane)), col_group);
    };

    for (int m_block = m_begin; m_block < m_end; ++m_block) {
        const int it = m_block - m_begin;
        const u32 q_smem = stage0 + (it % 2) * Tr::kQStageBytes, do_smem = q_smem + Tr::QTile::kBytes;
        const float* lse_rows = reinterpret_cast<const float*>(smem + (q_smem - k_smem) + 2 * Tr::QTile::kBytes);
        const float* delta_rows = lse_rows + kBlockM;
        if (kSplitPrologue && it == 0) cp_async_wait<1>();  // K, Q and LSE (the prologue's first group)
        else cp_async_wait<0>();
        __syncthreads();  // this stage has landed; P^T / dS^T are free again (and the other stage,
                          // unless it holds the previous block's dQ: kDqInStage)
        if (it > 0) dq_stage.issue(dq_stage.buffer(it - 1), dq_block(m_block - 1), tid);

        // S^T = K Q^T, then P^T = exp2(S^T * scale_log2 - LSE * log2 e), zero where masked, rounded to T
        // and packed in stmatrix order.
        FragPair p16[2][Tr::kSTiles / 2];  // p16[mt][np]: tile pair (2 np, 2 np + 1) of row tile mt
        bool needs_mask;  // (computed after the product: one register less through it)
        {
            float s[2][Tr::kSTiles][4];
            zero_acc(s);
            gemm_abt<T, 2, Tr::kSTiles, kHeadDim / 16>(
                s, k_as_a, LdsmCursor<typename Tr::QTile>(q_smem, warp_query0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2));
            needs_mask = mask.tile_needs_mask(m_block, n_block, kBlockM, kBlockN);
#pragma unroll
            for (int nt = 0; nt < Tr::kSTiles; ++nt) {
                const int col0 = warp_query0 + nt * 8 + (lane % 4) * 2;  // this lane's two queries of tile nt
                const float2 lse2 = *reinterpret_cast<const float2*>(lse_rows + col0);
                const float neg_lse_log2[2] = {-lse2.x * kLog2e, -lse2.y * kLog2e};
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int col = col0 + (i & 1);
                        const int key = key0 + warp_key0 + mt * 16 + lane / 4 + (i >= 2 ? 8 : 0);
                        float pv = fast_exp2(fmaf(s[mt][nt][i], scale_log2, neg_lse_log2[i & 1]));
                        if (!Tr::kPInRegisters && needs_mask && !mask.visible_in_range(m_block * kBlockM + col, key)) pv = 0.f;
                        s[mt][nt][i] = pv;
                    }
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int np = 0; np < Tr::kSTiles / 2; ++np) p16[mt][np] = pack_tile_pair<T>(s[mt][2 * np], s[mt][2 * np + 1]);
        }
        // (kPInRegisters: masked entries are zeroed here, in their 16-bit halves.)
        if (Tr::kPInRegisters && needs_mask) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < Tr::kSTiles; ++nt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {  // rows +0 and +8 of the tile
                        const int query = m_block * kBlockM + warp_query0 + nt * 8 + (lane % 4) * 2;
                        const int key = key0 + warp_key0 + mt * 16 + lane / 4 + r * 8;
                        u32& pair = p16[mt][nt / 2].r[2 * (nt % 2) + r];
                        if (!mask.visible_in_range(query, key)) pair &= 0xffff0000u;
                        if (!mask.visible_in_range(query + 1, key)) pair &= 0x0000ffffu;
                    }
        }
        // P^T goes to shared memory (the dV / dK products need every query of the block), one
        // stmatrix per tile pair.
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int np = 0; np < Tr::kSTiles / 2; ++np) stmatrix_x4(pt_frag.at(mt * 16, 2 * np), p16[mt][np].r);
        // dP^T = V dO^T, then dS^T = P^T * (dP^T - D), to shared memory as well (dS uses the same
        // rounded P as dV).
        if (kSplitPrologue && it == 0) {  // V, dO and D, the prologue's second group
            cp_async_wait<0>();
            __syncthreads();
        }
        float ds[2][Tr::kSTiles][4];
        zero_acc(ds);
        gemm_abt<T, 2, Tr::kSTiles, kHeadDim / 16>(
            ds, v_as_a, LdsmCursor<typename Tr::QTile>(do_smem, warp_query0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2));
        if (!Tr::kPInRegisters) __syncwarp();  // P^T rows stored by other lanes of the warp
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int np = 0; np < Tr::kSTiles / 2; ++np) {
                u32 p_pairs[4];  // (tile 2np, rows +0), (2np, +8), (2np + 1, +0), (2np + 1, +8)
                if (Tr::kPInRegisters) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) p_pairs[j] = p16[mt][np].r[j];
                } else {
                    ldmatrix_x4(pt_frag.at(mt * 16, 2 * np), p_pairs);
                }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int nt = 2 * np + half;
                    const float2 d = *reinterpret_cast<const float2*>(delta_rows + warp_query0 + nt * 8 + (lane % 4) * 2);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const u32 pair = p_pairs[2 * half + r];
                        ds[mt][nt][2 * r] = T::to_float((u16)(pair & 0xffffu)) * (ds[mt][nt][2 * r] - d.x);
                        ds[mt][nt][2 * r + 1] = T::to_float((u16)(pair >> 16)) * (ds[mt][nt][2 * r + 1] - d.y);
                    }
                }
                stmatrix_x4(dst_frag.at(mt * 16, 2 * np), pack_tile_pair<T>(ds[mt][2 * np], ds[mt][2 * np + 1]).r);
            }
        if (Tr::kDqBuffers == 2) {
            dq_stage.wait_buffer_free(tid);  // the reduction from this iteration's buffer, two blocks ago
        } else {
            dq_stage.wait_all_read(tid);  // the reduction issued above has read its buffer (or stage) out
        }
        __syncthreads();  // P^T and dS^T complete
        // The next query block loads now, into the other stage (free since the barrier at the top;
        // in-stage, since the wait for the reduction reading it, above), and lands while dV, dK
        // and dQ are computed. Issued at the top of the iteration instead, the loads' address
        // registers held up the S^T product (ncu: the largest long-scoreboard stalls of the
        // head-dim-128 kernel); here 1.06-1.10x at d128 (docs/design-notes.md, 'Backward pipeline').
        load_query_block(m_block + 1);

        const auto do_as_b = dkv_b_operand(do_smem), q_as_b = dkv_b_operand(q_smem);
        constexpr int kDkvStride = Tr::DkvCols::kPairStride;
        gemm_ab<T, 2, Tr::kDTiles, kBlockM / 16, kDkvStride>(acc_dv, pt_as_a, do_as_b.cursor, do_as_b.chunk0);  // dV += P^T dO
        gemm_ab<T, 2, Tr::kDTiles, kBlockM / 16, kDkvStride>(acc_dk, dst_as_a, q_as_b.cursor, q_as_b.chunk0);    // dK += dS^T Q
        if (Tr::kDqInStage) __syncthreads();  // every warp is done with this stage's Q and dO: dQ goes there
        // dQ = dS K for rows [dq_row0, +kDqWarpRows) of this query block, kDqChunk 8-column tiles at a time
        // (few live registers next to the dK / dV accumulators).
        const u32 dq_buf = dq_stage.buffer(it);
        // This warp's dQ rows and columns, and its operand cursors, are derived here from an opaque
        // copy of the thread id: computed once before the loop they would stay live through all of
        // it next to the accumulators (one of them spilled at head dim 128).
        const int lane_q = opaque_int(threadIdx.x) % 32, warp_q = opaque_int(threadIdx.x) / 32;
        const int dq_row0 = (warp_q % Tr::kDqRowGroups) * Tr::kDqWarpRows;  // first row, column share
        const int dq_share = warp_q / Tr::kDqRowGroups;
        const auto dst_as_at = LdsmCursor<typename Tr::PTile>(dst_smem, ldsm_bt_row(lane_q), ldsm_bt_chunk(lane_q))
                                   .template shifted<Tr::kDqWarpRows / 8>(dq_row0 / 8);  // rows = chunks of dS^T columns
        const auto k_as_b = Tr::DqCols::cursor(  // trans: rows = keys
            LdsmCursor<typename Tr::KTile>(k_smem, ldsm_a_row(lane_q), ldsm_a_chunk(lane_q)), dq_share);
        constexpr int kDqStride = Tr::DqCols::kPairStride;
#pragma unroll
        for (int t0 = 0; t0 < Tr::kDqTiles; t0 += kDqChunk) {
            float acc_dq[Tr::kDqMTiles][kDqChunk][4];
            zero_acc(acc_dq);
            gemm_atb<T, Tr::kDqMTiles, kDqChunk, kBlockN / 16, kDqStride>(acc_dq, dst_as_at, 0, k_as_b.cursor,
                                                                          k_as_b.chunk0 + (t0 / 2) * kDqStride);
#pragma unroll
            for (int mt = 0; mt < Tr::kDqMTiles; ++mt)
#pragma unroll
                for (int nt = 0; nt < kDqChunk; ++nt)
                    dq_stage.store_fragment(dq_buf, dq_row0 + mt * 16 + lane_q / 4,
                                            Tr::DqCols::chunk(dq_share, t0 + nt) * 8 + (lane_q % 4) * 2, acc_dq[mt][nt]);
        }
        dq_stage.order_stores_before_bulk();  // sent after the next barrier
    }
    if (m_end > m_begin) {
        __syncthreads();
        dq_stage.issue(dq_stage.buffer(m_end - 1 - m_begin), dq_block(m_end - 1), tid);
        dq_stage.drain(tid);
    }

    // Epilogue: dK carries the softmax scale (S was scaled). Its indices are recomputed from opaque
    // copies of the thread and block ids: kept from the prologue they would stay live through the
    // loop, where every register is taken by the accumulators and the MMA operands.
    const int tid_e = opaque_int(threadIdx.x), lane_e = tid_e % 32, warp_e = tid_e / 32;
    const Grid at_e = Grid::at(opaque_int(blockIdx.x), opaque_int(blockIdx.y), opaque_int(blockIdx.z), nheads);
    const int head_e = at_e.head, batch_e = at_e.batch;
    const int key0_e = at_e.block * kBlockN, warp_row0 = (warp_e % Tr::kKeyGroups) * Tr::kWarpKeys;
    const int row0 = key0_e + warp_row0;
    const int col_share = warp_e / Tr::kKeyGroups;
    if (kFloatDkv) {
        const i64 rs = (i64)Grid::heads(nheads) * fp32_cols(head_dim);  // contiguous (batch, seqlen_k, nheads, fp32_cols)
        const i64 base = (((i64)batch_e * seqlen_k) * Grid::heads(nheads) + head_e) * fp32_cols(head_dim);
        const int col0 = Tr::DkvCols::chunk(col_share, 0) * 8;
        constexpr int kStride = Tr::DkvCols::kPairStride;
        store_fragment_rows<T, true, kStride>(acc_dk, static_cast<float*>(dk) + base, rs, row0, seqlen_k, col0, head_dim,
                                              softmax_scale, lane_e);
        store_fragment_rows<T, true, kStride>(acc_dv, static_cast<float*>(dv) + base, rs, row0, seqlen_k, col0, head_dim,
                                              1.f, lane_e);
    } else {
        // Staged through the K and V tiles (free once every warp is past the last dQ product; with
        // no query block, once the prologue's copies have landed) and stored with 16-byte writes:
        // stored straight from the fragments, each 32-byte sector took two 16-byte halves (ncu at
        // seqlen 512, where the epilogue weighs most: half of every stored sector unused).
        cp_async_wait<0>();
        __syncthreads();
        stage_fragments<T, typename Tr::KTile, typename Tr::DkvCols>(k_smem, acc_dk, warp_row0, col_share, softmax_scale, lane_e);
        stage_fragments<T, typename Tr::KTile, typename Tr::DkvCols>(v_smem, acc_dv, warp_row0, col_share, 1.f, lane_e);
        __syncthreads();
        const int kv_head_e = head_e / kv_group;
        u16* dk_rows = static_cast<u16*>(dk) + batch_e * dk_batch_stride + kv_head_e * dk_head_stride + (i64)key0_e * dk_row_stride;
        u16* dv_rows = static_cast<u16*>(dv) + batch_e * dv_batch_stride + kv_head_e * dv_head_stride + (i64)key0_e * dv_row_stride;
        store_tile<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(smem, 0, dk_rows, dk_row_stride, seqlen_k - key0_e,
                                                                        head_dim, tid_e);
        store_tile<typename Tr::KTile, kBlockN, kHeadDim, Tr::kThreads>(smem + Tr::KTile::kBytes, 0, dv_rows, dv_row_stride,
                                                                        seqlen_k - key0_e, head_dim, tid_e);
    }
}
