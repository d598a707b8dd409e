// FlashAttention-2 backward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One CTA per block of 128 keys (and head, batch) walks the query blocks that see those keys
// (kBlockM rows at a time; a persistent grid walks several such tiles per CTA, see PersistentWalk).
// Warpgroup 0 is the producer: one thread loads the tile's K and V once, another the Q and dO
// blocks into a two-stage pipeline. Each of the two consumer warpgroups owns 64 of
// the keys (head dim 256: see the split tile below) and, per query block, computes
//   S^T = K Q^T and dP^T = V dO^T                  (keys as rows: both operands in shared memory)
//   P^T = exp2(S^T * scale_log2 - LSE_log2)         (the forward's softmax, from its LSE)
//   dS^T = P^T * (dP^T - D),  D = rowsum(dO * O)   (both per query row from flash_bwd_rows_sm90,
//                                                   loaded with Q and dO)
//   dV += P^T dO,  dK += dS^T Q                    (P^T, dS^T straight from registers: the
//                                                   accumulator layout is the A-operand layout)
//   its 64 x 64 part of dQ = dS K                  (dS of both groups through shared memory)
// Its dQ part goes to an fp32 accumulator in global memory: each warp stages its 16 x 64 part in
// shared memory (the 8 parts in the accumulator's own order, DqFragments), and the dQ keeper, one
// thread of the producer warpgroup, adds the block's 32 KB in L2 with one bulk reduction (keep_dq;
// per-element red.global adds cost 30% of the kernel's time; one bulk reduction per warp instead of
// per block was 2-7% slower at head dim 64). flash_bwd_dq_sm90 scales and converts the accumulator
// afterwards, and for GQA flash_bwd_convert_kernel sums the per-query-head dK and dV written here
// in fp32. At the end of a tile dK and dV leave through shared memory and TMA stores where their
// strides fit a map (store_key_gradients_by_tma), else from registers.
//
// Deterministic mode (kDeterministic) fixes the order of those reductions: the keeper adds the
// CTA's block at the CTA's turn on that query block (dq_turn). The order of turns is chosen so that
// each CTA's predecessor on a block got there a step or more earlier, and the turns rarely wait:
//  - causal: ascending walks, turns by descending key block (key block n + 1 starts one or two query
//    blocks further down, so it reaches every block first; when seqlen_k > seqlen_q, the key blocks
//    that all start at query block 0 queue there one after another);
//  - non-causal, when all CTAs of a head fit on the device at once (dq_turn_cyclic): CTA n starts
//    at query block n mod m_blocks and walks on cyclically, so at each step the CTAs of a head are
//    on different blocks; turns follow the step at which a CTA reaches the block, then n;
//  - non-causal otherwise: ascending walks, turns by descending key block (each CTA trails the
//    next one by the wait, but no CTA waits for one that is not running yet).
// CTAs take their key blocks from a per-head ticket, from the highest key block down in the order
// they start, so in the descending orders every CTA that a turn waits for is already running
// (whatever order the GPU starts CTAs in). The cyclic order also waits for CTAs that started later:
// it needs every CTA of the head on the device at once, hence the flag, and assumes that the GPU
// starts one head's CTAs before the next head's (blockIdx order, x fastest) and that all its SMs
// are free to this kernel (a green context or an MPS limit with fewer SMs than the device reports
// could leave a waited-for CTA unstarted; other kernels only delay it).
//
// Tiles per head dim (BwdTile): head dim 128 takes 64 query rows per step and the groups split dQ's
// columns; head dim 64 takes 128 rows (wider S^T products, which read less shared memory per MMA)
// and the groups split dQ's rows. dK and dV (head_dim / 2 registers each) and S^T, dP^T
// (kBlockM / 2 each) fill the consumers' 240 registers either way.
//
// Head dim 256 (kSplitColumns) cannot hold dK and dV of 64 keys in one group (256 registers), so
// the CTA takes 64 keys and the groups split the head dim: each owns 128 columns of dK, dV and dQ.
// Group 0 computes S^T and P^T, group 1 dP^T (m64n64 products: as much shared memory per MMA as the
// tensor cores consume, where halves of each would read 1.5x that); group 0 hands P^T over in fp32
// through shared memory, group 1 forms dS^T and writes it to the dS^T tile. dV takes P^T from
// registers in both groups, dK takes dS^T from registers in group 1 and from the tile in group 0.
// K, V, two stages of Q and dO and these tiles leave no room for a dQ staging buffer: each group
// stages its dQ part in the Q and dO columns it has finished with (its dK and dV operands), and the
// keeper frees the stage once the bulk reduction has read it.
#include "common/row_dot.cuh"
#include "wgmma/wgmma_ops.cuh"

struct BwdParams {
    TensorMap q_map, k_map, v_map, do_map;  // (head_dim, seqlen, heads, batch); Q/dO boxes {64, kBlockM}, K/V {64, kBlockN}
    TensorMap dk_map, dv_map;               // (head_dim, seqlen_k, heads, batch), boxes {64, 64} (16-bit)
                                            //   or {32, 64} (fp32 with GQA): with dkv_by_tma, where the
                                            //   TMA stores dK and dV
    const float* lse_log2;                  // (batch, heads, m_blocks * kBlockM): LSE * log2(e), +inf past seqlen_q
    const float* delta;                     // (batch, heads, m_blocks * kBlockM): rowsum(dO * O), 0 past seqlen_q
    float* dq_acc;                          // (batch, heads, m_blocks, DqFragments) fp32, zero at launch
    int* dq_turns;                          // deterministic mode: (batch, heads, m_blocks + 1) int32, zero at
                                            //   launch: a turn counter per query block, then the head's ticket
                                            //   (keep_dq); null otherwise
    void* dk;                               // bf16/fp16 (batch, seqlen_k, kv heads, head_dim) by its strides, or
    void* dv;                               //   with GQA fp32 (batch, seqlen_k, heads, head_dim) contiguous
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    int seqlen_q, seqlen_k, nheads, kv_group, m_blocks;
    int dq_turn_cyclic;                     // deterministic non-causal mode: the cyclic walk (see above)
    float scale_log2;                       // softmax_scale * log2(e)
    float softmax_scale;
    int head_dim;                           // the call's, a multiple of 8 up to kHeadDim (the tiles' columns
                                            //   past it load as zeros)
    int units_per_head, units;              // the persistent walk (PersistentWalk): units of key blocks per
                                            //   (head, batch), and in all
    int dkv_by_tma;                         // dK and dV stored through dk_map and dv_map (strides the TMA
                                            //   takes); else from registers
};
static_assert(sizeof(BwdParams) == 960, "BwdParams: host layout (6 maps, 6 pointers, 6 i64, 6 int, 2 float, 4 int)");

namespace bwd {

constexpr int kStages = 2;
constexpr int kThreads = 384;
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 3 * (65536 / kThreads / 8 * 8),
              "register reallocation exceeds the block's registers: setmaxnreg.inc would never return");
constexpr int kDqWarpBytes = 16 * 64 * 4;  // a warp's dQ part: 16 query rows x 64 columns, fp32

