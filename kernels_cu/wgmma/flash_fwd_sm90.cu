// FlashAttention-2 forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One persistent CTA per SM walks output tiles of kBlockM = 128 query rows. Warpgroup 0 is the
// producer: after giving most of its registers back, one thread issues TMA loads of the Q tile and
// of K and V blocks into two-stage pipelines guarded by mbarriers. Warpgroups 1 and 2 are consumers,
// 64 query rows each: S = Q K^T with both operands in shared memory, the online softmax in
// registers, then O += P V with P straight from registers (its accumulator layout is the A-operand
// layout). Within a warpgroup the next block's Q K^T runs while the softmax of the current one is
// computed; across the two warpgroups the MMA issue alternates (ping-pong named barriers), so the
// tensor cores work for one warpgroup while the other one does its softmax.
//
// Key blocks are visited from the last to the first, so the blocks that need masking (the sequence
// tail, the causal diagonal) come first and the rest run without mask arithmetic.
#include "wgmma/wgmma_ops.cuh"

// Launch parameters, passed by value (one __grid_constant__ struct). The host packs the same fields in
// this order with natural alignment (cuflash2's wgmma family); the size is pinned below.
struct FwdParams {
    TensorMap q_map, k_map, v_map;  // (head_dim, seqlen, heads, batch) tiles of {64, rows}, 128B swizzle
    u16* o;
    float* lse;                     // (batch, heads, seqlen_q) by the strides below; natural log
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 lse_batch_stride, lse_head_stride;
    int seqlen_q, seqlen_k, head_dim, nheads;
    int kv_group, batch, m_blocks, tiles;
    int section_heads;              // causal: (batch, head) pairs per L2 section of the tile order
    float scale_log2;               // softmax_scale * log2(e)
};
static_assert(sizeof(FwdParams) == 512, "FwdParams: host layout (3 maps, 2 pointers, 5 i64, 9 int, 1 float)");

constexpr int kBlockM = 128, kStages = 2;
constexpr int kConsumerThreads = 256, kThreads = 384;
enum : int { kTurnOfGroup0 = 1, kTurnOfGroup1 = 2 };  // named barrier ids (0 is __syncthreads)

// Shared memory: the Q tile, kStages K blocks, kStages V blocks (each as 128-byte panels of 64
// columns, see smem_descriptor), then the mbarriers.
template <int kHeadDim, int kBlockN>
struct FwdSmem {
    static constexpr int kPanels = (kHeadDim + 63) / 64;
    static constexpr int kQBytes = kBlockM * 128 * kPanels;
    static constexpr int kKVBytes = kBlockN * 128 * kPanels;
    static constexpr int kK = kQBytes;
    static constexpr int kV = kK + kStages * kKVBytes;
    static constexpr int kBarriers = kV + kStages * kKVBytes;
    static constexpr int kBytes = kBarriers + 128 + 1024;  // + the alignment slack of the base
};

struct FwdBarriers {
    u64 q_full, q_empty;
    u64 k_full[kStages], k_empty[kStages];
    u64 v_full[kStages], v_empty[kStages];
};

// Position in a ring of kStages buffers; the phase parity flips at each wrap (mbarrier parity).
struct PipeState {
    int stage = 0;
    u32 phase = 0;
    CF_DEVICE void advance() {
        if (++stage == kStages) stage = 0, phase ^= 1;
    }
};

struct Tile {
    int m_block, head, batch;
};

// Tile t of the persistent walk. Non-causal: query blocks fastest, so CTAs running at the same
// time share a head's K and V in L2. Causal: the longest rows first (a static longest-first
// schedule), inside sections of section_heads (batch, head) pairs whose K and V fit in L2.
template <bool kCausal>
CF_DEVICE Tile tile_at(int t, const FwdParams& p) {
    if (!kCausal) {
        const int rest = t / p.m_blocks;
        return {t - rest * p.m_blocks, rest % p.nheads, rest / p.nheads};
    }
    const int per_section = p.section_heads * p.m_blocks;
    const int section = t / per_section, r = t - section * per_section;
    const int heads_here = min(p.section_heads, p.nheads * p.batch - section * p.section_heads);
    const int m_block = p.m_blocks - 1 - r / heads_here;
    const int bh = section * p.section_heads + r % heads_here;
    return {m_block, bh % p.nheads, bh / p.nheads};
}

