// FlashAttention-2 forward: O = softmax(scale * Q K^T) V, one thread block per (query block, head, batch).
//
// Warps split the query block (each warp owns 16 * kMTiles rows), so no reduction crosses warps.
// K and V tiles stream through a kStages-deep ring of shared-memory slots filled by cp.async;
// the sequence of tiles is K_n, V_n, K_(n-1), V_(n-1), ... (key blocks from last to first, so the
// few blocks that need a causal or tail mask come first and every later block runs unmasked).
//
// Two entry points share the body: flash_fwd_kernel (dense batches, plain or variant) and
// flash_fwd_kvcache_kernel (flash_attn_with_kvcache: cache lengths, paged K/V, split-KV).
#include "common/ptx.cuh"
#include "mma_sync/swizzled_tile.cuh"
#include "mma_sync/tile_copy.cuh"
#include "common/block_mask.cuh"
#include "common/variant.cuh"
#include "mma_sync/online_softmax.cuh"
#include "mma_sync/warp_gemm.cuh"
#include "mma_sync/score_ops.cuh"

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages_, bool kCausal>
struct FwdTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kStages = kStages_;
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);  // 16-row MMA tiles per warp
    static constexpr int kNTiles = kBlockN / 8;               // 8-key column tiles of S
    static constexpr int kDTiles = kHeadDim / 8;              // 8-wide column tiles of O
    static constexpr int kWarpRows = 16 * kMTiles;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;
    // Tiles whose output accumulator and S take >= 160 of the 255 registers per thread at head dims
    // >= 96, with 32 rows per warp (4 warps x 32 rows with 64-key blocks at head dims 96 and 128)
    // or in causal kernels, whose mask state needs a few more (8 warps x 16 rows with 64-key blocks
    // at head dim 256), are "tight": they run the masked key blocks in a loop of their own and
    // recompute the epilogue's addresses after the loop (flash_fwd_body). With 32 rows per warp
    // that is not enough: those tiles also keep their running row sums (touched once per key block)
    // in shared memory, rebuild the ldmatrix addresses in every key block and load K/V through a
    // LeanTileLoader, at the cost of a few integer instructions per block. Otherwise the compiler
    // keeps all these values live through the key loop and spills. Each measure costs some speed
    // where it is not needed (docs/design-notes.md, 'Register pressure and spills' and 'Forward
    // tiles': the causal head-dim-256 tile measured 1.06x with its row sums back in registers),
    // hence the thresholds. KernelConfig.forward_row_sums_bytes (cuflash2/families/mma_sync/kernel_config.py) mirrors
    // kSumsInSmem.
    static constexpr int kAccRegisters = kMTiles * (kDTiles + kNTiles) * 4;
    // Tiles of 16 rows per warp whose threads load 12 or more 16-byte K/V chunks per block (head dim
    // 256 with 64-key blocks and 4 warps: 16; head dim 192 with 128-key blocks and 8 warps: 12) are
    // tight even when not causal, and rebuild their addresses too: otherwise the loader's addresses
    // spill (8 bytes in that d192 tile, a tuning candidate). The default tiles with 12-15 chunks
    // (d192 64x64 with 4 warps: 12; d224 64x64 on 99 KB parts: 14) keep fewer than 160
    // accumulator registers, so the threshold leaves them as they were.
    static constexpr int kKvChunksPerThread = kBlockN * kHeadDim * 2 / 16 / kThreads;
    static constexpr bool kTightRegisters =
        kDTiles >= 12 && kAccRegisters >= 160 && (kMTiles >= 2 || kCausal || kKvChunksPerThread >= 12);
    static constexpr bool kRebuildAddresses = kTightRegisters && (kMTiles >= 2 || kKvChunksPerThread >= 12);
    static constexpr bool kSumsInSmem = kTightRegisters && kMTiles >= 2;
    static constexpr int kSumsBytes = kSumsInSmem ? kThreads * kMTiles * 2 * 4 : 0;
    static constexpr int kSmemBytes = QTile::kBytes + kStages * KVTile::kBytes + kSumsBytes;
    static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row tiles");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
    static_assert(kStages >= 2, "the K/V ring needs at least two slots");
};