// Tiles are stored as 64-column panels (128-byte rows, 128-byte swizzle): K, V, Q and dO have
// head_dim / 64 of them, the dS^T tile (kBlockN key rows) kBlockM / 64.
template <int kHeadDim_>
struct BwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "the Hopper backward runs head dims 64, 128, 256");
    static constexpr bool kSplitColumns = kHeadDim == 256;  // the groups split the head dim (top of the file)
    static constexpr int kBlockN = kSplitColumns ? 64 : 128;  // keys per CTA (64 per group unless split)
    static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;  // query rows per step
    static constexpr int kPanels = kHeadDim / 64, kQueryPanels = kBlockM / 64;
    static constexpr int kGroupColumns = kSplitColumns ? kHeadDim / 2 : kHeadDim;  // of dK and dV per group
    static_assert(kSplitColumns || kPanels * kQueryPanels == 2, "dQ (kBlockM x head_dim) splits into one 64 x 64 part per group");
    // Consumer group g computes dQ's query panel query_panel(g) x column panels column_panel(g) ..
    // + kGroupColumns / 64 - 1 (split: 128 columns each).
    CF_DEVICE static int query_panel(int group) { return kQueryPanels > 1 ? group : 0; }
    CF_DEVICE static int column_panel(int group) { return kSplitColumns ? 2 * group : kPanels > 1 ? group : 0; }

    // Shared memory (1024-byte aligned pieces). A stage holds Q then dO (split: adjacent, so that
    // the dQ parts staged over them are one 64 KB block).
    static constexpr int kKVBytes = kBlockN * 128 * kPanels;  // K or V
    static constexpr int kQBytes = kBlockM * 128 * kPanels;   // per stage: Q or dO
    static constexpr int kDsBytes = kBlockN * 128 * kQueryPanels;
    static constexpr int kDsTiles = kSplitColumns ? 1 : 2;    // split: group 1 alone writes it
    static constexpr int kExchangeBytes = kSplitColumns ? kBlockN * kBlockM * 4 : 0;  // P^T in fp32
    static constexpr int kRowBytes = kBlockM * 4;             // LSE_log2 or D of a query block
    static constexpr int kDqBytes = kBlockM * kHeadDim * 4;   // dQ of a query block, fp32
    static constexpr int kStagingBytes = kSplitColumns ? 0 : kDqBytes;  // split: staged in the Q/dO stage
    static_assert(!kSplitColumns || kDqBytes == 2 * kQBytes, "split: dQ is staged over a stage's Q and dO");
    static constexpr int kQStride = kSplitColumns ? 2 * kQBytes : kQBytes;  // from one stage's Q to the next
    static constexpr int kK = 0, kV = kK + kKVBytes, kQ = kV + kKVBytes,
                         kDO = kSplitColumns ? kQ + kQBytes : kQ + kStages * kQBytes,
                         kDs = kQ + 2 * kStages * kQBytes, kExchange = kDs + kDsTiles * kDsBytes,
                         kDq = kExchange + kExchangeBytes, kLse = kDq + kStagingBytes,
                         kDelta = kLse + kStages * kRowBytes, kBarriers = kDelta + kStages * kRowBytes;
    static constexpr int kSmemBytes = kBarriers + 128 + 1024;  // + the alignment slack of the base
    static_assert(kSmemBytes <= 227 * 1024, "shared memory: the tiles exceed 227 KB");
    CF_DEVICE static u32 q_tile(u32 smem, int stage) { return smem + kQ + stage * kQStride; }
    CF_DEVICE static u32 do_tile(u32 smem, int stage) { return smem + kDO + stage * kQStride; }
    // Where the consumers stage a query block's dQ (the keeper adds these kDqBytes in one reduction).
    CF_DEVICE static u32 dq_staging(u32 smem, int stage) { return kSplitColumns ? q_tile(smem, stage) : smem + kDq; }
};

// Named barriers: both consumer groups' dS^T are in shared memory; split: P^T handed over (kPBarrier);
// both groups' last dQ products have read K (kKeyGradientBarrier); one group's dK and dV are staged,
// then stored (kGroupBarrier0 + group).
enum : int { kDsBarrier = 1, kPBarrier = 2, kKeyGradientBarrier = 3, kGroupBarrier0 = 4 };

CF_DEVICE void group_barrier(int group) {
    if (group == 0)
        named_barrier_sync<kGroupBarrier0, 128>();
    else
        named_barrier_sync<kGroupBarrier0 + 1, 128>();
}

struct Barriers {
    u32 base;
    CF_DEVICE u32 kv_full() const { return base; }
    CF_DEVICE u32 qdo_full(int stage) const { return base + 8 + 8 * stage; }
    CF_DEVICE u32 qdo_empty(int stage) const { return base + 8 + 8 * (kStages + stage); }
    // The consumer warps' dQ staged (per stage where it is staged in the stage), and the staging
    // buffers free again (keep_dq).
    CF_DEVICE u32 dq_staged(int slot) const { return base + 8 + 16 * kStages + 8 * slot; }
    CF_DEVICE u32 dq_free() const { return base + 8 + 24 * kStages; }
    // Persistent grid: the consumers are done with K and V (the next tile's may load).
    CF_DEVICE u32 kv_empty() const { return base + 16 + 24 * kStages; }
};
static_assert(16 + 24 * kStages + 8 <= 128, "Barriers: 128 bytes");

// The tiles (key block, head, batch) a CTA computes. Without kPersistent, the one tile of its block
// index (of its ticket in deterministic mode), and the hardware starts CTAs as SMs free up; each
// CTA's K/V load and dK/dV stores then run with nothing else on its SM (one CTA per SM fits).
// With kPersistent, one CTA per SM walks units of work blockIdx.x, + gridDim.x, ...: a unit is key
// blocks j and n_blocks - 1 - j of one (head, batch), j fastest (the middle block alone when
// n_blocks is odd). The producer loads a tile's K and V once the consumers are done with the
// previous tile's: while they store its dK and dV from registers, or once the TMA stores of dK and
// dV (staged over the K and V tiles) have read them. Causal key block j has fewer steps the larger
// j is (its first query block rises with it), so the two blocks of a unit add up to about as many
// steps whatever j: every unit costs about the same and the static walk stays balanced without a
// tile counter. The CTAs running together share a head's Q and dO in L2, and a unit's second tile
// reads a subset of its first tile's query blocks.
// for_each_tile runs a role's work over either walk.
struct SingleTile {
    static constexpr bool kPersistent = false;
    int n_block, head, batch;
};
template <class T>
struct PersistentWalk {  // tiles t = 2 unit + (0: key block j, 1: key block n_blocks - 1 - j)
    static constexpr bool kPersistent = true;
    u32 places;  // a shared-memory word per thread: its place in the walk (for_each_tile)
    CF_DEVICE static int first() { return 2 * blockIdx.x; }
    CF_DEVICE static int j(int t, const BwdParams& p) { return (t >> 1) % p.units_per_head; }
    CF_DEVICE static int n_blocks(const BwdParams& p) { return (p.seqlen_k + T::kBlockN - 1) / T::kBlockN; }
    CF_DEVICE static bool next(int& t, const BwdParams& p) {  // t <- the tile after t, if there is one
        if (!(t & 1) && 2 * j(t, p) + 1 != n_blocks(p)) {  // the unit's second key block
            t += 1;
            return true;
        }
        t = 2 * ((t >> 1) + (int)gridDim.x);
        return (t >> 1) < p.units;
    }
    CF_DEVICE static int n_block(int t, const BwdParams& p) { return t & 1 ? n_blocks(p) - 1 - j(t, p) : j(t, p); }
    CF_DEVICE static int head(int t, const BwdParams& p) { return (t >> 1) / p.units_per_head % p.nheads; }
    CF_DEVICE static int batch(int t, const BwdParams& p) { return (t >> 1) / p.units_per_head / p.nheads; }
};

// Query blocks that see some key of key block n_block: [first, m_blocks).
template <class T, bool kCausal>
CF_DEVICE int first_query_block(int n_block, const BwdParams& p) {
    if (!kCausal) return 0;
    const int first_row = n_block * T::kBlockN - (p.seqlen_k - p.seqlen_q);  // the first row that sees the first key
    return first_row <= 0 ? 0 : first_row / T::kBlockM;
}

// The query block of step `it` of key block n_block's CTA, whose blocks are [first, m_blocks):
// ascending, or cyclic from n_block in deterministic non-causal mode (see the top of the file).
template <bool kCausal, bool kDeterministic>
CF_DEVICE int query_block(int it, int first, int n_block, const BwdParams& p) {
    if (kDeterministic && !kCausal && p.dq_turn_cyclic) return (it + n_block) % p.m_blocks;
    return first + it;
}

// How many of lo, lo + 1, ..., hi - 1 are below `bound` (dq_turn splits a cyclic interval into two of these).
CF_DEVICE int count_below(int lo, int hi, int bound) { return max(0, min(hi, bound) - lo); }

// Deterministic mode: the turn of key block n on query block m (its rank among the CTAs that add to
// m, in the order of the top of the file).
template <class T, bool kCausal>
CF_DEVICE int dq_turn(int m, int n, const BwdParams& p) {
    const int n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
    if (kCausal) {
        // Key block j visits m iff its first query row j * kBlockN + seqlen_q - seqlen_k < (m + 1) kBlockM.
        const int bound = (m + 1) * T::kBlockM + p.seqlen_k - p.seqlen_q;  // > n * kBlockN: n visits m
        return min(n_blocks - 1, (bound - 1) / T::kBlockN) - n;
    }
    if (!p.dq_turn_cyclic) return n_blocks - 1 - n;
    // Key block j reaches m at step (m - j) mod M. Count the CTAs that reach m at an earlier step,
    // then those that reach it at the same step with a lower index. The steps s' < s belong to the
    // key blocks j with j mod M in {m - s' mod M}: each residue c has `rounds` key blocks, plus one
    // more if c < extra (n_blocks = rounds M + extra), so the earlier ones number
    // step * rounds + (how many residues m - s' mod M, s' < step, are below extra).
    const int M = p.m_blocks, rounds = n_blocks / M, extra = n_blocks % M;
    const int step = ((m - n) % M + M) % M, lo = m - step + 1;  // the residues: [lo, m] cyclically
    const int with_extra = lo >= 0 ? count_below(lo, m + 1, extra)
                                   : count_below(0, m + 1, extra) + count_below(lo + M, M, extra);
    return step * rounds + with_extra + n / M;
}