// Key blocks a query block attends to: [0, key_blocks). Causal masks align to the bottom-right.
template <bool kCausal, int kBlockN>
CF_DEVICE int key_blocks(int m_block, const FwdParams& p) {
    int n = (p.seqlen_k + kBlockN - 1) / kBlockN;
    if (kCausal) {
        const int last_row = min((m_block + 1) * kBlockM, p.seqlen_q) - 1;
        const int last_col = last_row + p.seqlen_k - p.seqlen_q;
        n = last_col < 0 ? 0 : min(n, last_col / kBlockN + 1);
    }
    return n;
}

// Whether key block n has columns some row of the query block must not see.
template <bool kCausal, int kBlockN>
CF_DEVICE bool block_needs_mask(int n_block, int m_block, const FwdParams& p) {
    const int last_col = (n_block + 1) * kBlockN - 1;
    return last_col >= p.seqlen_k || (kCausal && last_col > m_block * kBlockM + p.seqlen_k - p.seqlen_q);
}

// ---- producer ------------------------------------------------------------------------------------
template <int kHeadDim, int kBlockN>
CF_DEVICE void load_kv_block(unsigned char* tiles, const TensorMap* map, u64* full, u64* empty, PipeState& st,
                             int n_block, int kv_head, int batch) {
    using Smem = FwdSmem<kHeadDim, kBlockN>;
    mbarrier_wait(&empty[st.stage], st.phase ^ 1);
    mbarrier_arrive_expect_bytes(&full[st.stage], Smem::kKVBytes);
    unsigned char* dst = tiles + st.stage * Smem::kKVBytes;
#pragma unroll
    for (int panel = 0; panel < Smem::kPanels; ++panel)
        tma_load_4d(dst + panel * kBlockN * 128, map, &full[st.stage], panel * 64, n_block * kBlockN, kv_head, batch,
                    kEvictLast);
    st.advance();
}

template <int kHeadDim, int kBlockN, bool kCausal>
CF_DEVICE void produce(const FwdParams& p, unsigned char* smem, FwdBarriers& bars) {
    using Smem = FwdSmem<kHeadDim, kBlockN>;
    tma_prefetch_map(&p.q_map);
    tma_prefetch_map(&p.k_map);
    tma_prefetch_map(&p.v_map);
    PipeState k_state, v_state;
    u32 q_phase = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const Tile tile = tile_at<kCausal>(t, p);
        const int n_blocks = key_blocks<kCausal, kBlockN>(tile.m_block, p);
        if (n_blocks <= 0) continue;  // no key to attend to: the consumers write the empty rows alone
        const int kv_head = tile.head / p.kv_group;
        mbarrier_wait(&bars.q_empty, q_phase ^ 1);
        mbarrier_arrive_expect_bytes(&bars.q_full, Smem::kQBytes);
#pragma unroll
        for (int panel = 0; panel < Smem::kPanels; ++panel)
            tma_load_4d(smem + panel * kBlockM * 128, &p.q_map, &bars.q_full, panel * 64, tile.m_block * kBlockM,
                        tile.head, tile.batch, kEvictFirst);
        q_phase ^= 1;
        // The consumers take K one block ahead of V: K[n] is multiplied while P[n+1] V[n+1] runs.
        load_kv_block<kHeadDim, kBlockN>(smem + Smem::kK, &p.k_map, bars.k_full, bars.k_empty, k_state, n_blocks - 1,
                                         kv_head, tile.batch);
        for (int n = n_blocks - 2; n >= 0; --n) {
            load_kv_block<kHeadDim, kBlockN>(smem + Smem::kK, &p.k_map, bars.k_full, bars.k_empty, k_state, n,
                                             kv_head, tile.batch);
            load_kv_block<kHeadDim, kBlockN>(smem + Smem::kV, &p.v_map, bars.v_full, bars.v_empty, v_state, n + 1,
                                             kv_head, tile.batch);
        }
        load_kv_block<kHeadDim, kBlockN>(smem + Smem::kV, &p.v_map, bars.v_full, bars.v_empty, v_state, 0, kv_head,
                                         tile.batch);
    }
}