#define CF_FWD_PARAMS                                                                                   \
    const u16 *__restrict__ q, const u16 *__restrict__ k, const u16 *__restrict__ v, u16 *__restrict__ o, \
        float *__restrict__ lse, i64 q_batch_stride, i64 q_row_stride, i64 q_head_stride, i64 k_batch_stride, \
        i64 k_row_stride, i64 k_head_stride, i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride,       \
        i64 o_batch_stride, i64 o_row_stride, i64 o_head_stride, int seqlen_q, int seqlen_k, int head_dim,  \
        int kv_group, float scale_log2, float softmax_scale
#define CF_FWD_ARGS                                                                                      \
    q, k, v, o, lse, q_batch_stride, q_row_stride, q_head_stride, k_batch_stride, k_row_stride, k_head_stride, \
        v_batch_stride, v_row_stride, v_head_stride, o_batch_stride, o_row_stride, o_head_stride, seqlen_q,     \
        seqlen_k, head_dim, kv_group, scale_log2, softmax_scale

// Split-KV: this split's partial output (normalised over its own keys) and LSE, in fp32. Every row
// below rows_left is written, 0 and +inf where the split saw no key (also when it has no key block
// at all): the combine kernel reads every split's rows unconditionally.
template <class Tr>
CF_DEVICE void store_partial(const float (&acc_o)[Tr::kMTiles][Tr::kDTiles][4], const float (&inv_sum)[Tr::kMTiles][2],
                             const float (&row_lse)[Tr::kMTiles][2], float* o_rows, float* lse_rows, int warp_row0,
                             int rows_left, int head_dim, int lane) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + mt * 16 + lane / 4 + 8 * r;
            if (row >= rows_left) continue;
            if (lane % 4 == 0) lse_rows[row] = row_lse[mt][r];
#pragma unroll
            for (int dt = 0; dt < Tr::kDTiles; ++dt) {
                const int col = dt * 8 + (lane % 4) * 2;
                if (col < head_dim) {  // (col + 1 lands in the row's padding for odd head dims: fp32_cols)
                    float* dst = o_rows + (i64)row * fp32_cols(head_dim) + col;
                    dst[0] = acc_o[mt][dt][2 * r] * inv_sum[mt][r];
                    dst[1] = acc_o[mt][dt][2 * r + 1] * inv_sum[mt][r];
                }
            }
        }
}

// Tight tiles: thread `tid`'s running row sums (after the Q tile and the K/V ring).
template <class Tr>
CF_DEVICE float* row_sums_of(char* smem, int tid) {
    return reinterpret_cast<float*>(smem + Tr::QTile::kBytes + Tr::kStages * Tr::KVTile::kBytes) + tid;
}

// Which query block, split, head and batch entry a thread block computes, and that sequence's extent.
struct FwdBlock {
    int m_block, split, head, batch;
    SeqRange seq;
};

// The forward's grid: causal grids take the grouped order (BlockGrid, common/block_mask.cuh), the KV-cache
// grids keep (splits x query blocks, heads, batch).
template <bool kCausal, bool kKvCache>
using FwdGrid = BlockGrid<kCausal && !kKvCache>;

template <int kBlockM, bool kCausal, bool kVariant, bool kKvCache>
CF_DEVICE FwdBlock locate_block(unsigned bx, unsigned by, unsigned bz, int nheads, int seqlen_q, int seqlen_k,
                                const VariantArgs& va, const KvCacheArgs& kc) {
    using Grid = FwdGrid<kCausal, kKvCache>;
    const Grid at = Grid::at(bx, by, bz, nheads);
    FwdBlock b;
    // Split-KV packs (split, query block) into blockIdx.x (grid x = query blocks x splits; seqlen_q is
    // total_q in a paged varlen call, so the query blocks come from the grid).
    const int m_blocks = kKvCache ? (int)(gridDim.x / max(kc.num_splits, 1)) : Grid::blocks();
    b.split = kKvCache ? at.block / m_blocks : 0;
    const int m_index = kKvCache ? at.block % m_blocks : at.block;
    // Causal: the last query blocks have the most keys to visit; schedule them first.
    b.m_block = kCausal ? m_blocks - 1 - m_index : m_index;
    b.head = at.head;
    b.batch = at.batch;
    b.seq = kKvCache ? kvcache_seq_range(kc, va, at.batch, Grid::heads(nheads), seqlen_q)
                     : SeqRange::make<kVariant>(va, at.batch, Grid::heads(nheads), seqlen_q, seqlen_k);
    return b;
}