// dQ accumulator layout: per (batch, head, query block) parts of 16 query rows x 64 columns, 1024
// floats each, one per consumer warp and 64 of its columns (warp w of group g: query rows
// 64 query_panel(g) + 16 w .. + 15 of the block, columns 64 column_panel(g) + 64 h .. + 63 for its
// h-th 64 columns), each in the warp's fragment order, so that a warp stages it with conflict-free
// 16-byte stores and the keeper adds the block with one bulk reduction: float4 c * 32 + lane of a
// part holds the lane's accumulator registers 32h + 4c .. + 3 (the wgmma layout below: rows lane/4
// and lane/4 + 8, columns 8c + 2 (lane%4) + {0, 1}).
template <class T>
struct DqFragments {
    static constexpr int kFloats = T::kBlockM * T::kHeadDim;  // per query block
    static constexpr int kWarpParts = T::kSplitColumns ? 2 : 1;
    static_assert(kFloats * 4 == 8 * kWarpParts * kDqWarpBytes, "dQ of a query block: the consumer warps' parts");
    // Index of part h of warp `warp` of group `group` within a query block. Split: group g stages
    // over its own columns of the stage's Q (parts 4g .. 4g + 3, warps 0 and 1) and dO (8 + 4g ..,
    // warps 2 and 3), the 64-column panels its dK and dV read.
    CF_DEVICE static int part(int group, int warp, int h) {
        return T::kSplitColumns ? (warp / 2) * 8 + 4 * group + 2 * (warp % 2) + h : group * 4 + warp;
    }
    // The first query row and column of part `part` (the inverse, for the conversion).
    CF_DEVICE static int first_row(int part) {
        return T::kSplitColumns ? 16 * (2 * (part / 8) + part % 4 / 2) : 64 * T::query_panel(part / 4) + 16 * (part % 4);
    }
    CF_DEVICE static int first_column(int part) {
        return T::kSplitColumns ? 128 * (part % 8 / 4) + 64 * (part % 2) : 64 * T::column_panel(part / 4);
    }
};

// Runs body(n_block, head, batch, tile, steps_before) for each tile of the CTA's walk, in order.
// `tile` is the parity of the tiles before it (the phase of the K/V barriers) and `steps_before`
// their steps mod 4: two stages of two phases are all that a step's buffers and barrier phases
// depend on. A persistent walk keeps the thread's place, t << 3 | steps_before << 1 | tile, in
// shared memory: held in a register across a tile, it was spilled (the consumers' hot loop takes
// all 240, the producer's threads have 24).
// kFullWarp: all 32 lanes of the warp walk together (the consumers). They then read the place
// through lane 0 (warp_uniform): read from shared memory, ptxas cannot tell that it is the same in
// every lane, and the stage index and every wgmma descriptor built from it went to vector registers,
// copied over (R2UR) before each wgmma (d128 step loop 757 -> 547 SASS instructions, 112 R2UR -> 0;
// against the plain read, sustained kernel A/B at causal 512 / 4k / 16k: +2% / +2.7% / +1.2%).
// The producer's and the keeper's threads walk alone in their warps and read it directly (a
// full-warp shuffle needs every lane).
template <class T, bool kCausal, bool kFullWarp = false, class Walk, class Body>
CF_DEVICE void for_each_tile(const BwdParams& p, const Walk& walk, Body&& body) {
    if constexpr (!Walk::kPersistent) {
        body(walk.n_block, walk.head, walk.batch, 0, 0);
    } else {
        const u32 slot = walk.places + 4 * threadIdx.x;
        auto read_place = [&]() {
            const int place = ld_shared_volatile(slot);
            return kFullWarp ? warp_uniform(place) : place;
        };
        st_shared_volatile(slot, Walk::first() << 3);
        while (true) {
            int place = read_place(), t = place >> 3;
            body(Walk::n_block(t, p), Walk::head(t, p), Walk::batch(t, p), place & 1, (place >> 1) & 3);
            place = read_place();
            t = place >> 3;
            const int steps = ((place >> 1) + p.m_blocks - first_query_block<T, kCausal>(Walk::n_block(t, p), p)) & 3;
            if (!Walk::next(t, p)) break;
            st_shared_volatile(slot, t << 3 | steps << 1 | (~place & 1));
        }
    }
}

// ---- producer ------------------------------------------------------------------------------------
// One step's Q and dO blocks, with their LSE and D rows, into stage `step % kStages`.
template <class T>
CF_DEVICE void load_query_block(const BwdParams& p, u32 smem, const Barriers& bars, int step, int m, int head,
                                int batch) {
    const int stage = step % kStages;
    mbarrier_wait(bars.qdo_empty(stage), ((step / kStages) & 1) ^ 1);
    mbarrier_arrive_expect_bytes(bars.qdo_full(stage), 2 * T::kQBytes + 2 * T::kRowBytes);
    const i64 rows = ((i64)batch * p.nheads + head) * p.m_blocks * T::kBlockM + m * T::kBlockM;
    bulk_load(smem + T::kLse + stage * T::kRowBytes, p.lse_log2 + rows, T::kRowBytes, bars.qdo_full(stage));
    bulk_load(smem + T::kDelta + stage * T::kRowBytes, p.delta + rows, T::kRowBytes, bars.qdo_full(stage));
#pragma unroll
    for (int panel = 0; panel < T::kPanels; ++panel) {
        const u32 at = panel * T::kBlockM * 128;
        tma_load_4d(T::q_tile(smem, stage) + at, &p.q_map, bars.qdo_full(stage), panel * 64, m * T::kBlockM, head,
                    batch, kEvictLast);
        tma_load_4d(T::do_tile(smem, stage) + at, &p.do_map, bars.qdo_full(stage), panel * 64, m * T::kBlockM, head,
                    batch, kEvictLast);
    }
}

// The tile's K and V blocks, once the consumers are done with the previous tile's (`tile`: the
// parity of the tiles before it; the first tile's wait, on the phase before the barrier's first,
// returns at once).
template <class T>
CF_DEVICE void load_key_block(const BwdParams& p, u32 smem, const Barriers& bars, int tile, int n_block, int head,
                              int batch) {
    mbarrier_wait(bars.kv_empty(), tile ^ 1);
    // K and V are read by this CTA alone unless query heads share them (GQA); Q and dO by every CTA
    // of the head.
    const u64 kv_policy = p.kv_group > 1 ? kEvictLast : kEvictFirst;
    mbarrier_arrive_expect_bytes(bars.kv_full(), 2 * T::kKVBytes);
#pragma unroll
    for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(smem + T::kK + panel * T::kBlockN * 128, &p.k_map, bars.kv_full(), panel * 64,
                    n_block * T::kBlockN, head / p.kv_group, batch, kv_policy);
        tma_load_4d(smem + T::kV + panel * T::kBlockN * 128, &p.v_map, bars.kv_full(), panel * 64,
                    n_block * T::kBlockN, head / p.kv_group, batch, kv_policy);
    }
}

// Two producer threads, each with the few registers of the producer warpgroup: one loads every
// tile's K and V (once the consumers have finished the previous tile's), the other the Q and dO
// blocks of every step, running up to two steps ahead, across tile boundaries too.
template <class T, bool kCausal, class Walk>
CF_DEVICE void produce_key_blocks(const BwdParams& p, u32 smem, const Barriers& bars, const Walk& walk) {
    for_each_tile<T, kCausal>(p, walk, [&](int n_block, int head, int batch, int tile, int) {
        load_key_block<T>(p, smem, bars, tile, n_block, head, batch);
    });
}

template <class T, bool kCausal, bool kDeterministic, class Walk>
CF_DEVICE void produce_query_blocks(const BwdParams& p, u32 smem, const Barriers& bars,
                                    const Walk& walk) {
    tma_prefetch_map(&p.q_map);
    tma_prefetch_map(&p.do_map);
    for_each_tile<T, kCausal>(p, walk, [&](int n_block, int head, int batch, int, int steps_before) {
        const int first = first_query_block<T, kCausal>(n_block, p);
        for (int it = 0; it < p.m_blocks - first; ++it)
            load_query_block<T>(p, smem, bars, steps_before + it,
                                query_block<kCausal, kDeterministic>(it, first, n_block, p), head, batch);
    });
}