// ---- consumer: the two GEMMs ---------------------------------------------------------------------
// S = Q K^T for this warpgroup's 64 rows: both operands K-major in shared memory, 16 columns of the
// head dim per wgmma (32 bytes further along the swizzled 128-byte rows, next panel every 4 steps).
template <int kHeadDim, int kBlockN, bool kBf16>
CF_DEVICE void issue_scores(float (&s)[kBlockN / 2], u32 q_rows, u32 k_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const u32 a = q_rows + (kk / 4) * kBlockM * 128 + (kk % 4) * 32;
        const u32 b = k_tile + (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
        Wgmma<kBlockN, kBf16>::template ss<0, 0>(s, smem_descriptor(a, 16, 1024), smem_descriptor(b, 16, 1024),
                                                  kk > 0);
    }
    wgmma_commit();
}

// O += P V: P from registers (16 keys per wgmma), V MN-major in shared memory (16 key rows = 2048
// bytes per step; its 64-column panels kBlockN * 128 bytes apart).
template <int kHeadDim, int kBlockN, bool kBf16>
CF_DEVICE void issue_values(float (&o)[FwdSmem<kHeadDim, kBlockN>::kPanels * 32],
                            const u32 (&pa)[kBlockN / 16][4], u32 v_tile) {
    constexpr int kN = FwdSmem<kHeadDim, kBlockN>::kPanels * 64;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
        Wgmma<kN, kBf16>::template rs<1>(o, pa[kk], smem_descriptor(v_tile + kk * 2048, kBlockN * 128, 1024), 1);
    wgmma_commit();
}

// ---- consumer: masking and the online softmax ----------------------------------------------------
// Thread layout of a 64 x N accumulator: register 4j + e holds row 16 warp + lane/4 + 8 (e/2),
// column 8j + 2 (lane%4) + e%2. Each thread owns two rows (r = 0, 1) and reduces over the quad.
template <int kN, bool kCausal>
CF_DEVICE void mask_scores(float (&s)[kN / 2], int n_block, const int (&row)[2], int lane, const FwdParams& p) {
    const int col0 = n_block * kN + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int limit = kCausal ? min(p.seqlen_k, row[r] + p.seqlen_k - p.seqlen_q + 1) : p.seqlen_k;
#pragma unroll
        for (int j = 0; j < kN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (col0 + 8 * j + e >= limit) s[4 * j + 2 * r + e] = -CF_INF;
    }
}

struct RowStats {
    float max[2] = {-CF_INF, -CF_INF};  // running maximum of the raw scores
    float sum[2] = {0.f, 0.f};          // this thread's part of the running sum of exp
};

// Folds a block of scores into the running row statistics; s becomes P (unnormalised, relative to
// the new maximum) and scale the factor that brings earlier partial outputs to that maximum.
template <int kN>
CF_DEVICE void softmax_update(float (&s)[kN / 2], RowStats& stats, float (&scale)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float m = stats.max[r];
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) m = fmaxf(m, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        m = fmaxf(m, shfl_xor(m, 1));
        m = fmaxf(m, shfl_xor(m, 2));
        const float m_scaled = m == -CF_INF ? 0.f : m * scale_log2;  // rows with nothing visible yet
        scale[r] = fast_exp2(stats.max[r] * scale_log2 - m_scaled);
        stats.max[r] = m;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[4 * j + 2 * r + e];
                x = fast_exp2(fmaf(x, scale_log2, -m_scaled));
                sum += x;
            }
        stats.sum[r] = stats.sum[r] * scale[r] + sum;
    }
}

template <int kN, bool kBf16>
CF_DEVICE void pack_probabilities(const float (&s)[kN / 2], u32 (&pa)[kN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            pa[kk][i] = kBf16 ? pack_bf16x2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1])
                              : pack_f16x2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