template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal, bool kVariant,
          bool kKvCache>
CF_DEVICE void flash_fwd_body(CF_FWD_PARAMS, const VariantArgs& va, const KvCacheArgs& kc, int nheads) {
    using Tr = FwdTraits<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kCausal>;
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const FwdBlock blk = locate_block<kBlockM, kCausal, kVariant, kKvCache>(blockIdx.x, blockIdx.y, blockIdx.z, nheads,
                                                                           seqlen_q, seqlen_k, va, kc);
    const int m_block = blk.m_block, split = blk.split, head = blk.head, batch = blk.batch, kv_head = head / kv_group;
    const SeqRange& seq = blk.seq;
    if (kVariant && m_block * kBlockM >= seq.seqlen_q) return;  // varlen: past this sequence's end
    const auto mask = make_mask<kCausal, kVariant>(seq, va);
    const ScoreMod mod = ScoreMod::make(va, softmax_scale, batch, head, seq.seqlen_k - seq.seqlen_q);
    // seqlen_k is 0 when the cache index is out of range, so kv_batch is then never dereferenced.
    const int kv_batch = kKvCache && kc.cache_batch_idx != nullptr ? kc.cache_batch_idx[batch] : batch;
    // (The dropout seed is fetched where it is used: held from here it costs the registers that
    // the head-dim-256 tile does not have.)
    const bool dropping = kVariant && !kKvCache && va.dropout_threshold != 0;
    const bool paged = kKvCache && kc.block_table != nullptr;

    const u16* q_blk = q + batch * q_batch_stride + head * q_head_stride +
                       ((i64)seq.q_start + m_block * kBlockM) * q_row_stride;
    // Paged caches: batch strides are page strides, and rows are found through the page table.
    const u16* k_head = k + (paged ? 0 : kv_batch * k_batch_stride) + kv_head * k_head_stride +
                        (paged ? 0 : (i64)seq.k_start * k_row_stride);
    const u16* v_head = v + (paged ? 0 : kv_batch * v_batch_stride) + kv_head * v_head_stride +
                        (paged ? 0 : (i64)seq.k_start * v_row_stride);
    const int rows_left = seq.seqlen_q - m_block * kBlockM;
    const int warp_row0 = warp * Tr::kWarpRows;

    const u32 q_smem = smem_addr(smem);
    const u32 kv_smem = q_smem + Tr::QTile::kBytes;
    // Key blocks n_end - 1 down to n_begin (a sliding window skips the blocks left of it; split-KV
    // gives each split an equal share of them).
    int n_begin = mask.key_block_begin(m_block, kBlockM, kBlockN);
    int n_end = mask.key_block_end(m_block, kBlockM, kBlockN);
    if (kKvCache && kc.num_splits > 1) {
        const int per_split = (n_end - n_begin + kc.num_splits - 1) / kc.num_splits;
        n_begin += split * per_split;
        n_end = min(n_end, n_begin + per_split);
    }
    const int n_blocks = n_end - n_begin;

    float acc_o[Tr::kMTiles][Tr::kDTiles][4];
    zero_acc(acc_o);
    OnlineSoftmax<Tr::kMTiles, Tr::kNTiles> softmax;
    softmax.init();
    float* row_sums = row_sums_of<Tr>(smem, tid);
    if (Tr::kSumsInSmem) softmax.template store_sums<Tr::kThreads>(row_sums);

    // Tile t of the K/V stream: K of key block n_end-1-t/2 when t is even, V of it when odd.
    // kRebuildAddresses tiles load K and V through a LeanTileLoader (no 64-bit row offsets kept live).
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> k_loader(tid, k_row_stride);
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> v_loader(tid, v_row_stride);
    const LeanTileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> lean_loader(tid);
    const PagedTileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> paged_loader(tid);
    const int* pages = paged ? kc.block_table + batch * kc.block_table_stride : nullptr;
    auto load_kv_tile = [&](int t) {
        if (t < 2 * n_blocks) {
            const int n_block = n_end - 1 - t / 2;
            const u32 slot = kv_smem + (t % kStages) * Tr::KVTile::kBytes;
            const int keys_left = seq.seqlen_k - n_block * kBlockN;
            if (paged) {
                const int first_row = seq.k_start + n_block * kBlockN;
                if (t % 2 == 0)
                    paged_loader.load(slot, k_head, k_batch_stride, k_row_stride, pages, kc.page_size, kc.cache_entries,
                                      first_row, keys_left, head_dim);
                else
                    paged_loader.load(slot, v_head, v_batch_stride, v_row_stride, pages, kc.page_size, kc.cache_entries,
                                      first_row, keys_left, head_dim);
            } else if (t % 2 == 0) {
                const u16* tile = k_head + (i64)n_block * kBlockN * k_row_stride;
                if (Tr::kRebuildAddresses) lean_loader.load(slot, tile, k_row_stride, keys_left, head_dim);
                else k_loader.load(slot, tile, keys_left, head_dim);
            } else {
                const u16* tile = v_head + (i64)n_block * kBlockN * v_row_stride;
                if (Tr::kRebuildAddresses) lean_loader.load(slot, tile, v_row_stride, keys_left, head_dim);
                else v_loader.load(slot, tile, keys_left, head_dim);
            }
        }
        cp_async_commit();
    };

    if (n_blocks > 0) {
        TileLoader<typename Tr::QTile, kBlockM, kHeadDim, Tr::kThreads>(tid, q_row_stride).load(q_smem, q_blk, rows_left, head_dim);
#pragma unroll
        for (int t = 0; t < kStages - 1; ++t) load_kv_tile(t);  // Q rides in the first group

        // One key block: S = Q K^T, mask, online softmax, O += P V.
        auto key_block = [&](int it, bool masked) {
            const int n_block = n_end - 1 - it, t = 2 * it;
            // kRebuildAddresses: an opaque lane id, so that the cursors' swizzled addresses are
            // computed here instead of being hoisted out of the loop (a dozen registers).
            const int lane_c = Tr::kRebuildAddresses ? opaque_int(lane) : lane;
            const LdsmCursor<typename Tr::QTile> q_cur(q_smem, warp_row0 + ldsm_a_row(lane_c), ldsm_a_chunk(lane_c));
            const LdsmCursor<typename Tr::KVTile> k_cur(kv_smem + (t % kStages) * Tr::KVTile::kBytes, ldsm_bt_row(lane_c), ldsm_bt_chunk(lane_c));
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
            // (Masked blocks of the split loop derive their lane offsets anew: kept live from the
            // prologue, they spilled at head dim 256.)
            if (masked) apply_mask<Tr>(s, mask, row0, col0, Tr::kTightRegisters ? opaque_int(lane) : lane);
            if (Tr::kSumsInSmem) softmax.template load_sums<Tr::kThreads>(row_sums);
            softmax.update(s, acc_o, scale_log2);
            if (Tr::kSumsInSmem) softmax.template store_sums<Tr::kThreads>(row_sums);
            if (dropping) apply_dropout<Tr>(s, va.dropout(), batch * FwdGrid<kCausal, kKvCache>::heads(nheads) + head, row0, col0, lane);
            const int lane_v = Tr::kRebuildAddresses ? opaque_int(lane) : lane;
            const LdsmCursor<typename Tr::KVTile> v_cur(kv_smem + ((t + 1) % kStages) * Tr::KVTile::kBytes, ldsm_a_row(lane_v), ldsm_a_chunk(lane_v));
            gemm_rs<T, Tr::kMTiles, Tr::kNTiles, Tr::kDTiles>(acc_o, s, v_cur);  // O += P V
        };
        auto needs_mask = [&](int it) { return mask.block_needs_mask(m_block, n_end - 1 - it, kBlockM, kBlockN); };
        int it = 0;
        if (Tr::kTightRegisters) {
            // Blocks run from the last to the first, so those crossing the key tail or the causal
            // diagonal come first; once one does not, no later one does (sliding windows aside:
            // the variant kernels keep checking). The second loop keeps no mask state live.
            for (; it < n_blocks && needs_mask(it); ++it) key_block(it, true);
            for (; it < n_blocks; ++it) key_block(it, kVariant && needs_mask(it));
        } else {
            for (; it < n_blocks; ++it) key_block(it, needs_mask(it));
        }
    }

    // Epilogue: normalise, write LSE, stage O through this warp's own rows of the Q tile (only this
    // warp ever read them) and store it with 16-byte writes. Tight tiles, and grouped grids (whose
    // ids are computed: BlockGrid::kComputedIds), recompute where the output goes from opaque copies
    // of the block and thread ids (the names below shadow the loop's): otherwise those values stay
    // live through the key loop, which needs every register it has.
    {
        constexpr bool kRelocate = Tr::kTightRegisters || FwdGrid<kCausal, kKvCache>::kComputedIds;
        const FwdBlock out = kRelocate ? locate_block<kBlockM, kCausal, kVariant, kKvCache>(
            opaque_int(blockIdx.x), opaque_int(blockIdx.y), opaque_int(blockIdx.z), nheads, seqlen_q, seqlen_k, va,
            kc) : blk;
        const int m_block = out.m_block, split = out.split, head = out.head, batch = out.batch;
        const SeqRange& seq = out.seq;
        const int tid_out = Tr::kTightRegisters ? opaque_int(threadIdx.x) : tid;
        const int lane = tid_out % 32, warp_row0 = (tid_out / 32) * Tr::kWarpRows;
        const int rows_left = seq.seqlen_q - m_block * kBlockM;
        u16* o_blk = o + batch * o_batch_stride + head * o_head_stride + ((i64)seq.q_start + m_block * kBlockM) * o_row_stride;
        float* lse_blk = lse + seq.lse_offset(head) + m_block * kBlockM;
        float inv_sum[Tr::kMTiles][2], row_lse[Tr::kMTiles][2];
        if (Tr::kSumsInSmem) softmax.template load_sums<Tr::kThreads>(row_sums_of<Tr>(smem, tid_out));
        softmax.finalize(inv_sum, row_lse, scale_log2);
        if (dropping) {
#pragma unroll
            for (int mt = 0; mt < Tr::kMTiles; ++mt) inv_sum[mt][0] *= va.dropout_rescale, inv_sum[mt][1] *= va.dropout_rescale;
        }
        if (kKvCache && kc.num_splits > 1) {
            cp_async_wait<0>();
            const i64 rows = (((i64)split * gridDim.z + batch) * gridDim.y + head) * seqlen_q + m_block * kBlockM;
            store_partial<Tr>(acc_o, inv_sum, row_lse, kc.o_partial + rows * fp32_cols(head_dim), kc.lse_partial + rows, warp_row0,
                              rows_left, head_dim, lane);
            return;
        }
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
}

// nheads: the grouped order of causal grids (BlockGrid) cannot read it from the grid.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(kNWarps * 32, 1) flash_fwd_kernel(CF_FWD_PARAMS, CF_VARIANT_PARAMS, int nheads) {
    flash_fwd_body<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kCausal, kVariant, false>(
        CF_FWD_ARGS, CF_VARIANT_ARGS, KvCacheArgs{}, nheads);
}