// ---- consumer: the GEMMs -------------------------------------------------------------------------
// X^T = A_g B^T for this group's 64 keys (A: K or V, kBlockN key rows) against the kBlockM query rows
// of a Q or dO stage (B), both K-major: 16 head-dim columns per wgmma.
template <class T, bool kBf16>
CF_DEVICE void issue_transposed_scores(float (&acc)[T::kBlockM / 2], u32 keys, u32 queries) {
    const u64 a_desc = smem_descriptor(keys, 16, 1024), b_desc = smem_descriptor(queries, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
        const u32 a = (kk / 4) * T::kBlockN * 128 + (kk % 4) * 32;
        const u32 b = (kk / 4) * T::kBlockM * 128 + (kk % 4) * 32;
        Wgmma<T::kBlockM, kBf16>::template ss<0, 0>(acc, a_desc + (a >> 4), b_desc + (b >> 4), kk > 0);
    }
}

// acc (64 keys x the group's kGroupColumns) += X^T Y: X^T from registers (16 query rows per wgmma),
// Y the group's columns of a Q or dO stage, MN-major (its 64-column panels kBlockM * 128 bytes apart).
template <class T, bool kBf16>
CF_DEVICE void issue_key_gradient(float (&acc)[T::kGroupColumns / 2], const u32 (&xa)[T::kBlockM / 16][4], u32 rows) {
    const u64 desc = smem_descriptor(rows, T::kBlockM * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < T::kBlockM / 16; ++kk)
        Wgmma<T::kGroupColumns, kBf16>::template rs<1>(acc, xa[kk], desc + kk * (2048 >> 4), 1);
}

// The same with X^T from the dS^T tile (K-major A: 64 key rows, the query index along them), for
// the split tile's group 0, whose dS^T group 1 computed.
template <class T, bool kBf16>
CF_DEVICE void issue_key_gradient_from_tile(float (&acc)[T::kGroupColumns / 2], u32 x_tile, u32 rows) {
    static_assert(T::kQueryPanels == 1, "one 64-query panel of X^T");
    const u64 a_desc = smem_descriptor(x_tile, 16, 1024), b_desc = smem_descriptor(rows, T::kBlockM * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < T::kBlockM / 16; ++kk)
        Wgmma<T::kGroupColumns, kBf16>::template ss<0, 1>(acc, a_desc + ((kk * 32) >> 4), b_desc + kk * (2048 >> 4), 1);
}

// The group's part of dQ = dS K (64 query rows x kN columns): dS from a 64-query panel of the dS^T
// tile (MN-major A: the query index runs along its rows), kN / 64 column panels of K MN-major; 16
// keys per wgmma.
template <class T, int kN, bool kBf16>
CF_DEVICE void issue_query_gradient(float (&acc)[kN / 2], u32 ds_panel, u32 k_panel) {
    const u64 a_desc = smem_descriptor(ds_panel, T::kBlockN * 128, 1024),
              b_desc = smem_descriptor(k_panel, T::kBlockN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < T::kBlockN / 16; ++kk)
        Wgmma<kN, kBf16>::template ss<1, 1>(acc, a_desc + kk * (2048 >> 4), b_desc + kk * (2048 >> 4), kk > 0);
}

// ---- consumer: the elementwise part --------------------------------------------------------------
// Accumulator layout of a 64-key x kBlockM tile (keys x queries): register 4j + 2r + e holds key row
// 16 warp + lane/4 + 8r, query column 8j + 2 (lane%4) + e.
// Whether a (query block, key block) pair has scores some query must not see: keys past seqlen_k,
// or (causal) keys right of a query's diagonal. The others skip the per-element test.
template <class T, bool kCausal>
CF_DEVICE bool block_needs_mask(int m_block, int n_block, const BwdParams& p) {
    const int last_key = n_block * T::kBlockN + T::kBlockN - 1;
    return last_key >= p.seqlen_k || (kCausal && last_key > m_block * T::kBlockM + p.seqlen_k - p.seqlen_q);
}

// A per-query value (LSE or D) of this thread's query columns: [j] holds columns 8j + 2 (lane%4)
// + {0, 1}. SharedQueryValues reads each where it is used; LoadedQueryValues holds them all in
// registers, read ahead of their use.
struct SharedQueryValues {
    u32 rows;
    int lane;
    CF_DEVICE float2 operator[](int j) const { return ld_shared_f32x2(rows + (8 * j + 2 * (lane % 4)) * 4); }
};
template <int kBlockM>
struct LoadedQueryValues {
    float2 values[kBlockM / 8];
    CF_DEVICE LoadedQueryValues(SharedQueryValues shared) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) values[j] = shared[j];
    }
    CF_DEVICE float2 operator[](int j) const { return values[j]; }
};
// `shared`'s values read now into registers (kNow), or where they are used.
template <int kBlockM, bool kNow>
CF_DEVICE auto query_values(const SharedQueryValues& shared) {
    if constexpr (kNow)
        return LoadedQueryValues<kBlockM>(shared);
    else
        return shared;
}

template <class T, bool kCausal, bool kMasked, class Values>
CF_DEVICE void probabilities(float (&s)[T::kBlockM / 2], const int (&key)[2], int query0, int lane,
                             const BwdParams& p, const Values& lse_values) {
#pragma unroll
    for (int j = 0; j < T::kBlockM / 8; ++j) {
        const float2 lse = lse_values[j];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int query = query0 + 8 * j + 2 * (lane % 4) + e;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const bool visible = !kMasked || (key[r] < p.seqlen_k &&
                                                  (!kCausal || key[r] <= query + p.seqlen_k - p.seqlen_q));
                float& x = s[4 * j + 2 * r + e];
                x = visible ? fast_exp2(fmaf(x, p.scale_log2, -(e ? lse.y : lse.x))) : 0.f;
            }
        }
    }
}

// dP^T becomes dS^T = P^T (dP^T - D).
template <class T>
CF_DEVICE void score_gradients(float (&dp)[T::kBlockM / 2], const float (&prob)[T::kBlockM / 2], u32 delta_rows,
                               int lane) {
#pragma unroll
    for (int j = 0; j < T::kBlockM / 8; ++j) {
        const float2 d = SharedQueryValues{delta_rows, lane}[j];
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                dp[4 * j + 2 * r + e] = prob[4 * j + 2 * r + e] * (dp[4 * j + 2 * r + e] - (e ? d.y : d.x));
    }
}

template <bool kBf16, int kSteps>
CF_DEVICE void pack_operand(const float (&x)[8 * kSteps], u32 (&xa)[kSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) xa[kk][i] = Element16<kBf16>::pack(x[8 * kk + 2 * i], x[8 * kk + 2 * i + 1]);
}

// This thread's dS^T values into the dS^T tile (row = key within the CTA's kBlockN; query column q
// in 128-byte swizzled panel q / 64), as the dQ product reads it.
template <class T>
CF_DEVICE void store_score_gradients(u32 ds_tile, const u32 (&dsa)[T::kBlockM / 16][4], int key_row0, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = key_row0 + 8 * r;
#pragma unroll
        for (int j = 0; j < T::kBlockM / 8; ++j) {
            // Columns 8j + 2 (lane%4) + {0, 1} of row r: packed pair i = 2 (j%2) + r of k-step j/2.
            const u32 value = dsa[j / 2][2 * (j % 2) + r];
            const u32 addr = ds_tile + (j / 8) * T::kBlockN * 128 + row * 128 + (((j % 8) ^ (row % 8)) * 16) +
                             (lane % 4) * 4;
            st_shared_b32(addr, value);
        }
    }
}

// The warp's dQ part into its staging buffer (DqFragments order: the 8 warps' buffers hold the query
// block's accumulator as laid out in global memory), once the dQ keeper has freed it; the keeper
// adds the whole block (keep_dq).
// One part (16 rows x 64 columns: accumulator registers from..from + 31) in DqFragments order.
template <int kN>
CF_DEVICE void stage_dq_part(const float (&dq)[kN], int from, u32 part, int lane) {
#pragma unroll
    for (int c = 0; c < 8; ++c)
        st_shared_f32x4(part + (c * 32 + lane) * 16, dq[from + 4 * c], dq[from + 4 * c + 1], dq[from + 4 * c + 2],
                        dq[from + 4 * c + 3]);
}

CF_DEVICE void stage_query_gradient(const float (&dq)[32], u32 staging, int lane, const Barriers& bars, int it) {
    mbarrier_wait(bars.dq_free(), (it & 1) ^ 1);
    stage_dq_part(dq, 0, staging, lane);
}

// Hands the staged part to the keeper. The fence waits until the warp's stores have landed, so it is
// called once the next step's products are issued and that wait runs beside them.
CF_DEVICE void publish_query_gradient(int lane, const Barriers& bars) {
    fence_proxy_async_smem();  // the stores, before the copy engine reads them
    __syncwarp();
    if (lane == 0) mbarrier_arrive(bars.dq_staged(0));
}