template <int kRegs>
CF_DEVICE void rescale_rows(float (&o)[kRegs], const float (&scale)[2]) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) o[i] *= scale[(i % 4) / 2];
}

// ---- consumer: epilogue --------------------------------------------------------------------------
// Normalises and stores this thread's two rows of O (pairs of columns, 4-byte stores) and their LSE.
// Rows that saw no key (sum 0) get O = 0 and LSE = +inf.
template <int kRegs, bool kBf16>
CF_DEVICE void store_rows(float (&o)[kRegs], RowStats& stats, const int (&row)[2], int lane, const Tile& tile,
                          const FwdParams& p) {
    const float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = stats.sum[r];
        sum += shfl_xor(sum, 1);
        sum += shfl_xor(sum, 2);
        if (row[r] >= p.seqlen_q) continue;
        const bool empty = sum == 0.f;
        const float inv = empty ? 0.f : 1.f / sum;
        u16* out = p.o + tile.batch * p.o_batch_stride + tile.head * p.o_head_stride + row[r] * p.o_row_stride;
#pragma unroll
        for (int j = 0; j < kRegs / 4; ++j) {
            const int col = 8 * j + 2 * (lane % 4);
            if (col < p.head_dim) {
                const float lo = o[4 * j + 2 * r] * inv, hi = o[4 * j + 2 * r + 1] * inv;
                *reinterpret_cast<u32*>(out + col) = kBf16 ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi);
            }
        }
        if (lane % 4 == 0)
            p.lse[tile.batch * p.lse_batch_stride + tile.head * p.lse_head_stride + row[r]] =
                empty ? CF_INF : (stats.max[r] * p.scale_log2 + fast_log2(sum)) * kLn2;
    }
}

// The ping-pong: a warpgroup issues its GEMMs only on its turn, then hands the turn over.
CF_DEVICE void take_turn(int group) {
    if (group == 0) named_barrier_sync<kTurnOfGroup0, kConsumerThreads>();
    else named_barrier_sync<kTurnOfGroup1, kConsumerThreads>();
}
CF_DEVICE void pass_turn(int group) {
    if (group == 0) named_barrier_arrive<kTurnOfGroup1, kConsumerThreads>();
    else named_barrier_arrive<kTurnOfGroup0, kConsumerThreads>();
}

// One arrival per consumer warp (the empty barriers count 8) once its wgmma reads are complete.
CF_DEVICE void release(u64* bar, int lane) {
    if (lane == 0) mbarrier_arrive(bar);
}