// flash_attn_with_kvcache: q against a (possibly paged) cache whose new rows are already appended.
// Grid: (query blocks x splits, heads, batch). The optional features stay available (variant body).
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_fwd_kvcache_kernel(CF_FWD_PARAMS, CF_VARIANT_PARAMS, CF_KVCACHE_PARAMS) {
    flash_fwd_body<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kCausal, true, true>(
        CF_FWD_ARGS, CF_VARIANT_ARGS, CF_KVCACHE_ARGS, gridDim.y);  // dropout is a training feature: not used here
}

// ---- One-token decoding: warps split the keys ----------------------------------------------------
// flash_attn_with_kvcache with at most 16 query rows per (sequence, kv head): one-token decoding,
// where a GQA group's query heads are the rows (kvcache.py, _decode_swap), or a short chunk.
// Row-split warps (flash_fwd_body) would give all but one warp padding rows only, and one warp per
// scheduler cannot hide its own latencies. Here every warp takes the same 16 rows against its own
// kBlockN / kNWarps keys of each K/V tile, with its own online softmax, so the block's work per
// tile is spread over all its warps; at the end the warps' results are merged through shared
// memory, weighted by their row maxima and sums (what the split-KV combine does across blocks).
template <class T, int kHeadDim, int kBlockN, int kNWarps, int kStages_>
struct DecodeTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kStages = kStages_;
    static constexpr int kBlockM = 16;
    static constexpr int kMTiles = 1;
    static constexpr int kWarpKeys = kBlockN / kNWarps;  // keys of each tile one warp takes
    static constexpr int kNTiles = kWarpKeys / 8;
    static constexpr int kDTiles = kHeadDim / 8;
    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KVTile = SwizzledTile<kBlockN, kHeadDim>;
    // The merge, after the key loop, reuses the K/V ring: per warp 16 rows of fp32 output (rows
    // padded by 4 floats so that the quads' stores fall in different banks), row maxima and sums.
    static constexpr int kMergePitch = kHeadDim + 4;
    static constexpr int kMergeBytes = kNWarps * kBlockM * (kMergePitch + 2) * 4;
    static constexpr int kSmemBytes = QTile::kBytes + cmax(kStages * KVTile::kBytes, kMergeBytes);
    static_assert(kWarpKeys % 16 == 0, "each warp takes whole 16-key MMA steps");
    static_assert(kStages >= 2, "the K/V ring needs at least two slots");
};