// The split tile's version: the warp's two parts over the stage's Q and dO columns its group has
// finished with (DqFragments::part); the stage is this step's, so no wait for it to be free.
template <class T>
CF_DEVICE void stage_query_gradient_in_stage(const float (&dq)[64], u32 smem, int stage, int group, int warp, int lane,
                                             const Barriers& bars) {
    const u32 staging = T::dq_staging(smem, stage);
#pragma unroll
    for (int h = 0; h < 2; ++h)
        stage_dq_part(dq, 32 * h, staging + DqFragments<T>::part(group, warp, h) * kDqWarpBytes, lane);
    fence_proxy_async_smem();  // the stores, before the copy engine reads them
    __syncwarp();
    if (lane == 0) mbarrier_arrive(bars.dq_staged(stage));
}

// This thread's two rows of dK or dV (the group's columns from col0): 16-bit pairs into the
// gradient, or fp32 pairs into the per-query-head accumulator (GQA); columns up to the call's head dim.
// Each row's address is computed once, before the column tests: under the tests the compiler would
// repeat it (a division by kv_group and 64-bit products) for every column pair.
template <class T, bool kBf16, bool kGqa>
CF_DEVICE void store_key_gradient(const float (&acc)[T::kGroupColumns / 2], float scale, void* base, i64 batch_stride,
                                  i64 row_stride, i64 head_stride, const int (&key)[2], int col0, int head, int batch,
                                  int lane, const BwdParams& p) {
    const int first_col = col0 + 2 * (lane % 4);
    const i64 head_offset = kGqa ? (i64)head * p.head_dim : (i64)(head / p.kv_group) * head_stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (key[r] >= p.seqlen_k) continue;
        const i64 row = (kGqa ? ((i64)batch * p.seqlen_k + key[r]) * p.nheads * p.head_dim
                              : batch * batch_stride + key[r] * row_stride) + head_offset + first_col;  // elements
#pragma unroll
        for (int j = 0; j < T::kGroupColumns / 8; ++j) {
            if (first_col + 8 * j >= p.head_dim) continue;
            const float lo = acc[4 * j + 2 * r] * scale, hi = acc[4 * j + 2 * r + 1] * scale;
            if constexpr (kGqa)
                *reinterpret_cast<float2*>(static_cast<float*>(base) + row + 8 * j) = make_float2(lo, hi);
            else
                *reinterpret_cast<u32*>(static_cast<u16*>(base) + row + 8 * j) = Element16<kBf16>::pack(lo, hi);
        }
    }
}

// Where a consumer group stages its dK and dV at the end of a tile: its part of the K and V tiles,
// kPanels 8 KB pieces of each (64 rows x 128 bytes; kPanelBytes apart), swizzled as the loads wrote
// them. Its 64 rows of every panel, or in the split tile (64 keys) its own 128 columns' panels;
// col0 and key0 place its part of dK and dV.
template <class T>
struct KeyGradientArea {
    static constexpr int kPanels = T::kGroupColumns / 64;
    static constexpr u32 kPanelBytes = T::kBlockN * 128;
    u32 k_area, v_area;
    int col0, key0;
    CF_DEVICE KeyGradientArea(u32 smem, int group, int n_block) {
        const u32 offset = T::kSplitColumns ? T::column_panel(group) * kPanelBytes : group * 64 * 128;
        k_area = smem + T::kK + offset;
        v_area = smem + T::kV + offset;
        col0 = T::kSplitColumns ? T::column_panel(group) * 64 : 0;
        key0 = n_block * T::kBlockN + (T::kSplitColumns ? 0 : group * 64);
    }
    // Piece i of 2 kPanels: the K tile's, then the V tile's.
    CF_DEVICE u32 piece(int i) const {
        return i < kPanels ? k_area + i * kPanelBytes : v_area + (i - kPanels) * kPanelBytes;
    }
};

// The group's 64 rows of an fp32 accumulator (dK or dV with GQA), times `scale`, into all 2 kPanels
// pieces of its area as 32-column panels (128-byte rows, swizzled as a TMA store of SWIZZLE_128B
// boxes reads them). A warp's float2 stores hit every 16-byte bank group twice: two wavefronts.
template <class T>
CF_DEVICE void stage_accumulator_f32(const float (&acc)[T::kGroupColumns / 2], float scale,
                                     const KeyGradientArea<T>& area, int warp, int lane) {
#pragma unroll
    for (int j = 0; j < T::kGroupColumns / 8; ++j) {
        // Columns 8j + 2 (lane%4) + {0, 1}: panel j / 4, its 16-byte chunk 2 (j%4) + (lane%4) / 2.
        const u32 base = area.piece(j / 4);
        const int chunk = 2 * (j % 4) + (lane % 4) / 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * warp + lane / 4 + 8 * r;
            st_shared_f32x2(base + swizzled_chunk(row, chunk) + 8 * (lane % 2), acc[4 * j + 2 * r] * scale,
                            acc[4 * j + 2 * r + 1] * scale);
        }
    }
}

// dK and dV through shared memory and the TMA. A warp's 4-byte stores of column pairs write 8 rows
// of 16 bytes each, partial sectors the memory pipeline takes slowly; with nothing else running on
// the SM at the end of a tile, the consumers waited on them as long as two or three steps take (ncu,
// head dim 128 at 2k: 7% of the kernel's stall samples). Each group stages its part of dK over its
// area of the K tile and of dV over its area of V (KeyGradientArea), and thread 0 of the group
// stores them with one TMA store per panel (rows past seqlen_k and columns past the head dim are
// dropped by the copy; panels wholly past the head dim are not stored). With 128-key tiles both
// groups first wait until their last dQ products have read K (each reads all 128 rows). The split
// tile needs no such wait: each group's dQ reads only its own columns of K, and the products that
// read the other group's columns, group 0's S^T (all of K) and group 1's dP^T (all of V), completed
// before the last step's P^T hand-over barrier.
// With GQA the sums per query head are fp32, twice the bytes: dK goes first over the whole area
// (32-column panels), then dV once dK's stores have read it. The K/V tiles go back to the producer
// once the stores have read them.
template <class T, bool kBf16, bool kGqa>
CF_DEVICE void store_key_gradients_by_tma(const float (&dk)[T::kGroupColumns / 2],
                                          const float (&dv)[T::kGroupColumns / 2], const BwdParams& p, u32 smem,
                                          const Barriers& bars, int group, int n_block, int head, int batch) {
    using Area = KeyGradientArea<T>;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const Area area(smem, group, n_block);
    if constexpr (!T::kSplitColumns) named_barrier_sync<kKeyGradientBarrier, 256>();
    if constexpr (kGqa) {
        const auto store = [&](const float (&acc)[T::kGroupColumns / 2], float scale, const TensorMap* map) {
            stage_accumulator_f32<T>(acc, scale, area, warp, lane);
            fence_proxy_async_smem();  // the shared-memory writes, before the TMA (async proxy) reads them
            group_barrier(group);
            if (tid == 0) {
#pragma unroll
                for (int i = 0; i < 2 * Area::kPanels; ++i)
                    if (area.col0 + 32 * i < p.head_dim)
                        tma_store_4d(map, area.piece(i), area.col0 + 32 * i, area.key0, head, batch);
                bulk_commit();
                bulk_wait_read<0>();
            }
            group_barrier(group);  // the stores have read the area: it may be written again
        };
        store(dk, p.softmax_scale, &p.dk_map);
        store(dv, 1.f, &p.dv_map);
    } else {
        const float dk_scale[2] = {p.softmax_scale, p.softmax_scale}, dv_scale[2] = {1.f, 1.f};
        stage_accumulator<kBf16>(dk, dk_scale, area.k_area, Area::kPanelBytes, warp, lane);
        stage_accumulator<kBf16>(dv, dv_scale, area.v_area, Area::kPanelBytes, warp, lane);
        fence_proxy_async_smem();  // the stmatrix writes, before the TMA (async proxy) reads them
        group_barrier(group);
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < Area::kPanels; ++i) {
                const int col = area.col0 + 64 * i;
                if (col >= p.head_dim) continue;
                tma_store_4d(&p.dk_map, area.piece(i), col, area.key0, head, batch);
                tma_store_4d(&p.dv_map, area.piece(Area::kPanels + i), col, area.key0, head, batch);
            }
            bulk_commit();
            bulk_wait_read<0>();
        }
        group_barrier(group);  // every thread arrives after the stores have read its area (racecheck)
    }
    mbarrier_arrive(bars.kv_empty());
}