template <int kHeadDim, int kBlockN, bool kCausal, bool kBf16>
CF_DEVICE void consume(const FwdParams& p, unsigned char* smem, FwdBarriers& bars, int group) {
    using Smem = FwdSmem<kHeadDim, kBlockN>;
    constexpr int kORegs = Smem::kPanels * 32;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const u32 q_rows = smem_addr(smem) + group * 64 * 128;
    const u32 k_tiles = smem_addr(smem + Smem::kK), v_tiles = smem_addr(smem + Smem::kV);
    if (group == 1) pass_turn(1);  // group 0 issues first
    PipeState k_state, v_state;
    u32 q_phase = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const Tile tile = tile_at<kCausal>(t, p);
        const int n_blocks = key_blocks<kCausal, kBlockN>(tile.m_block, p);
        const int row0 = tile.m_block * kBlockM + group * 64 + warp * 16 + lane / 4;
        const int row[2] = {row0, row0 + 8};
        float o[kORegs];
#pragma unroll
        for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
        RowStats stats;
        if (n_blocks > 0) {
            float s[kBlockN / 2];
            u32 pa[kBlockN / 16][4];
            float scale[2];
            mbarrier_wait(&bars.q_full, q_phase);
            q_phase ^= 1;
            // The last key block alone: its scores, then P.
            mbarrier_wait(&bars.k_full[k_state.stage], k_state.phase);
            take_turn(group);
            issue_scores<kHeadDim, kBlockN, kBf16>(s, q_rows, k_tiles + k_state.stage * Smem::kKVBytes);
            pass_turn(group);
            wgmma_wait<0>();
            register_fence(s);
            release(&bars.k_empty[k_state.stage], lane);
            k_state.advance();
            if (n_blocks == 1) release(&bars.q_empty, lane);  // its only Q K^T is done: Q may reload
            if (block_needs_mask<kCausal, kBlockN>(n_blocks - 1, tile.m_block, p))
                mask_scores<kBlockN, kCausal>(s, n_blocks - 1, row, lane, p);
            softmax_update<kBlockN>(s, stats, scale, p.scale_log2);
            pack_probabilities<kBlockN, kBf16>(s, pa);
            // Then: scores of block n while P[n+1] V[n+1] accumulates.
            for (int n = n_blocks - 2; n >= 0; --n) {
                mbarrier_wait(&bars.k_full[k_state.stage], k_state.phase);
                take_turn(group);
                register_fence(o);
                register_fence(pa);
                issue_scores<kHeadDim, kBlockN, kBf16>(s, q_rows, k_tiles + k_state.stage * Smem::kKVBytes);
                mbarrier_wait(&bars.v_full[v_state.stage], v_state.phase);
                issue_values<kHeadDim, kBlockN, kBf16>(o, pa, v_tiles + v_state.stage * Smem::kKVBytes);
                pass_turn(group);
                wgmma_wait<1>();
                register_fence(s);
                release(&bars.k_empty[k_state.stage], lane);
                k_state.advance();
                if (n == 0) release(&bars.q_empty, lane);  // the tile's last Q K^T is done: Q may reload
                if (block_needs_mask<kCausal, kBlockN>(n, tile.m_block, p))
                    mask_scores<kBlockN, kCausal>(s, n, row, lane, p);
                softmax_update<kBlockN>(s, stats, scale, p.scale_log2);
                wgmma_wait<0>();
                register_fence(o);
                register_fence(pa);
                release(&bars.v_empty[v_state.stage], lane);
                v_state.advance();
                rescale_rows(o, scale);
                pack_probabilities<kBlockN, kBf16>(s, pa);
            }
            mbarrier_wait(&bars.v_full[v_state.stage], v_state.phase);
            take_turn(group);
            register_fence(o);
            register_fence(pa);
            issue_values<kHeadDim, kBlockN, kBf16>(o, pa, v_tiles + v_state.stage * Smem::kKVBytes);
            pass_turn(group);
            wgmma_wait<0>();
            register_fence(o);
            release(&bars.v_empty[v_state.stage], lane);
            v_state.advance();
        }
        store_rows<kORegs, kBf16>(o, stats, row, lane, tile, p);
    }
}

template <int kHeadDim, int kBlockN, bool kCausal, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1) flash_fwd_sm90(const __grid_constant__ FwdParams p) {
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: multiple of 16, at most 256");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: multiple of 16, at most 256");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // 128-byte swizzled TMA tiles need 1024-byte aligned destinations.
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    FwdBarriers& bars = *reinterpret_cast<FwdBarriers*>(smem + FwdSmem<kHeadDim, kBlockN>::kBarriers);
    if (threadIdx.x == 0) {
        mbarrier_init(&bars.q_full, 1);
        mbarrier_init(&bars.q_empty, kConsumerThreads / 32);
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&bars.k_full[s], 1);
            mbarrier_init(&bars.k_empty[s], kConsumerThreads / 32);
            mbarrier_init(&bars.v_full[s], 1);
            mbarrier_init(&bars.v_empty[s], kConsumerThreads / 32);
        }
        fence_barrier_init();
    }
    __syncthreads();
    const int group = threadIdx.x / 128;
    if (group == 0) {
        registers_release<24>();
        if (threadIdx.x == 0) produce<kHeadDim, kBlockN, kCausal>(p, smem, bars);
    } else {
        registers_claim<240>();
        consume<kHeadDim, kBlockN, kCausal, kBf16>(p, smem, bars, group - 1);
    }
}