// Merged output of the warps for the rows and 8-column chunks this thread takes: normalised fp32
// partials and LSEs for split-KV (every row below rows_left, as store_partial), else the output and LSE.
template <class T, class Tr>
CF_DEVICE void merge_warps(const float* merge_o, const float* merge_max, const float* merge_sum, int tid,
                           int rows_left, int head_dim, u16* o_blk, i64 o_row_stride, float* lse_blk,
                           float* o_partial_rows, float* lse_partial_rows) {
    constexpr int kChunks = Tr::kDTiles;  // 8-column chunks per row
    constexpr float kLn2 = 0.6931471805599453f;
    for (int idx = tid; idx < Tr::kBlockM * kChunks; idx += Tr::kThreads) {
        const int row = idx / kChunks, col = (idx % kChunks) * 8;
        if (row >= rows_left || col >= head_dim) continue;
        float row_max = -CF_INF;
#pragma unroll
        for (int w = 0; w < Tr::kThreads / 32; ++w) row_max = fmaxf(row_max, merge_max[w * Tr::kBlockM + row]);
        float weight[Tr::kThreads / 32], total = 0.f;
#pragma unroll
        for (int w = 0; w < Tr::kThreads / 32; ++w) {  // a warp that saw no key of the row weighs 0
            const float m = merge_max[w * Tr::kBlockM + row];
            weight[w] = m == -CF_INF ? 0.f : fast_exp2(m - row_max);
            total += weight[w] * merge_sum[w * Tr::kBlockM + row];
        }
        const bool empty = total == 0.f;
        const float inv_total = empty ? 0.f : 1.f / total;
        float o[8] = {};
#pragma unroll
        for (int w = 0; w < Tr::kThreads / 32; ++w) {
            const float* src = merge_o + (w * Tr::kBlockM + row) * Tr::kMergePitch + col;
            const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
            const float wt = weight[w] * inv_total;
            o[0] += wt * lo.x, o[1] += wt * lo.y, o[2] += wt * lo.z, o[3] += wt * lo.w;
            o[4] += wt * hi.x, o[5] += wt * hi.y, o[6] += wt * hi.z, o[7] += wt * hi.w;
        }
        const float row_lse = empty ? CF_INF : (row_max + fast_log2(total)) * kLn2;
        if (o_partial_rows != nullptr) {
            float* dst = o_partial_rows + (i64)row * fp32_cols(head_dim) + col;
            *reinterpret_cast<float4*>(dst) = make_float4(o[0], o[1], o[2], o[3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(o[4], o[5], o[6], o[7]);
            if (col == 0) lse_partial_rows[row] = row_lse;
        } else {
            uint4 packed;
            packed.x = T::pack(o[0], o[1]), packed.y = T::pack(o[2], o[3]);
            packed.z = T::pack(o[4], o[5]), packed.w = T::pack(o[6], o[7]);
            if constexpr (kVecBytes == 16) {
                *reinterpret_cast<uint4*>(o_blk + row * o_row_stride + col) = packed;
            } else {
                const u32 w[4] = {packed.x, packed.y, packed.z, packed.w};
                store_run_global(o_blk + row * o_row_stride + col, w, col, head_dim);
            }
            if (col == 0) lse_blk[row] = row_lse;
        }
    }
}

// Grid: (query blocks x splits, heads, batch), as flash_fwd_kvcache_kernel, with 16-row query blocks.
template <class T, int kHeadDim, int kBlockN, int kNWarps, int kStages, bool kCausal>
__global__ void __launch_bounds__(kNWarps * 32)
flash_fwd_decode_kernel(CF_FWD_PARAMS, CF_VARIANT_PARAMS, CF_KVCACHE_PARAMS) {
    using Tr = DecodeTraits<T, kHeadDim, kBlockN, kNWarps, kStages>;
    extern __shared__ __align__(128) char smem[];
    const VariantArgs va = CF_VARIANT_ARGS;
    const KvCacheArgs kc = CF_KVCACHE_ARGS;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const FwdBlock blk = locate_block<Tr::kBlockM, kCausal, true, true>(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y,
                                                                        seqlen_q, seqlen_k, va, kc);
    const int m_block = blk.m_block, split = blk.split, head = blk.head, batch = blk.batch, kv_head = head / kv_group;
    const SeqRange& seq = blk.seq;
    const auto mask = make_mask<kCausal, true>(seq, va);
    const ScoreMod mod = ScoreMod::make(va, softmax_scale, batch, head, seq.seqlen_k - seq.seqlen_q);
    // seqlen_k is 0 when the cache index is out of range, so kv_batch is then never dereferenced.
    const int kv_batch = kc.cache_batch_idx != nullptr ? kc.cache_batch_idx[batch] : batch;
    const bool paged = kc.block_table != nullptr;
    const u16* q_blk = q + batch * q_batch_stride + head * q_head_stride +
                       ((i64)seq.q_start + m_block * Tr::kBlockM) * q_row_stride;
    const u16* k_head = k + (paged ? 0 : kv_batch * k_batch_stride) + kv_head * k_head_stride +
                        (paged ? 0 : (i64)seq.k_start * k_row_stride);
    const u16* v_head = v + (paged ? 0 : kv_batch * v_batch_stride) + kv_head * v_head_stride +
                        (paged ? 0 : (i64)seq.k_start * v_row_stride);
    const int rows_left = seq.seqlen_q - m_block * Tr::kBlockM;
    const u32 q_smem = smem_addr(smem);
    const u32 kv_smem = q_smem + Tr::QTile::kBytes;
    int n_begin = mask.key_block_begin(m_block, Tr::kBlockM, kBlockN);
    int n_end = mask.key_block_end(m_block, Tr::kBlockM, kBlockN);
    if (kc.num_splits > 1) {
        const int per_split = (n_end - n_begin + kc.num_splits - 1) / kc.num_splits;
        n_begin += split * per_split;
        n_end = min(n_end, n_begin + per_split);
    }
    const int n_blocks = n_end - n_begin;

    float acc_o[1][Tr::kDTiles][4];
    zero_acc(acc_o);
    OnlineSoftmax<1, Tr::kNTiles> softmax;
    softmax.init();

    // Tile t of the K/V stream: K of key block n_end-1-t/2 when t is even, V of it when odd.
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> k_loader(tid, k_row_stride);
    const TileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> v_loader(tid, v_row_stride);
    const PagedTileLoader<typename Tr::KVTile, kBlockN, kHeadDim, Tr::kThreads> paged_loader(tid);
    const int* pages = paged ? kc.block_table + batch * kc.block_table_stride : nullptr;
    auto load_kv_tile = [&](int t) {
        if (t < 2 * n_blocks) {
            const int n_block = n_end - 1 - t / 2;
            const u32 slot = kv_smem + (t % kStages) * Tr::KVTile::kBytes;
            const int keys_left = seq.seqlen_k - n_block * kBlockN;
            const bool is_k = t % 2 == 0;
            if (paged)
                paged_loader.load(slot, is_k ? k_head : v_head, is_k ? k_batch_stride : v_batch_stride,
                                  is_k ? k_row_stride : v_row_stride, pages, kc.page_size, kc.cache_entries,
                                  seq.k_start + n_block * kBlockN, keys_left, head_dim);
            else if (is_k)
                k_loader.load(slot, k_head + (i64)n_block * kBlockN * k_row_stride, keys_left, head_dim);
            else
                v_loader.load(slot, v_head + (i64)n_block * kBlockN * v_row_stride, keys_left, head_dim);
        }
        cp_async_commit();
    };

    if (n_blocks > 0) {
        TileLoader<typename Tr::QTile, Tr::kBlockM, kHeadDim, Tr::kThreads>(tid, q_row_stride)
            .load(q_smem, q_blk, rows_left, head_dim);
#pragma unroll
        for (int t = 0; t < kStages - 1; ++t) load_kv_tile(t);  // Q rides in the first group
        const int key0 = warp * Tr::kWarpKeys;  // this warp's keys within every tile
        const LdsmCursor<typename Tr::QTile> q_cur(q_smem, ldsm_a_row(lane), ldsm_a_chunk(lane));
        for (int it = 0; it < n_blocks; ++it) {  // S = Q K^T, mask, online softmax, O += P V
            const int n_block = n_end - 1 - it, t = 2 * it;
            const LdsmCursor<typename Tr::KVTile> k_cur(kv_smem + (t % kStages) * Tr::KVTile::kBytes,
                                                       key0 + (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
            cp_async_wait<kStages - 2>();
            __syncthreads();  // K_n landed for all threads; the slot refilled next is no longer read
            load_kv_tile(t + kStages - 1);
            float s[1][Tr::kNTiles][4];
            zero_acc(s);
            gemm_abt<T, 1, Tr::kNTiles, kHeadDim / 16>(s, q_cur, k_cur);

            cp_async_wait<kStages - 2>();
            __syncthreads();  // V_n landed
            load_kv_tile(t + kStages);
            const int row0 = m_block * Tr::kBlockM, col0 = n_block * kBlockN + key0;
            if (mod.active) apply_score_mod<Tr>(s, mod, row0, col0, lane);
            if (mask.block_needs_mask(m_block, n_block, Tr::kBlockM, kBlockN)) apply_mask<Tr>(s, mask, row0, col0, lane);
            softmax.update(s, acc_o, scale_log2);
            const LdsmCursor<typename Tr::KVTile> v_cur(kv_smem + ((t + 1) % kStages) * Tr::KVTile::kBytes, key0 + ldsm_a_row(lane), ldsm_a_chunk(lane));
            gemm_rs<T, 1, Tr::kNTiles, Tr::kDTiles>(acc_o, s, v_cur);
        }
    }

    // Merge the warps: each wrote its rows' unnormalised output, scaled max and sum to the ring.
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K/V ring
    float* merge_o = reinterpret_cast<float*>(smem + Tr::QTile::kBytes);
    float* merge_max = merge_o + Tr::kThreads / 32 * Tr::kBlockM * Tr::kMergePitch;
    float* merge_sum = merge_max + Tr::kThreads / 32 * Tr::kBlockM;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = lane / 4 + 8 * r;
        float sum = softmax.row_sum[0][r];
        sum += shfl_xor(sum, 1);
        sum += shfl_xor(sum, 2);
        if (lane % 4 == 0) {
            const float m = softmax.row_max[0][r];
            merge_max[warp * Tr::kBlockM + row] = m == -CF_INF ? -CF_INF : m * scale_log2;
            merge_sum[warp * Tr::kBlockM + row] = sum;
        }
        float* dst = merge_o + (warp * Tr::kBlockM + row) * Tr::kMergePitch + (lane % 4) * 2;
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc_o[0][dt][2 * r], acc_o[0][dt][2 * r + 1]);
    }
    __syncthreads();
    u16* o_blk = o + batch * o_batch_stride + head * o_head_stride + ((i64)seq.q_start + m_block * Tr::kBlockM) * o_row_stride;
    float* lse_blk = lse + seq.lse_offset(head) + m_block * Tr::kBlockM;
    float *o_partial_rows = nullptr, *lse_partial_rows = nullptr;
    if (kc.num_splits > 1) {  // (split, batch, head, row) rows, as store_partial
        const i64 rows = (((i64)split * gridDim.z + batch) * gridDim.y + head) * seqlen_q + m_block * Tr::kBlockM;
        o_partial_rows = kc.o_partial + rows * fp32_cols(head_dim);
        lse_partial_rows = kc.lse_partial + rows;
    }
    merge_warps<T, Tr>(merge_o, merge_max, merge_sum, tid, rows_left, head_dim, o_blk, o_row_stride, lse_blk,
                       o_partial_rows, lse_partial_rows);
}