// The dQ keeper (one thread of the producer warpgroup): per step, waits for the consumer warps'
// staged dQ, adds the whole block to the accumulator with one bulk reduction and frees the staging
// buffers once the copy engine has read them. In deterministic mode it first waits for the CTA's turn
// on the query block (its counter, zero at launch, reads dq_turn) and increments the counter once
// the reduction has completed.
// keep_step is one step of it: `it` of its tile, `step` the CTA's steps before the tile (mod 4, see
// for_each_tile) plus `it`.
template <class T, bool kCausal, bool kDeterministic>
CF_DEVICE void keep_step(const BwdParams& p, u32 smem, const Barriers& bars, int step, int it, int first, int n_block,
                          i64 head_index) {
    const i64 blocks = head_index * p.m_blocks;
    const int m = query_block<kCausal, kDeterministic>(it, first, n_block, p);
    int* counter = kDeterministic ? p.dq_turns + head_index * (p.m_blocks + 1) + m : nullptr;
    if (kDeterministic) {
        wait_for_turn(counter, dq_turn<T, kCausal>(m, n_block, p));
        fence_proxy_async_global();  // the reduction (async proxy) after the acquire
    }
    const int stage = step % kStages;
    if constexpr (T::kSplitColumns)  // staged in the stage: one barrier per stage
        mbarrier_wait(bars.dq_staged(stage), (step / kStages) & 1);
    else
        mbarrier_wait(bars.dq_staged(0), step & 1);
    bulk_reduce_add_f32(p.dq_acc + (blocks + m) * DqFragments<T>::kFloats, T::dq_staging(smem, stage), T::kDqBytes);
    bulk_commit();
    bulk_wait_read<0>();
    // Split: the staging was the stage's Q and dO, which go back to the producer now.
    mbarrier_arrive(T::kSplitColumns ? bars.qdo_empty(stage) : bars.dq_free());
    if (kDeterministic) {
        bulk_wait_all();
        fence_proxy_async_global();  // the completed reduction before the release
        add_release_gpu(counter, 1);
    }
}

template <class T, bool kCausal, bool kDeterministic, class Walk>
CF_DEVICE void keep_dq(const BwdParams& p, u32 smem, const Barriers& bars, const Walk& walk) {
    for_each_tile<T, kCausal>(p, walk, [&](int n_block, int head, int batch, int, int steps_before) {
        const int first = first_query_block<T, kCausal>(n_block, p);
        const i64 head_index = (i64)batch * p.nheads + head;
        for (int it = 0; it < p.m_blocks - first; ++it)
            keep_step<T, kCausal, kDeterministic>(p, smem, bars, steps_before + it, it, first, n_block, head_index);
    });
    bulk_wait_all();
}


// One tile of the consumer below: `tile` the parity of the CTA's tiles before it, its steps numbered
// on from `steps_before` (the CTA's steps before it, mod 4; see for_each_tile).
template <class T, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, bool kPersistent>
CF_DEVICE void consume_tile(const BwdParams& p, u32 smem, const Barriers& bars, int group, int n_block, int head,
                            int batch, int tile, int steps_before) {
    constexpr int kM = T::kBlockM, kD = T::kHeadDim;
    // With 64 query rows per step, registers are left beside S^T, dP^T, dV and dK to issue dV before
    // dS^T is formed, and to read the LSE values before the products are issued; at 128 rows they
    // spill. On the persistent walk the early LSE read measured 2-3% slower (d128 causal, sustained
    // kernel A/B), so it reads them after the products there. Handing the staged dQ to the keeper
    // after the next step's products are issued spills at 128 rows with the persistent walk.
    constexpr bool kEarlyDv = kM == 64, kEarlyLse = kM == 64 && !kPersistent;
    constexpr bool kLatePublish = kM == 64 || !kPersistent;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int key_row0 = group * 64 + 16 * warp + lane / 4;  // within the CTA's keys
    const int key[2] = {n_block * T::kBlockN + key_row0, n_block * T::kBlockN + key_row0 + 8};
    const u32 k_rows = smem + T::kK + group * 64 * 128, v_rows = smem + T::kV + group * 64 * 128;
    const u32 dq_staging = smem + T::kDq + DqFragments<T>::part(group, warp, 0) * kDqWarpBytes;
    float dv[kD / 2], dk[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) dv[i] = dk[i] = 0.f;
    mbarrier_wait(bars.kv_full(), tile & 1);
    const int first = first_query_block<T, kCausal>(n_block, p);
    for (int it = 0; it < p.m_blocks - first; ++it) {
        const int step = steps_before + it;
        const int m = query_block<kCausal, kDeterministic>(it, first, n_block, p), stage = step % kStages;
        const u32 q_tile = T::q_tile(smem, stage), do_tile = T::do_tile(smem, stage);
        const u32 ds_tile = smem + T::kDs + (step % 2) * T::kDsBytes;
        const u32 lse_rows = smem + T::kLse + stage * T::kRowBytes;
        float s[kM / 2], dp[kM / 2];
        mbarrier_wait(bars.qdo_full(stage), (step / kStages) & 1);
        // With kEarlyLse the LSE values are read before the products are issued: read after them,
        // their latency (behind the products' shared-memory traffic) held up the exponentials.
        const auto lse = query_values<kM, kEarlyLse>(SharedQueryValues{lse_rows, lane});
        wgmma_fence();
        issue_transposed_scores<T, kBf16>(s, k_rows, q_tile);
        wgmma_commit();
        issue_transposed_scores<T, kBf16>(dp, v_rows, do_tile);
        wgmma_commit();
        if (kLatePublish && it > 0) publish_query_gradient(lane, bars);  // the previous step's dQ
        wgmma_wait<1>();
        register_fence(s);
        if (block_needs_mask<T, kCausal>(m, n_block, p))
            probabilities<T, kCausal, true>(s, key, m * kM, lane, p, lse);
        else
            probabilities<T, kCausal, false>(s, key, m * kM, lane, p, lse);
        u32 pa[kM / 16][4], dsa[kM / 16][4];
        pack_operand<kBf16>(s, pa);
        if constexpr (kEarlyDv) {  // dV = P^T dO runs while dS^T is formed
            register_fence(dv);
            register_fence(pa);
            wgmma_fence();
            issue_key_gradient<T, kBf16>(dv, pa, do_tile);
            wgmma_commit();
            wgmma_wait<1>();  // dP^T
        } else {
            wgmma_wait<0>();
        }
        register_fence(dp);
        score_gradients<T>(dp, s, smem + T::kDelta + stage * T::kRowBytes, lane);
        pack_operand<kBf16>(dp, dsa);
        store_score_gradients<T>(ds_tile, dsa, key_row0, lane);
        register_fence(dk);
        register_fence(dsa);
        if constexpr (!kEarlyDv) {
            register_fence(dv);
            register_fence(pa);
        }
        wgmma_fence();
        if constexpr (!kEarlyDv) issue_key_gradient<T, kBf16>(dv, pa, do_tile);
        issue_key_gradient<T, kBf16>(dk, dsa, q_tile);
        wgmma_commit();
        fence_proxy_async_smem();  // the dS^T stores, before the async proxy (wgmma) reads them
        named_barrier_sync<kDsBarrier, 256>();
        // dV and dK complete before dQ starts: P^T and dS^T (their A operands) are then free, so
        // that dV, dK and dQ fit the 240 registers together.
        wgmma_wait<0>();
        register_fence(dv);
        register_fence(dk);
        register_fence(pa);
        register_fence(dsa);
        // Q and dO are read: the stage goes back to the producer before dQ (which reads K and dS^T).
        // Every thread arrives after its own LSE and D reads: compute-sanitizer's racecheck tracks
        // the producer's bulk copies into the stage and does not order other lanes' reads before
        // one lane's arrive.
        mbarrier_arrive(bars.qdo_empty(stage));
        float dq[32];
        wgmma_fence();
        issue_query_gradient<T, 64, kBf16>(dq, ds_tile + T::query_panel(group) * T::kBlockN * 128,
                                           smem + T::kK + T::column_panel(group) * T::kBlockN * 128);
        wgmma_commit();
        wgmma_wait<0>();
        register_fence(dq);
        stage_query_gradient(dq, dq_staging, lane, bars, step);
        if (!kLatePublish) publish_query_gradient(lane, bars);
    }
    if (kLatePublish && p.m_blocks > first) publish_query_gradient(lane, bars);  // the tile's last step's dQ
    if (p.dkv_by_tma) {
        store_key_gradients_by_tma<T, kBf16, kGqa>(dk, dv, p, smem, bars, group, n_block, head, batch);
        return;
    }
    // K and V are read (the last dQ product has completed): the next tile's may load while dK and
    // dV are stored. Every thread arrives after its own reads (racecheck, see consume_split).
    mbarrier_arrive(bars.kv_empty());
    store_key_gradient<T, kBf16, kGqa>(dk, p.softmax_scale, p.dk, p.dk_batch_stride, p.dk_row_stride,
                                       p.dk_head_stride, key, 0, head, batch, lane, p);
    store_key_gradient<T, kBf16, kGqa>(dv, 1.f, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, key, 0,
                                       head, batch, lane, p);
}

// A consumer group: its 64 keys of each tile of the CTA's walk.
template <class T, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, class Walk>
CF_DEVICE void consume(const BwdParams& p, u32 smem, const Barriers& bars, int group, const Walk& walk) {
    for_each_tile<T, kCausal, true>(p, walk, [&](int n_block, int head, int batch, int tile, int steps_before) {
        consume_tile<T, kCausal, kBf16, kGqa, kDeterministic, Walk::kPersistent>(p, smem, bars, group, n_block, head,
                                                                                 batch, tile, steps_before);
    });
}

// P^T in fp32 from group 0 to group 1 (split tile): thread t of one group holds the same elements as
// thread t of the other (same accumulator layout), at float4 c * 128 + t (conflict-free).
template <int kN>
CF_DEVICE void hand_over(const float (&x)[kN], u32 exchange, int tid) {
#pragma unroll
    for (int c = 0; c < kN / 4; ++c)
        st_shared_f32x4(exchange + (c * 128 + tid) * 16, x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]);
}
template <int kN>
CF_DEVICE void take_over(float (&x)[kN], u32 exchange, int tid) {
#pragma unroll
    for (int c = 0; c < kN / 4; ++c) {
        const float4 v = ld_shared_f32x4(exchange + (c * 128 + tid) * 16);
        x[4 * c] = v.x, x[4 * c + 1] = v.y, x[4 * c + 2] = v.z, x[4 * c + 3] = v.w;
    }
}

// The split tile's consumer (head dim 256, top of the file): both groups hold the CTA's 64 keys and
// kGroup's 128 columns of dK, dV and dQ; group 0 computes S^T and P^T, group 1 dP^T and dS^T. One
// instantiation per group: wgmmas in flight across a branch on the group made ptxas serialise them.
template <class T, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, int kGroup>
CF_DEVICE void consume_split_tile(const BwdParams& p, u32 smem, const Barriers& bars, int n_block, int head, int batch,
                                  int tile, int steps_before) {
    constexpr int group = kGroup;
    constexpr int kM = T::kBlockM, kC = T::kGroupColumns;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int key_row0 = 16 * warp + lane / 4;
    const int key[2] = {n_block * T::kBlockN + key_row0, n_block * T::kBlockN + key_row0 + 8};
    const u32 ds_tile = smem + T::kDs, exchange = smem + T::kExchange;
    const u32 column_offset = T::column_panel(group) * kM * 128;  // the group's panels within Q and dO
    float dv[kC / 2], dk[kC / 2];
#pragma unroll
    for (int i = 0; i < kC / 2; ++i) dv[i] = dk[i] = 0.f;
    mbarrier_wait(bars.kv_full(), tile & 1);
    const int first = first_query_block<T, kCausal>(n_block, p);
    for (int it = 0; it < p.m_blocks - first; ++it) {
        const int step = steps_before + it;
        const int m = query_block<kCausal, kDeterministic>(it, first, n_block, p), stage = step % kStages;
        const u32 q_tile = T::q_tile(smem, stage), do_tile = T::do_tile(smem, stage);
        float x[kM / 2];  // group 0: S^T, then P^T; group 1: dP^T, then dS^T
        u32 pa[kM / 16][4];
        mbarrier_wait(bars.qdo_full(stage), (step / kStages) & 1);
        // Group 0 reads the LSE values before its product is issued (as consume_tile does).
        const u32 lse_rows = smem + T::kLse + stage * T::kRowBytes;
        const auto lse = query_values<kM, group == 0>(SharedQueryValues{lse_rows, lane});
        wgmma_fence();
        issue_transposed_scores<T, kBf16>(x, smem + (group == 0 ? T::kK : T::kV), group == 0 ? q_tile : do_tile);
        wgmma_commit();
        wgmma_wait<0>();
        register_fence(x);
        if constexpr (group == 0) {
            if (block_needs_mask<T, kCausal>(m, n_block, p))
                probabilities<T, kCausal, true>(x, key, m * kM, lane, p, lse);
            else
                probabilities<T, kCausal, false>(x, key, m * kM, lane, p, lse);
            hand_over(x, exchange, tid);
            named_barrier_sync_across_paths<kPBarrier, 256>();
            pack_operand<kBf16>(x, pa);
            register_fence(dv);
            register_fence(pa);
            wgmma_fence();
            issue_key_gradient<T, kBf16>(dv, pa, do_tile + column_offset);
            wgmma_commit();
            named_barrier_sync_across_paths<kDsBarrier, 256>();  // dS^T in its tile
            mbarrier_arrive(bars.qdo_empty(stage));  // its LSE rows are read (see group 1's)
            issue_key_gradient_from_tile<T, kBf16>(dk, ds_tile, q_tile + column_offset);
            wgmma_commit();
        } else {
            // dS^T is formed before dV and dK are issued: issuing dV first, to run while dS^T is
            // formed, measured no faster (0.98-1.01x) and spilled with GQA in deterministic mode.
            float prob[kM / 2];
            named_barrier_sync_across_paths<kPBarrier, 256>();
            take_over(prob, exchange, tid);
            score_gradients<T>(x, prob, smem + T::kDelta + stage * T::kRowBytes, lane);
            u32 dsa[kM / 16][4];
            pack_operand<kBf16>(prob, pa);
            pack_operand<kBf16>(x, dsa);
            store_score_gradients<T>(ds_tile, dsa, key_row0, lane);
            fence_proxy_async_smem();  // the dS^T stores, before the async proxy (wgmma) reads them
            named_barrier_sync_across_paths<kDsBarrier, 256>();
            register_fence(dv);
            register_fence(dk);
            register_fence(pa);
            register_fence(dsa);
            wgmma_fence();
            issue_key_gradient<T, kBf16>(dv, pa, do_tile + column_offset);
            issue_key_gradient<T, kBf16>(dk, dsa, q_tile + column_offset);
            wgmma_commit();
            // Its D rows are read. Every consumer thread releases the stage itself after its own
            // reads (racecheck does not order one lane's reads before another lane's arrive); the
            // producer also waits for the keeper, which arrives once the dQ staged over the stage
            // has been read.
            mbarrier_arrive(bars.qdo_empty(stage));
        }
        // dV and dK complete before dQ starts (their A operands free, so that dV, dK and dQ fit the
        // registers together).
        wgmma_wait<0>();
        register_fence(dv);
        register_fence(dk);
        register_fence(pa);
        float dq[kC / 2];
        wgmma_fence();
        issue_query_gradient<T, kC, kBf16>(dq, ds_tile, smem + T::kK + T::column_panel(group) * T::kBlockN * 128);
        wgmma_commit();
        wgmma_wait<0>();
        register_fence(dq);
        // Over the stage's columns this group's dK and dV read (the other group's S^T or dP^T, which
        // read all of them, completed before the barriers above).
        stage_query_gradient_in_stage<T>(dq, smem, stage, group, warp, lane, bars);
    }
    if (p.dkv_by_tma) {
        store_key_gradients_by_tma<T, kBf16, kGqa>(dk, dv, p, smem, bars, group, n_block, head, batch);
        return;
    }
    mbarrier_arrive(bars.kv_empty());  // K and V are read: the next tile's may load (see consume_tile)
    const int col0 = T::column_panel(group) * 64;
    store_key_gradient<T, kBf16, kGqa>(dk, p.softmax_scale, p.dk, p.dk_batch_stride, p.dk_row_stride,
                                       p.dk_head_stride, key, col0, head, batch, lane, p);
    store_key_gradient<T, kBf16, kGqa>(dv, 1.f, p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, key,
                                       col0, head, batch, lane, p);
}

template <class T, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, int kGroup, class Walk>
CF_DEVICE void consume_split(const BwdParams& p, u32 smem, const Barriers& bars, const Walk& walk) {
    for_each_tile<T, kCausal, true>(p, walk, [&](int n_block, int head, int batch, int tile, int steps_before) {
        consume_split_tile<T, kCausal, kBf16, kGqa, kDeterministic, kGroup>(p, smem, bars, n_block, head, batch, tile,
                                                                            steps_before);
    });
}

// The CTA's roles: the producer warpgroup's loader threads and dQ keeper, the consumer groups.
template <class T, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, class Walk>
CF_DEVICE void run_roles(const BwdParams& p, u32 smem, const Barriers& bars, const Walk& walk) {
    // The group index as warp-uniform: the consumers' K and V rows and their wgmma descriptors then
    // stay in uniform registers instead of being rebuilt per wgmma in vector registers and copied
    // over (R2UR): d128 step loop 647 -> 539 SASS instructions, d64 936 -> 866; kernel A/B +3-8% at
    // non-causal d128 4k-16k and d64 2k, +10% at d64 causal 8k. The persistent walk needs its
    // place in the walk read the same way (for_each_tile's kFullWarp) as well: either alone left
    // its descriptors in vector registers.
    const int group = warp_uniform(threadIdx.x / 128);
    if (group == 0) {
        registers_release<kProducerRegs>();
        if (threadIdx.x == 0) produce_query_blocks<T, kCausal, kDeterministic>(p, smem, bars, walk);
        if (threadIdx.x == 32) keep_dq<T, kCausal, kDeterministic>(p, smem, bars, walk);
        if (threadIdx.x == 64) produce_key_blocks<T, kCausal>(p, smem, bars, walk);
    } else {
        registers_claim<kConsumerRegs>();
        if constexpr (T::kSplitColumns) {
            if (group == 1)
                consume_split<T, kCausal, kBf16, kGqa, kDeterministic, 0>(p, smem, bars, walk);
            else
                consume_split<T, kCausal, kBf16, kGqa, kDeterministic, 1>(p, smem, bars, walk);
        } else
            consume<T, kCausal, kBf16, kGqa, kDeterministic>(p, smem, bars, group - 1, walk);
    }
}

}  // namespace bwd

// kPersistent: one CTA per SM walking units of key blocks (PersistentWalk; grid (units or SMs, 1,
// 1)); otherwise one CTA per tile, grid (key blocks, heads, batch). Deterministic mode runs one
// CTA per tile (its turns follow the order the CTAs start in).
template <int kHeadDim, bool kCausal, bool kBf16, bool kGqa, bool kDeterministic, bool kPersistent>
__global__ void __launch_bounds__(bwd::kThreads, 1) flash_bwd_sm90(const __grid_constant__ BwdParams p) {
    using namespace bwd;
    using T = BwdTile<kHeadDim>;
    static_assert(!(kPersistent && kDeterministic), "deterministic mode runs one CTA per tile");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_addr(smem_raw) + 1023) & ~1023u;
    const Barriers bars{smem + T::kBarriers};
    const int head = blockIdx.y, batch = blockIdx.z;
    __shared__ int ticket;  // deterministic mode: this CTA's place among its head's, in starting order
    if (threadIdx.x == 0) {
        if (kDeterministic) ticket = atomicAdd(p.dq_turns + ((i64)batch * p.nheads + head + 1) * (p.m_blocks + 1) - 1, 1);
        mbarrier_init(bars.kv_full(), 1);
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(bars.qdo_full(s), 1);
            // One arrival per consumer thread; split: and the keeper's once the dQ staged there is read.
            mbarrier_init(bars.qdo_empty(s), T::kSplitColumns ? 257 : 256);
            mbarrier_init(bars.dq_staged(s), 8);  // one arrival per consumer warp
        }
        mbarrier_init(bars.dq_free(), 1);
        mbarrier_init(bars.kv_empty(), 256);  // one arrival per consumer thread
        fence_barrier_init();
    }
    __syncthreads();
    if constexpr (kPersistent) {
        // The host launches at most one CTA per unit (main_grid in backward.py), so every CTA has
        // a first unit.
        __shared__ int places[kThreads];
        static_assert(T::kSmemBytes + sizeof(places) + sizeof(ticket) <= 227 * 1024,
                      "shared memory: the tiles and the walk's places exceed 227 KB");
        run_roles<T, kCausal, kBf16, kGqa, kDeterministic>(p, smem, bars, PersistentWalk<T>{smem_addr(places)});
    } else {
        // Deterministic mode: key blocks from the highest down, in the order the CTAs start (the top
        // of the file).
        const int n_block = kDeterministic ? gridDim.x - 1 - ticket : blockIdx.x;
        run_roles<T, kCausal, kBf16, kGqa, kDeterministic>(p, smem, bars, SingleTile{n_block, head, batch});
    }
}

// The per-query-row inputs of flash_bwd_sm90, padded to whole query blocks (so that its producer
// copies a block's rows with one bulk copy): lse_log2 = LSE * log2(e) and D = rowsum(dO * O), +inf
// and 0 past seqlen_q. 8 lanes per row (common/row_dot.cuh).
// Grid (row blocks of 32, heads, batch); 256 threads.
template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256)
    flash_bwd_rows_sm90(const u16* __restrict__ dout, const u16* __restrict__ out, const float* __restrict__ lse,
                        float* __restrict__ lse_log2, float* __restrict__ delta, i64 do_batch_stride,
                        i64 do_row_stride, i64 do_head_stride, i64 o_batch_stride, i64 o_row_stride,
                        i64 o_head_stride, int seqlen_q, int nheads, int m_blocks, int head_dim) {
    using T = Element16<kBf16>;
    const int lane8 = threadIdx.x % 8, row = blockIdx.x * 32 + threadIdx.x / 8, head = blockIdx.y, batch = blockIdx.z;
    const int padded = m_blocks * bwd::BwdTile<kHeadDim>::kBlockM;
    if (row >= padded) return;
    const u16* dop = dout + batch * do_batch_stride + row * do_row_stride + head * do_head_stride;
    const u16* op = out + batch * o_batch_stride + row * o_row_stride + head * o_head_stride;
    const float acc = sum_over_8_lanes(row < seqlen_q ? row_dot_part<T>(dop, op, lane8, head_dim) : 0.f);
    if (lane8 == 0) {
        const i64 at = ((i64)batch * nheads + head) * padded + row;
        delta[at] = acc;
        lse_log2[at] = row < seqlen_q ? lse[((i64)batch * nheads + head) * seqlen_q + row] * 1.4426950408889634f
                                      : CF_INF;
    }
}

// dq = softmax_scale * the dQ accumulator of flash_bwd_sm90 (DqFragments order), bf16/fp16 by dq's
// strides. In a warp's part (16 rows x 64 columns), float4 32c + 4r + q holds rows r and r + 8,
// columns 8c + 2q and + 1 (r < 8, q < 4): a thread reads the 4 float4s of one (r, c), 64 contiguous
// bytes, and writes rows r and r + 8 of 8 columns with one 16-byte store each; 8 threads in a row
// write its 64 columns (4-byte stores where dq's rows are not 16-byte aligned).
// Grid (query blocks, heads, batch); 256 threads, 2 (r, c) cells of 2 parts each.
template <int kHeadDim, bool kBf16>
__global__ void __launch_bounds__(256)
    flash_bwd_dq_sm90(const float* __restrict__ acc, u16* __restrict__ dq, i64 batch_stride, i64 row_stride,
                      i64 head_stride, int seqlen_q, int nheads, int m_blocks, float scale, int head_dim) {
    using namespace bwd;
    using T = BwdTile<kHeadDim>;
    using E = Element16<kBf16>;
    constexpr int kFloats = DqFragments<T>::kFloats, kCells = kFloats / 16;  // 16 floats per (part, r, c)
    static_assert(kCells % 256 == 0, "256 threads convert whole cells of a query block");
    const int m = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const float4* block = reinterpret_cast<const float4*>(acc + (((i64)batch * nheads + head) * m_blocks + m) * kFloats);
    u16* out = dq + batch * batch_stride + head * head_stride;
    const bool wide = ((reinterpret_cast<u64>(out) | (u64)row_stride * 2) & 15) == 0;
#pragma unroll
    for (int i = 0; i < kCells / 256; ++i) {
        const int cell = i * 256 + threadIdx.x, part = cell / 64, r = cell / 8 % 8, c = cell % 8;
        float4 v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = block[part * 256 + c * 32 + 4 * r + q];
        u32 upper[4], lower[4];  // rows r and r + 8, column pairs q
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            upper[q] = E::pack(v[q].x * scale, v[q].y * scale);
            lower[q] = E::pack(v[q].z * scale, v[q].w * scale);
        }
        const int row = m * T::kBlockM + DqFragments<T>::first_row(part) + r;
        const int col = DqFragments<T>::first_column(part) + 8 * c;
        if (col >= head_dim) continue;  // head_dim is a multiple of 8: a cell is in or out
        const u32* rows[2] = {upper, lower};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if (row + 8 * half >= seqlen_q) continue;
            u16* to = out + (row + 8 * half) * row_stride + col;
            if (wide) {
                *reinterpret_cast<uint4*>(to) = make_uint4(rows[half][0], rows[half][1], rows[half][2], rows[half][3]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) reinterpret_cast<u32*>(to)[q] = rows[half][q];
            }
        }
    }
}
