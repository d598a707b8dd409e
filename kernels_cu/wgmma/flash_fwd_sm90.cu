// FlashAttention-2 forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One persistent CTA per SM walks output tiles of 64 query rows per consumer warpgroup (two or
// three of them). Warpgroup 0 is the producer: after giving most of its registers back, one thread
// issues TMA loads of the Q tile and of K and V blocks into two-stage pipelines guarded by
// mbarriers. Each consumer warpgroup owns 64 query rows: S = Q K^T with both operands in shared
// memory, the online softmax in registers, then O += P V with P straight from registers (its
// accumulator layout is the A-operand layout). Within a warpgroup the next block's Q K^T runs while
// the softmax of the current one is computed; across warpgroups the MMA issue goes round in turn
// (named barriers), so the tensor cores work for one warpgroup while the others do their softmax.
// On short calls above head dim 64 (kStagedOutput) each warpgroup writes its normalised O rows into
// shared memory (stmatrix, the swizzled layout the TMA reads) and one thread stores them with a TMA
// copy that runs while the next tile starts; otherwise the rows go from registers to global memory.
//
// Key blocks are visited from the last to the first, so the blocks that need masking (the sequence
// tail, the causal diagonal) come first and the rest run without mask arithmetic. Causal CTAs take
// tiles longest first from a global counter; non-causal ones walk them statically and share the
// last ones' key blocks out evenly, so that no SM idles through a partly filled last round
// (span_at). Built with CF_CLUSTER_KV, non-causal CTAs run in pairs that load each K and V block
// once for both (a multicast TMA), whole tiles only.
#include "common/fast_div.cuh"
#include "common/quad_rows.cuh"
#include "wgmma/wgmma_ops.cuh"

// Launch parameters, passed by value (one __grid_constant__ struct). The host packs the same fields in
// this order with natural alignment (cuflash2's wgmma family); the size is pinned below.
struct FwdParams {
    TensorMap q_map, k_map, v_map;  // (head_dim, seqlen, heads, batch) tiles of {64, rows}, 128B swizzle
    TensorMap o_map;                // the output, tiles of {64, 64} (one warpgroup's rows)
    u16* o;                         // the output again, for rows written without the TMA (see store_rows)
    float* lse;                     // (batch, heads, seqlen_q) by the strides below; natural log
    int* tile_counter;              // zero at launch: causal, counts the tiles taken after the first round;
                                    // split tail, the CTAs' places in the walk (TileWalk::place)
    float* partials;                // split tail: each CTA's rows of the tile it hands over (see span_at)
    int* partial_ready;             // split tail: zero at launch, one flag per CTA and consumer group
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 lse_batch_stride, lse_head_stride;
    int seqlen_q, seqlen_k, head_dim;
    int kv_group, batch, tiles;
    int whole_rounds;               // non-causal: rounds of whole tiles (all of them without a split tail)
    int split_units;                // non-causal: key blocks of the split tail, tiles x blocks (0: none)
    float scale_log2;               // softmax_scale * log2(e)
    // tile_at's divisors (each also holds the value, FastDiv::d): query blocks per head, heads;
    // causal: tiles per L2 section, (batch, head) pairs per section and in the last (possibly
    // smaller) section.
    FastDiv m_blocks, heads, section_tiles, section_pairs, last_pairs;
};
static_assert(sizeof(FwdParams) == 704, "FwdParams: host layout (4 maps, 5 pointers, 5 i64, 8 int, 1 float, 5 FastDiv, padding to 64)");

constexpr int kMaxStages = 4;  // K and V stages FwdBarriers has room for
constexpr int kBarrierBytes = 192;  // FwdBarriers' block at the end of shared memory

enum : int { kTurnBarrier0 = 1 };  // named barrier ids kTurnBarrier0 + group: the MMA turns (0 is __syncthreads)

// The tile shape of one instantiation and the shared-memory layout it implies: kQStages Q tiles,
// kStages K blocks, kStages V blocks (each as 128-byte panels of 64 columns, see smem_descriptor),
// the output tile when there is room for it (else it lies over the V stages, see kOOverV), then the
// mbarriers. Two Q tiles at head dims up to 64 let the next tile's first Q K^T run with
// the current tile's last P V (see consume): +1-7% there on an H200, -3..+3% at head dim 128, so
// head dims above 64 keep one.
template <int kHeadDim_, int kBlockN_, int kGroups_, bool kStagedOutput_>
struct FwdTile {
    static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kGroups = kGroups_;
    static constexpr int kBlockM = 64 * kGroups;
    static constexpr int kConsumerWarps = 4 * kGroups, kThreads = 128 * (kGroups + 1);
    // Registers per thread after reallocation: the producer keeps few, the consumers take what it
    // gives back. setmaxnreg.inc waits until the block's own pool has the registers, so the total
    // may not exceed what the block started with (kEntryRegs per thread, the launch bounds' share of
    // the 64K register file) or the consumers wait forever.
    static constexpr int kEntryRegs = 65536 / kThreads / 8 * 8;
    static constexpr int kProducerRegs = kGroups == 2 ? 24 : 32, kConsumerRegs = kGroups == 2 ? 240 : 160;
    static_assert(kProducerRegs + kGroups * kConsumerRegs <= (kGroups + 1) * kEntryRegs,
                  "register reallocation exceeds the block's registers: setmaxnreg.inc would never return");
    static constexpr int kPanels = (kHeadDim + 63) / 64;
    static constexpr int kORegs = kPanels * 32;  // O accumulators per thread (64 x kPanels*64 per group)
    static constexpr int kQStages = kPanels == 1 ? 2 : 1;
    // K and V blocks in flight: four up to head dim 64, where a block is 16 KB and the producer can
    // run further ahead of tiles of a few key blocks (H200, kernel A/B against two: +1-4% at
    // 512-16k, causal 1k -1.7%; long calls run at the same power-limited clock); two above, where
    // shared memory has room for no more beside the staged output (a third at d128 causal without
    // it measured -3..0%).
    static constexpr int kStages = kPanels == 1 ? 4 : 2;
    static_assert(kStages <= kMaxStages, "FwdBarriers has room for kMaxStages K and V stages");
    static_assert(kQStages <= 2, "FwdBarriers has room for two Q stages");
    // Two-group tiles with two Q stages (short causal calls at head dims up to 64) load the next
    // tile's Q before the current tile's last K rather than after its last V: their consumers
    // otherwise waited for it (H200, d64 causal 512 / 1k: bf16 +2% / +1%, fp16 +1% / +3%). The
    // three-group tiles of long calls measured -4..+1% with it (non-causal 2k -4%).
    static constexpr bool kEarlyQ = kQStages == 2 && kGroups == 2;
    static constexpr int kQBytes = kBlockM * 128 * kPanels;
    static constexpr int kKVBytes = kBlockN * 128 * kPanels;
    static constexpr int kK = kQStages * kQBytes;
    static constexpr int kV = kK + kStages * kKVBytes;
    // The output through shared memory and TMA stores (store_output), or from registers straight to
    // global memory (store_rows). The host stages it on short calls above head dim 64, where the
    // epilogue is a large part of a tile (H200, 512 keys: +10-16%); on long calls the direct stores
    // measured 4-5% faster at head dims 128 (causal) and 256, and at head dim 64, where the next
    // tile's first S already runs beside the epilogue (two Q tiles), 3-6% faster at every length.
    static constexpr bool kStagedOutput = kStagedOutput_;
    static_assert(!kStagedOutput || kPanels > 1, "the output is staged above head dim 64 only");
    static constexpr int kOBytes = kStagedOutput ? kBlockM * 128 * kPanels : 0;  // 64-column panels per group
    // Above head dim 128 the output tile does not fit beside Q, K and V: it is staged over the V
    // stages, which the tile's last P V has read (every warp's, see store_output), and the producer
    // loads the next tile's V once the TMA store has read it (FwdBarriers::o_empty).
    static constexpr bool kOOverV =
        kStagedOutput && kV + kStages * kKVBytes + kOBytes + kBarrierBytes + 1024 > 227 * 1024;
    static_assert(!kOOverV || kOBytes <= kStages * kKVBytes, "the output tile fits over the V stages");
    static constexpr int kO = kOOverV ? kV : kV + kStages * kKVBytes;
    static constexpr int kBarriers = kOOverV ? kV + kStages * kKVBytes : kO + kOBytes;
    static constexpr int kBytes = kBarriers + kBarrierBytes + 1024;  // + the alignment slack of the base
    static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: multiple of 16, at most 256");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: multiple of 16, at most 256");
    static_assert(kGroups == 2 || kGroups == 3, "two or three consumer warpgroups");
};

// CF_CLUSTER_KV (non-causal whole-tile walks, the host's cluster_kv): CTAs run in clusters of two
// on neighbouring query blocks of one head (tiles c and c + 1 of each round of the static walk, c
// even), and each loads half of every K and V block into both with a multicast TMA, halving the
// K/V traffic from L2 into the SMs. A stage is free once the consumers of both CTAs released it,
// so each CTA's empty barriers count both.
#ifdef CF_CLUSTER_KV
constexpr int kClusterCtas = 2;
#define CF_CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#else
constexpr int kClusterCtas = 1;
#define CF_CLUSTER_DIMS
#endif

// The mbarriers (and the tile hand-over slot) at the end of shared memory, by shared-window
// address: one 32-bit base stays live, each barrier is base + a constant.
struct FwdBarriers {
    u32 base;
    CF_DEVICE u32 tile_full() const { return base; }  // causal: the producer hands over a tile index
    CF_DEVICE u32 tile_empty() const { return base + 8; }
    CF_DEVICE u32 q_full(int stage) const { return base + 16 + 8 * stage; }  // up to 2 Q stages
    CF_DEVICE u32 q_empty(int stage) const { return base + 32 + 8 * stage; }
    CF_DEVICE u32 k_full(int stage) const { return base + 48 + 8 * stage; }
    CF_DEVICE u32 k_empty(int stage) const { return base + 48 + 8 * (kMaxStages + stage); }
    CF_DEVICE u32 v_full(int stage) const { return base + 48 + 8 * (2 * kMaxStages + stage); }
    CF_DEVICE u32 v_empty(int stage) const { return base + 48 + 8 * (3 * kMaxStages + stage); }
    CF_DEVICE u32 tile_slot() const { return base + 48 + 8 * 4 * kMaxStages; }
    // Output staged over the V stages (FwdTile::kOOverV): one arrival per consumer group once its
    // TMA store has read the tile.
    CF_DEVICE u32 o_empty() const { return base + 56 + 8 * 4 * kMaxStages; }
};
static_assert(56 + 8 * 4 * kMaxStages + 8 <= kBarrierBytes, "FwdBarriers: kBarrierBytes");

// Position in a ring of kRing buffers: one counter of the buffers used so far (a register saved
// against a separate stage and phase); the mbarrier phase parity flips at each wrap.
template <int kRing>
struct PipeState {
    u32 count = 0;
    CF_DEVICE int stage() const { return count % kRing; }
    CF_DEVICE u32 phase() const { return (count / kRing) & 1; }
    CF_DEVICE void advance() { ++count; }
};

struct Tile {
    int m_block, head, batch;
};

// Tile t of the persistent walk. Non-causal (all tiles cost the same): query blocks fastest, so
// CTAs running at the same time share a head's K and V in L2. Causal: sections of section_pairs
// (batch, head) pairs whose K and V fit in L2, the longest rows first inside each section.
template <bool kCausal>
CF_DEVICE Tile tile_at(int t, const FwdParams& p) {
    Tile tile;
    int pair;  // batch * nheads + head
    if (!kCausal) {
        p.m_blocks.divmod(t, pair, tile.m_block);
    } else {
        int section, r, rank;
        p.section_tiles.divmod(t, section, r);
        const int first_pair = section * p.section_pairs.d;
        const bool last = first_pair + p.section_pairs.d > p.heads.d * p.batch;
        (last ? p.last_pairs : p.section_pairs).divmod(r, rank, pair);
        pair += first_pair;
        tile.m_block = p.m_blocks.d - 1 - rank;
    }
    p.heads.divmod(pair, tile.batch, tile.head);
    return tile;
}

// Key blocks a query block attends to: [0, key_blocks). Causal masks align to the bottom-right.
template <bool kCausal, int kBlockM, int kBlockN>
CF_DEVICE int key_blocks(int m_block, const FwdParams& p) {
    int n = (p.seqlen_k + kBlockN - 1) / kBlockN;
    if (kCausal) {
        const int last_row = min((m_block + 1) * kBlockM, p.seqlen_q) - 1;
        const int last_col = last_row + p.seqlen_k - p.seqlen_q;
        n = last_col < 0 ? 0 : min(n, last_col / kBlockN + 1);
    }
    return n;
}

// What a CTA runs next: key blocks [lo, hi) of one tile.
struct Span {
    int tile, lo, hi;
};

// The span at position `pos` of this CTA's walk (TileWalk). Causal: `pos` is a tile, all of its
// key blocks. Non-causal tiles all cost the same, and a static walk of T tiles on P CTAs takes
// ceil(T / P) rounds, the last one with idle SMs unless P divides T (2048 tiles on 132 SMs: 15.5
// rounds of work in 16). So the walk runs whole_rounds rounds of whole tiles (CTA c: tile
// c + round P), and with a split tail (split_units > 0) the key blocks of the remaining tiles are
// shared out evenly: CTA c takes units [c U / P, (c + 1) U / P) of the tail's U = tiles x key
// blocks, from its last tile to its first. A tile cut between CTAs c and c + 1 is run by both:
// c runs its low key blocks first thing in the tail and hands the unnormalised rows over through
// global memory (hand_over), c + 1 runs the high ones as its last span and folds c's rows in
// before its epilogue (take_over). Every CTA's share is a tile or more, so a tile is cut at most
// once; and a CTA only waits for the one before it in the walk, which is running (c is a CTA's
// place, TileWalk::place: the order in which the CTAs started) and hands over before anything else
// it runs in the tail. Past the end: tile >= p.tiles.
template <bool kCausal, int kBlockM, int kBlockN>
CF_DEVICE Span span_at(int pos, int place, const FwdParams& p) {
    if (kCausal || pos < p.whole_rounds) {
        const int tile = kCausal ? pos : place + pos * gridDim.x;
        const int n = tile < p.tiles ? key_blocks<kCausal, kBlockM, kBlockN>(tile_at<kCausal>(tile, p).m_block, p) : 0;
        return {tile, 0, n};
    }
    // The host keeps split_units * gridDim.x below 2^31.
    const int n = key_blocks<false, kBlockM, kBlockN>(0, p);
    const int begin = place * p.split_units / gridDim.x, end = (place + 1) * p.split_units / gridDim.x;
    const int t = (end - 1) / n - (pos - p.whole_rounds);
    if (end <= begin || t < begin / n) return {p.tiles, 0, 0};
    return {p.whole_rounds * (int)gridDim.x + t, max(begin - t * n, 0), min(end - t * n, n)};
}

// Where a CTA is in its walk: causal, the tile it runs; else how many spans it ran before. Causal
// tiles shrink along the order, so a static walk leaves some CTAs with far more work: after its
// first tile each CTA takes the next untaken one from a global counter (a greedy longest-first
// schedule). The producer takes it and hands it to the consumers through shared memory; a tile
// index past the last one tells everyone to stop. Non-causal walks are static (span_at).
template <bool kCausal>
struct TileWalk {
    int pos = kCausal ? (int)blockIdx.x : 0;
    u32 phase = 0;

    // Non-causal: the CTA's place in the static walk, c of span_at. With a split tail a CTA waits
    // for the one before it, so the places follow the order in which the CTAs started: a ticket
    // from a global counter taken first thing (take_place), which the GPU's dispatch in index order
    // makes the same as blockIdx.x in practice, but CUDA does not promise that order, and a CTA
    // not yet started (the GPU shared with other work) must never be waited for. Read from shared
    // memory at each span rather than held in a register through the key loop.
    static CF_DEVICE int place(const FwdBarriers& bars) { return kCausal ? 0 : ld_shared_volatile(bars.tile_slot()); }
    static CF_DEVICE void take_place(const FwdBarriers& bars, const FwdParams& p) {
        if (!kCausal)
            st_shared_volatile(bars.tile_slot(), p.split_units > 0 ? atomicAdd(p.tile_counter, 1) : (int)blockIdx.x);
    }

    // Producer: the position after this one.
    CF_DEVICE int reserve_next(const FwdParams& p) const {
        return kCausal ? gridDim.x + atomicAdd(p.tile_counter, 1) : pos + 1;
    }
    CF_DEVICE void publish(const FwdBarriers& bars) {
        if (!kCausal) return;
        mbarrier_wait(bars.tile_empty(), phase ^ 1);
        st_shared_volatile(bars.tile_slot(), pos);
        mbarrier_arrive(bars.tile_full());
        phase ^= 1;
    }
    // Consumers: the position to run next (non-causal: from -1, the one before the first). Every
    // consumer thread arrives on tile_empty after its own read of the slot, so the producer's next
    // write is ordered after each read by the barrier alone (one arrival per warp after __syncwarp
    // is enough under the PTX memory model, but compute-sanitizer's racecheck cannot see that
    // ordering and reports the slot).
    CF_DEVICE void receive(const FwdBarriers& bars) {
        if (!kCausal) {
            ++pos;
            return;
        }
        mbarrier_wait(bars.tile_full(), phase);
        pos = ld_shared_volatile(bars.tile_slot());
        mbarrier_arrive(bars.tile_empty());
        phase ^= 1;
    }
};

// Whether key block n has columns some row of the query block must not see.
template <bool kCausal, int kBlockM, int kBlockN>
CF_DEVICE bool block_needs_mask(int n_block, int m_block, const FwdParams& p) {
    const int last_col = (n_block + 1) * kBlockN - 1;
    return last_col >= p.seqlen_k || (kCausal && last_col > m_block * kBlockM + p.seqlen_k - p.seqlen_q);
}

// ---- producer ------------------------------------------------------------------------------------
// One K or V block into its pipeline stage: wait until the consumers released the stage, announce
// the bytes, one TMA box per 64-column panel. `is_v` picks the V ring (tiles and barriers).
template <class Tl, bool kIsV>
CF_DEVICE void load_kv_block(u32 smem, const TensorMap* map, const FwdBarriers& bars, PipeState<Tl::kStages>& st,
                             int n_block, int kv_head, int batch) {
    const u32 full = kIsV ? bars.v_full(st.stage()) : bars.k_full(st.stage());
    mbarrier_wait(kIsV ? bars.v_empty(st.stage()) : bars.k_empty(st.stage()), st.phase() ^ 1);
    mbarrier_arrive_expect_bytes(full, Tl::kKVBytes);
    const u32 dst = smem + (kIsV ? Tl::kV : Tl::kK) + st.stage() * Tl::kKVBytes;
#ifdef CF_CLUSTER_KV
    // This CTA's half of the block's rows, into both CTAs (the map's boxes are half a block).
    constexpr int kHalf = Tl::kBlockN / 2;
    static_assert(kHalf % 8 == 0, "half blocks start on a 1024-byte swizzle period");
    const int half = (int)cluster_cta_rank();
#pragma unroll
    for (int panel = 0; panel < Tl::kPanels; ++panel)
        tma_load_4d_multicast(dst + panel * Tl::kBlockN * 128 + half * kHalf * 128, map, full, panel * 64,
                              n_block * Tl::kBlockN + half * kHalf, kv_head, batch, 0x3, kEvictLast);
#else
#pragma unroll
    for (int panel = 0; panel < Tl::kPanels; ++panel)
        tma_load_4d(dst + panel * Tl::kBlockN * 128, map, full, panel * 64, n_block * Tl::kBlockN, kv_head, batch,
                    kEvictLast);
#endif
    st.advance();
}

// A tile's Q into the next Q stage, once the consumers released it.
template <class Tl>
CF_DEVICE void load_q_tile(u32 smem, const FwdParams& p, const FwdBarriers& bars, PipeState<Tl::kQStages>& q_state,
                           const Tile& tile) {
    const int q_stage = q_state.stage();
    mbarrier_wait(bars.q_empty(q_stage), q_state.phase() ^ 1);
    mbarrier_arrive_expect_bytes(bars.q_full(q_stage), Tl::kQBytes);
#pragma unroll
    for (int panel = 0; panel < Tl::kPanels; ++panel)
        tma_load_4d(smem + q_stage * Tl::kQBytes + panel * Tl::kBlockM * 128, &p.q_map, bars.q_full(q_stage),
                    panel * 64, tile.m_block * Tl::kBlockM, tile.head, tile.batch, kEvictFirst);
    q_state.advance();
}

// Q of a tile loads after the last V of the tile before, or (FwdTile::kEarlyQ) during it, before
// its last K (its last V when it has one key block): the consumers issue the next tile's first
// Q K^T right after this tile's last one, and loading Q only after this tile's last V (and the next
// tile's reservation) left them waiting for it at short causal calls. The early Q's stage was the
// previous tile's, free once that tile's last Q K^T is done, which needs nothing loaded after it.
// With one Q stage, the next Q waits for this tile's last Q K^T, which needs the last K: it cannot
// go before that K, and goes after the last V.
template <class Tl, bool kCausal>
CF_DEVICE void produce(const FwdParams& p, u32 smem, const FwdBarriers& bars) {
    tma_prefetch_map(&p.q_map);
    tma_prefetch_map(&p.k_map);
    tma_prefetch_map(&p.v_map);
    PipeState<Tl::kStages> k_state, v_state;
    PipeState<Tl::kQStages> q_state;
    bool q_loaded = false;  // the current tile's Q went out during the tile before
    TileWalk<kCausal> walk;
    int next = -1;
    // The span after this one, and its Q (FwdTile::kEarlyQ only).
    auto reserve_next_span = [&]() {
        next = walk.reserve_next(p);
        const Span s = span_at<kCausal, Tl::kBlockM, Tl::kBlockN>(next, walk.place(bars), p);
        if (s.tile < p.tiles && s.hi > s.lo) {
            load_q_tile<Tl>(smem, p, bars, q_state, tile_at<kCausal>(s.tile, p));
            q_loaded = true;
        }
    };
    for (;;) {
        walk.publish(bars);
        const Span span = span_at<kCausal, Tl::kBlockM, Tl::kBlockN>(walk.pos, walk.place(bars), p);
        if (span.tile >= p.tiles) break;
        const Tile tile = tile_at<kCausal>(span.tile, p);
        if (span.hi <= span.lo) {  // no key to attend to: the consumers write the empty rows alone
            walk.pos = walk.reserve_next(p);
            continue;
        }
        const int kv_head = tile.head / p.kv_group;
        if (!q_loaded) load_q_tile<Tl>(smem, p, bars, q_state, tile);
        q_loaded = false;
        next = -1;
        // The consumers take K one block ahead of V: K[n] is multiplied while P[n+1] V[n+1] runs.
        load_kv_block<Tl, false>(smem, &p.k_map, bars, k_state, span.hi - 1, kv_head, tile.batch);
        // Output staged over the V stages: the previous tile's must have been read by its TMA stores.
        // q_state counts the tiles with keys, this one included (the ones whose output goes through
        // shared memory; one register less than a counter of its own, for the 24-register producer).
        if (Tl::kOOverV && q_state.count > 1) mbarrier_wait(bars.o_empty(), (q_state.count - 2) & 1);
        for (int n = span.hi - 2; n >= span.lo; --n) {
            if (Tl::kEarlyQ && n == span.lo) reserve_next_span();
            load_kv_block<Tl, false>(smem, &p.k_map, bars, k_state, n, kv_head, tile.batch);
            load_kv_block<Tl, true>(smem, &p.v_map, bars, v_state, n + 1, kv_head, tile.batch);
        }
        if (Tl::kEarlyQ && next < 0) reserve_next_span();  // one key block: before its V
        load_kv_block<Tl, true>(smem, &p.v_map, bars, v_state, span.lo, kv_head, tile.batch);
        // Near the span's end either way: the producer runs two blocks ahead.
        if constexpr (Tl::kEarlyQ) walk.pos = next;
        else walk.pos = walk.reserve_next(p);
    }
}

// ---- consumer: the two GEMMs ---------------------------------------------------------------------
// S = Q K^T for this warpgroup's 64 rows: both operands K-major in shared memory, 16 columns of the
// head dim per wgmma (32 bytes further along the swizzled 128-byte rows, next panel every 4 steps).
template <class Tl, bool kBf16>
CF_DEVICE void issue_scores(float (&s)[Tl::kBlockN / 2], u32 q_rows, u32 k_tile) {
    constexpr int kBlockN = Tl::kBlockN;
    // Each step's descriptors are the tile's plus a constant (the start address field, in 16-byte
    // units, does not carry below 256 KB); the Q base is opaque so that the compiler does not keep
    // every step's Q descriptor in registers through the key loop.
    const u64 q_desc = smem_descriptor(opaque_int(q_rows), 16, 1024), k_desc = smem_descriptor(k_tile, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tl::kHeadDim / 16; ++kk) {
        const u32 a = (kk / 4) * Tl::kBlockM * 128 + (kk % 4) * 32;
        const u32 b = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
        Wgmma<kBlockN, kBf16>::template ss<0, 0>(s, q_desc + (a >> 4), k_desc + (b >> 4), kk > 0);
    }
    wgmma_commit();
}

// O += P V: P from registers (16 keys per wgmma), V MN-major in shared memory (16 key rows = 2048
// bytes per step; its 64-column panels kBlockN * 128 bytes apart).
template <class Tl, bool kBf16>
CF_DEVICE void issue_values(float (&o)[Tl::kORegs], const u32 (&pa)[Tl::kBlockN / 16][4], u32 v_tile) {
    constexpr int kN = Tl::kPanels * 64, kBlockN = Tl::kBlockN;
    const u64 v_desc = smem_descriptor(v_tile, kBlockN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) Wgmma<kN, kBf16>::template rs<1>(o, pa[kk], v_desc + kk * (2048 >> 4), 1);
    wgmma_commit();
}

// ---- consumer: masking and the online softmax ----------------------------------------------------
// Thread layout of a 64 x N accumulator: register 4j + e holds row 16 warp + lane/4 + 8 (e/2),
// column 8j + 2 (lane%4) + e%2. Each thread owns two rows (r = 0, 1) and reduces over the quad.
//
// Row r's registers are 4j + 2r + e; the i-th of them (i = 2j + e) holds column 8j + e past the
// thread's first, so the columns grow with i and those a row may see are a prefix of its
// registers. One count per row, turned into a bit mask per 32 registers, then decides every
// element: ptxas moves the mask into predicates seven bits at a time (R2P) instead of comparing
// each column with the row's limit.
template <int kN, bool kCausal>
CF_DEVICE void mask_scores(float (&s)[kN / 2], int n_block, const int (&row)[2], int lane, const FwdParams& p) {
    constexpr int kPerRow = kN / 4;  // registers per row
    const int col0 = n_block * kN + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int limit = kCausal ? min(p.seqlen_k, row[r] + p.seqlen_k - p.seqlen_q + 1) : p.seqlen_k;
        const int span = max(0, min(limit - col0, kN));  // columns [col0, col0 + span) are visible
        const int visible = 2 * (span / 8) + min(span % 8, 2);  // registers of the row: a prefix
#pragma unroll
        for (int base = 0; base < kPerRow; base += 32) {
            const int here = visible - base;
            const u32 hidden = here >= 32 ? 0u : here <= 0 ? ~0u : ~0u << here;
#pragma unroll
            for (int i = base; i < min(base + 32, kPerRow); ++i)
                if ((hidden >> (i - base)) & 1u) s[4 * (i / 2) + 2 * r + i % 2] = -CF_INF;
        }
    }
}

struct RowStats {
    float max[2] = {-CF_INF, -CF_INF};  // the rows' reference: their maximum raw score so far, up to a slack (below)
    float sum[2] = {0.f, 0.f};          // this thread's part of the running sum of exp
};

// The online softmax takes each row's exponentials against a reference that need not be the exact
// running maximum: one at most kReferenceSlack (log2 units) below it keeps every probability within
// [0, 2^kReferenceSlack], and the division by the row sum (or the LSE, which adds the reference
// back) cancels it exactly in real arithmetic. Keeping the reference until a block's maximum exceeds
// it by more than that skips rescaling O (kORegs multiplies per thread) in almost every block after
// a row's first few, where the exact maximum of some of a warp's 16 rows moves in most blocks
// (H200, kernel A/B: head dim 256 +3-6%, 64 -1..+4%, 128 even to +1% sustained). 2^8 is far from
// overflow in fp32 sums and in fp16/bf16 probabilities. The cost is accuracy in rows that a few
// keys dominate: a block's largest probability is no longer exactly 1 and is rounded to 16 bits
// like the others (the NumPy reference, cuflash2/reference.py, mirrors it: 2-3x the output error
// of the exact maximum there, a small fraction of FA2's tolerance).
constexpr float kReferenceSlack = 8.f;

// Folds a block of scores into the running row statistics; s becomes P (unnormalised, relative to
// the new reference) and scale the factor that brings earlier partial outputs to that reference.
// The row maximum and sum are taken over kChains independent partial results: with two consumer
// warps per scheduler, a single dependent chain of kN/4 fmax or add steps would leave the issue
// slots idle for its latency.
template <int kN, bool kMasked>
CF_DEVICE void softmax_update(float (&s)[kN / 2], RowStats& stats, float (&scale)[2], float scale_log2) {
    constexpr int kColumns = kN / 8, kChains = 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float part[kChains];
#pragma unroll
        for (int c = 0; c < kChains; ++c) part[c] = stats.max[r];
#pragma unroll
        for (int j = 0; j < kColumns; ++j)
            part[j % kChains] = fmaxf(part[j % kChains], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        float m = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
        m = fmaxf(m, shfl_xor(m, 1));
        m = fmaxf(m, shfl_xor(m, 2));
        // The reference moves only when the block's maximum exceeds it by more than
        // kReferenceSlack (the comparison is false for a row with nothing visible yet, -inf on both
        // sides, and true for its first visible scores).
        const bool moves = (m - stats.max[r]) * scale_log2 > kReferenceSlack;
        const float ref = moves ? m : stats.max[r];
        // Rows with nothing visible yet (only after a mask: an unmasked block has finite scores).
        const float m_scaled = kMasked && ref == -CF_INF ? 0.f : ref * scale_log2;
        // Exactly 1 when the reference stays, so that the caller can skip rescaling O.
        scale[r] = moves ? fast_exp2(stats.max[r] * scale_log2 - m_scaled) : 1.f;
        stats.max[r] = ref;
#pragma unroll
        for (int c = 0; c < kChains; ++c) part[c] = 0.f;
#pragma unroll
        for (int j = 0; j < kColumns; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[4 * j + 2 * r + e];
                x = fast_exp2(fmaf(x, scale_log2, -m_scaled));
                part[(2 * j + e) % kChains] += x;
            }
        stats.sum[r] = stats.sum[r] * scale[r] + ((part[0] + part[1]) + (part[2] + part[3]));
    }
}

// The scores of key block n folded into the row statistics: masked first when the block has
// columns some row must not see (the sequence tail, the causal diagonal).
//
// ptxas moves the wait for the P V in flight (consume's finish_values) to the top of its basic
// block. With the softmax after the mask branch, in that block, the softmax ran after the P V had
// completed rather than beside it; above head dim 128 the softmax sits in both arms of the branch
// instead (the wait then follows it): d256 +3-12%, d192 +0-6% (kernel A/B, 512-16k). At d128 it
// measured -2..+3% and at d64 -2..-8% (512 the worst), where the other warpgroups' GEMMs already
// fill the tensor cores while one group runs its softmax, so those keep one softmax after the
// branch. scripts/softmax_overlap.py shows the order in the SASS.
template <class Tl, bool kCausal>
CF_DEVICE void fold_block(float (&s)[Tl::kBlockN / 2], int n_block, int m_block, const int (&row)[2], int lane,
                          RowStats& stats, float (&scale)[2], const FwdParams& p) {
    const bool masked = block_needs_mask<kCausal, Tl::kBlockM, Tl::kBlockN>(n_block, m_block, p);
    if (masked) mask_scores<Tl::kBlockN, kCausal>(s, n_block, row, lane, p);
    if (Tl::kPanels <= 2 || masked)
        softmax_update<Tl::kBlockN, true>(s, stats, scale, p.scale_log2);
    else  // unmasked blocks above head dim 128: their own arm (see above), finite scores only
        softmax_update<Tl::kBlockN, false>(s, stats, scale, p.scale_log2);
}

template <int kN, bool kBf16>
CF_DEVICE void pack_probabilities(const float (&s)[kN / 2], u32 (&pa)[kN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            pa[kk][i] = Element16<kBf16>::pack(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

template <int kRegs>
CF_DEVICE void rescale_rows(float (&o)[kRegs], const float (&scale)[2]) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) o[i] *= scale[(i % 4) / 2];
}

// The MMA turns: a warpgroup issues its GEMMs only on its turn, then hands the turn to the next
// group (barrier kTurnBarrier0 + g counts the 128 threads of group g and the 128 arriving from the
// group before it).
CF_DEVICE void take_turn(int group) {
    if (group == 0) named_barrier_sync<kTurnBarrier0, 256>();
    else if (group == 1) named_barrier_sync<kTurnBarrier0 + 1, 256>();
    else named_barrier_sync<kTurnBarrier0 + 2, 256>();
}
template <int kGroups>
CF_DEVICE void pass_turn(int group) {
    if (group == kGroups - 1) named_barrier_arrive<kTurnBarrier0, 256>();
    else if (group == 0) named_barrier_arrive<kTurnBarrier0 + 1, 256>();
    else named_barrier_arrive<kTurnBarrier0 + 2, 256>();
}

// One arrival per consumer warp (the empty barriers count them all) once its wgmma reads are complete.
CF_DEVICE void release(u32 bar, int lane) {
    if (lane == 0) mbarrier_arrive(bar);
}

// A K or V stage: with clusters, the other CTA's producer writes it too (CF_CLUSTER_KV).
CF_DEVICE void release_kv(u32 bar, int lane) {
    if (lane == 0) {
        mbarrier_arrive(bar);
#ifdef CF_CLUSTER_KV
        mbarrier_arrive_cluster(bar, cluster_cta_rank() ^ 1);
#endif
    }
}

// A consumer's view of one span of the walk: which tile, which key blocks. The rest of what the
// epilogue needs (the tile's head and batch, this thread's rows) is worked out there from these:
// registers held through the key loop are what the three-group kernels run short of.
struct ConsumerTile {
    int index;    // the tile (tile_at)
    int m_block;  // its query block
    int lo, hi;   // key blocks [lo, hi); none: rows that see no key
    bool valid;   // false past the last span
    CF_DEVICE bool has_keys() const { return hi > lo; }
};

// This thread's two rows of O in query block m_block.
template <int kBlockM>
struct ThreadRows {
    int row[2];
    CF_DEVICE ThreadRows(int m_block, int group, int warp, int lane) {
        row[0] = m_block * kBlockM + group * 64 + warp * 16 + lane / 4;
        row[1] = row[0] + 8;
    }
};

// What becomes of a span's rows: stored (kWholeRows), handed to the next CTA (kHandOver: the low
// key blocks of a cut tile) or combined with the previous CTA's (kTakeOver: the high ones); from
// the bounds, so that the consumers keep no register for it (the key blocks per tile are a launch
// constant where tiles are cut).
enum SpanRole : int { kWholeRows, kHandOver, kTakeOver };
template <bool kCausal, int kBlockM, int kBlockN>
CF_DEVICE int span_role(const ConsumerTile& t, const FwdParams& p) {
    if (kCausal) return kWholeRows;
    return t.hi < key_blocks<false, kBlockM, kBlockN>(0, p) ? kHandOver : t.lo > 0 ? kTakeOver : kWholeRows;
}

template <class Tl, bool kCausal>
CF_DEVICE ConsumerTile consumer_tile(int pos, const FwdBarriers& bars, const FwdParams& p) {
    const Span span = span_at<kCausal, Tl::kBlockM, Tl::kBlockN>(pos, TileWalk<kCausal>::place(bars), p);
    ConsumerTile c;
    c.valid = span.tile < p.tiles;
    c.index = c.valid ? span.tile : 0;
    c.m_block = tile_at<kCausal>(c.index, p).m_block;
    c.lo = span.lo;
    c.hi = c.valid ? span.hi : 0;
    return c;
}

// ---- consumer: epilogue --------------------------------------------------------------------------
// The row sums completed over the quad, this thread's two LSE values written, and 1 / sum returned
// (0 for rows that saw no key: their O is 0 and their LSE +inf).
CF_DEVICE void finish_rows(const RowStats& stats, const int (&row)[2], int lane, const Tile& tile,
                           const FwdParams& p, float (&inv)[2]) {
    const float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = stats.sum[r];
        sum += shfl_xor(sum, 1);
        sum += shfl_xor(sum, 2);
        const bool empty = sum == 0.f;
        inv[r] = empty ? 0.f : fast_reciprocal(sum);
        if (lane % 4 == 0 && row[r] < p.seqlen_q)
            p.lse[tile.batch * p.lse_batch_stride + tile.head * p.lse_head_stride + row[r]] =
                empty ? CF_INF : (stats.max[r] * p.scale_log2 + fast_log2(sum)) * kLn2;
    }
}

// O normalised and stored from registers: when the output is not staged, and for tiles that see no
// key at all (causal, more queries than keys: O = 0, LSE = +inf). Each run of four 8-column groups
// is transposed over the quad (common/quad_rows.cuh) and leaves in 16-byte stores, whole groups up
// to the head dim (a multiple of 8; the host runs this kernel only on an `out` with a 16-byte
// aligned base and strides, forward.unsupported_reason). Every lane takes part in the exchanges:
// rows past seqlen_q only skip the stores.
template <int kRegs, bool kBf16>
CF_DEVICE void store_rows(const float (&o)[kRegs], const RowStats& stats, const int (&row)[2], int lane,
                          const Tile& tile, const FwdParams& p) {
    static_assert(kRegs % 16 == 0, "store_rows: runs of four 8-column groups");
    float inv[2];
    finish_rows(stats, row, lane, tile, p, inv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool row_ok = row[r] < p.seqlen_q;
        u16* out = p.o + tile.batch * p.o_batch_stride + tile.head * p.o_head_stride + row[r] * p.o_row_stride;
#pragma unroll
        for (int g = 0; g < kRegs / 4; g += 4) {
            u32 v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                v[i] = Element16<kBf16>::pack(o[4 * (g + i) + 2 * r] * inv[r], o[4 * (g + i) + 2 * r + 1] * inv[r]);
            quad_transpose(v, lane);
            const int col = 8 * (g + lane % 4);
            if (row_ok && col < p.head_dim) st_global_v4(out + col, v[0], v[1], v[2], v[3]);
        }
    }
}

enum : int { kOutputBarrier0 = 4 };  // named barrier ids kOutputBarrier0 + group: a group's output tile

CF_DEVICE void output_barrier(int group) { named_barrier_sync<128>(kOutputBarrier0 + group); }

// The group's 64 rows of O, normalised, through shared memory to global: stmatrix into its panels
// of the output tile (four 8 x 8 blocks per instruction, the accumulator's layout, 128-byte
// swizzled as the TMA reads them), then thread 0 of the group issues one TMA store per 64-column
// panel (rows past the sequence end and columns past the head dim are dropped by the copy).
// Output tile of its own: thread 0 goes on (`store_pending`: its stores may still read the panels)
// and waits before the next tile rewrites them. Output over the V stages: writing waits for every
// warp's last P V, and thread 0 hands the stages back to the producer as soon as its stores have
// read them (the next tile's V loads wait for that).
template <class Tl, bool kBf16>
CF_DEVICE void store_output(const float (&o)[Tl::kORegs], const RowStats& stats, const Tile& tile,
                            const int (&row)[2], int group, int warp, int lane, u32 o_panels,
                            const PipeState<Tl::kStages>& v_state, const FwdBarriers& bars, const FwdParams& p,
                            bool& store_pending) {
    constexpr int kPanelBytes = 64 * 128;
    float inv[2];
    finish_rows(stats, row, lane, tile, p, inv);
    const bool issuer = threadIdx.x % 128 == 0;
    if (Tl::kOOverV) {
        const u32 last = v_state.count - 1;  // the tile's last P V read this V stage
        mbarrier_wait(bars.v_empty(last % Tl::kStages), (last / Tl::kStages) & 1);
    } else {
        if (issuer && store_pending) bulk_wait_read<0>();
        output_barrier(group);
    }
    stage_accumulator<kBf16>(o, inv, o_panels, kPanelBytes, warp, lane);
    fence_proxy_async_smem();  // the stmatrix writes, before the TMA (async proxy) reads them
    output_barrier(group);
    if (issuer) {
#pragma unroll
        for (int panel = 0; panel < Tl::kPanels; ++panel)
            tma_store_4d(&p.o_map, o_panels + panel * kPanelBytes, panel * 64, tile.m_block * Tl::kBlockM + group * 64,
                         tile.head, tile.batch);
        bulk_commit();
        store_pending = true;
        if (Tl::kOOverV) {
            bulk_wait_read<0>();
            mbarrier_arrive(bars.o_empty());
            store_pending = false;
        }
    }
}

// ---- consumer: tiles cut between two CTAs (span_at) ----------------------------------------------
// Both CTAs hold the tile's rows in the same accumulator layout, so each thread hands over its own
// registers to the same thread of the other CTA: float4 columns of 128 threads, then the row
// statistics (maximum and this thread's part of the sum, per row), one slot per place in the walk
// (TileWalk::place) and group.
template <class Tl>
CF_DEVICE float4* partial_slot(const FwdParams& p, int place, int group) {
    return reinterpret_cast<float4*>(p.partials) + (i64)(place * Tl::kGroups + group) * (Tl::kORegs / 4 + 1) * 128 +
           threadIdx.x % 128;
}

// The group's unnormalised rows of the tile's low key blocks, for the next CTA: every thread
// writes its slot, then one thread raises the group's flag with release semantics (the barrier
// orders the other threads' writes before it).
template <class Tl>
CF_DEVICE void hand_over(const float (&o)[Tl::kORegs], const RowStats& stats, int group, const FwdBarriers& bars,
                         const FwdParams& p) {
    const int place = TileWalk<false>::place(bars);
    float4* slot = partial_slot<Tl>(p, place, group);
#pragma unroll
    for (int j = 0; j < Tl::kORegs / 4; ++j)
        __stcg(slot + j * 128, make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]));
    __stcg(slot + Tl::kORegs / 4 * 128, make_float4(stats.max[0], stats.max[1], stats.sum[0], stats.sum[1]));
    output_barrier(group);
    if (threadIdx.x % 128 == 0) {
        add_release_gpu(p.partial_ready + place * Tl::kGroups + group, 1);
        if (Tl::kOOverV) mbarrier_arrive(bars.o_empty());  // nothing staged over V for this span
    }
}

// The previous CTA's rows of this tile's low key blocks folded into this group's (the high ones):
// both brought to the larger row maximum, as the online softmax does between key blocks.
template <class Tl>
CF_DEVICE void take_over(float (&o)[Tl::kORegs], RowStats& stats, int group, const FwdBarriers& bars,
                         const FwdParams& p) {
    const int before = TileWalk<false>::place(bars) - 1;
    if (threadIdx.x % 128 == 0) wait_for_turn(p.partial_ready + before * Tl::kGroups + group, 1);
    output_barrier(group);  // the flag acquired by one thread, then read by all
    const float4* slot = partial_slot<Tl>(p, before, group);
    const float4 theirs = __ldcg(slot + Tl::kORegs / 4 * 128);
    const float their_max[2] = {theirs.x, theirs.y}, their_sum[2] = {theirs.z, theirs.w};
    float keep[2], add[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m = fmaxf(stats.max[r], their_max[r]);
        keep[r] = stats.max[r] == -CF_INF ? 0.f : exp2f((stats.max[r] - m) * p.scale_log2);
        add[r] = their_max[r] == -CF_INF ? 0.f : exp2f((their_max[r] - m) * p.scale_log2);
        stats.max[r] = m;
        stats.sum[r] = stats.sum[r] * keep[r] + their_sum[r] * add[r];
    }
#pragma unroll
    for (int j = 0; j < Tl::kORegs / 4; ++j) {
        const float4 v = __ldcg(slot + j * 128);
        o[4 * j] = o[4 * j] * keep[0] + v.x * add[0];
        o[4 * j + 1] = o[4 * j + 1] * keep[0] + v.y * add[0];
        o[4 * j + 2] = o[4 * j + 2] * keep[1] + v.z * add[1];
        o[4 * j + 3] = o[4 * j + 3] * keep[1] + v.w * add[1];
    }
}

// Where a tile ends and the next one's Q shares its stage (head dims above 64), the epilogue either
// runs between the tile's lone last P V and the next tile's lone first S (both warpgroups reach it
// together, so the tensor cores idle through it: 1,400 of the 44,000 cycles a d128 tile of 2k keys
// takes on an H200, and the first S and its softmax another 2,800), or, on the calls below, under
// that S: P[lo] V[lo], the next S once its Q is in, then the epilogue. Kernel A/B on an H200 (5-7
// rounds in turn) against the epilogue first: causal d128 +2-3% at 2k-8k (bf16 and fp16);
// non-causal from 8k keys +2% at d128 and +2-3% at d256, but -1..-3% at 1k-4k (fp16 d256 1k -5%),
// so shorter non-causal calls keep the epilogue first. (Why is not known: loading Q a tile early,
// with a second Q stage, left those losses as they were; docs/design-notes.md has a lead.)
constexpr int kEpilogueUnderScoresSeqlen = 8192;
template <bool kCausal>
CF_DEVICE bool epilogue_under_scores(const FwdParams& p) {
    return kCausal || p.seqlen_k >= kEpilogueUnderScoresSeqlen;
}

// The consumer warpgroup's walk. Per span, key blocks go from the last to the first: S of the last
// block alone, then S of block n while P[n+1] V[n+1] accumulates, then P[lo] V[lo] alone, then the
// epilogue (or the hand-over of a tile cut between two CTAs, see span_at). With two Q stages the
// tile boundary is one step like the others: the next tile's first S runs with this tile's last
// P V, and the epilogue follows while nothing waits on it. With one, on the calls of
// epilogue_under_scores, P[lo] V[lo] and then the next tile's first S are issued, and the epilogue
// runs under that S. The epilogue's TMA stores run on while the next tile starts.
template <class Tl, bool kCausal, bool kBf16>
CF_DEVICE void consume(const FwdParams& p, u32 smem, const FwdBarriers& bars, int group) {
    constexpr int kBlockN = Tl::kBlockN, kORegs = Tl::kORegs;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const u32 k_tiles = smem + Tl::kK, v_tiles = smem + Tl::kV;
    if (group == Tl::kGroups - 1) pass_turn<Tl::kGroups>(group);  // group 0 issues first
    PipeState<Tl::kStages> k_state, v_state;
    PipeState<Tl::kQStages> q_state;
    TileWalk<kCausal> walk;
    walk.pos = -1;
    walk.receive(bars);
    ConsumerTile cur = consumer_tile<Tl, kCausal>(walk.pos, bars, p);
    float o[kORegs], s[kBlockN / 2], scale[2];
    u32 pa[kBlockN / 16][4];
    RowStats stats;
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
    // Q of the current tile, from the first wait on it to its release after the tile's last Q K^T.
    auto q_rows = [&]() { return smem + q_state.stage() * Tl::kQBytes + group * 64 * 128; };
    auto release_q = [&]() {
        release(bars.q_empty(q_state.stage()), lane);
        q_state.advance();
    };
    // store_pending: thread 0's last TMA stores may still read the group's panels of the output tile.
    bool store_pending = false;
    // `whole`: the caller knows that the span covers the whole tile (see span_role).
    auto store_tile = [&](const ConsumerTile& t, bool whole) {
        const int role = whole ? kWholeRows : span_role<kCausal, Tl::kBlockM, Tl::kBlockN>(t, p);
        if (role == kHandOver) {
            hand_over<Tl>(o, stats, group, bars, p);
            return;
        }
        if (role == kTakeOver) take_over<Tl>(o, stats, group, bars, p);
        const u32 o_panels = smem + Tl::kO + group * Tl::kPanels * 64 * 128;
        const Tile tile = tile_at<kCausal>(t.index, p);
        const ThreadRows<Tl::kBlockM> rows(t.m_block, group, warp, lane);
        if (Tl::kStagedOutput && t.has_keys())
            store_output<Tl, kBf16>(o, stats, tile, rows.row, group, warp, lane, o_panels, v_state, bars, p,
                                    store_pending);
        else
            store_rows<kORegs, kBf16>(o, stats, rows.row, lane, tile, p);
    };
    // S of a tile's last key block, on the group's turn once its Q and K are in.
    auto issue_first_scores = [&]() {
        mbarrier_wait(bars.q_full(q_state.stage()), q_state.phase());
        mbarrier_wait(bars.k_full(k_state.stage()), k_state.phase());
        take_turn(group);
        issue_scores<Tl, kBf16>(s, q_rows(), k_tiles + k_state.stage() * Tl::kKVBytes);
        pass_turn<Tl::kGroups>(group);
    };
    // That S complete (the caller waited): its K stage released, folded into fresh statistics.
    auto fold_first_block = [&](const ConsumerTile& t) {
        register_fence(s);
        release_kv(bars.k_empty(k_state.stage()), lane);
        k_state.advance();
        if (t.hi - t.lo == 1) release_q();  // its only Q K^T is done: Q may reload
        fold_block<Tl, kCausal>(s, t.hi - 1, t.m_block, ThreadRows<Tl::kBlockM>(t.m_block, group, warp, lane).row,
                                lane, stats, scale, p);
        scale[0] = scale[1] = 1.f;  // O is still zero
        pack_probabilities<kBlockN, kBf16>(s, pa);
    };
    // S of a tile's last key block alone (nothing to overlap it with).
    auto first_block = [&](const ConsumerTile& t) {
        issue_first_scores();
        wgmma_wait<0>();
        fold_first_block(t);
    };
    // O brought to the row maxima of the block folded last (`scale`) before the P V that adds that
    // block: in the key loop while the tensor cores run this step's Q K^T, not between the softmax
    // and the next turn (before the tile's lone last P V: ahead of its turn). Skipped (exact) when
    // no row maximum of the warp moved.
    auto rescale_output = [&]() {
        register_fence(o);
        if (__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) rescale_rows(o, scale);
    };
    // S of the next key block issued with P V of the one before (their K and V stages in order), and
    // the first wait: S complete, its K stage released.
    auto issue_scores_and_values = [&]() {
        mbarrier_wait(bars.k_full(k_state.stage()), k_state.phase());
        take_turn(group);
        register_fence(o);
        register_fence(pa);
        issue_scores<Tl, kBf16>(s, q_rows(), k_tiles + k_state.stage() * Tl::kKVBytes);
        rescale_output();
        mbarrier_wait(bars.v_full(v_state.stage()), v_state.phase());
        issue_values<Tl, kBf16>(o, pa, v_tiles + v_state.stage() * Tl::kKVBytes);
        pass_turn<Tl::kGroups>(group);
        wgmma_wait<1>();
        register_fence(s);
        release_kv(bars.k_empty(k_state.stage()), lane);
        k_state.advance();
    };
    // P[lo] V[lo], the tile's last P V, on the group's turn once its V is in.
    auto issue_last_values = [&]() {
        mbarrier_wait(bars.v_full(v_state.stage()), v_state.phase());
        rescale_output();
        take_turn(group);
        register_fence(o);
        register_fence(pa);
        issue_values<Tl, kBf16>(o, pa, v_tiles + v_state.stage() * Tl::kKVBytes);
        pass_turn<Tl::kGroups>(group);
    };
    // P V complete: its V stage released.
    auto finish_values = [&]() {
        wgmma_wait<0>();
        register_fence(o);
        register_fence(pa);
        release_kv(bars.v_empty(v_state.stage()), lane);
        v_state.advance();
    };
    if (cur.valid && cur.has_keys()) first_block(cur);
    while (cur.valid) {
        // S of block n while P[n+1] V[n+1] accumulates.
        for (int n = cur.hi - 2; n >= cur.lo; --n) {
            issue_scores_and_values();
            if (n == cur.lo) release_q();  // the tile's last Q K^T is done: Q may reload
            fold_block<Tl, kCausal>(s, n, cur.m_block, ThreadRows<Tl::kBlockM>(cur.m_block, group, warp, lane).row,
                                    lane, stats, scale, p);
            finish_values();
            pack_probabilities<kBlockN, kBf16>(s, pa);
        }
        walk.receive(bars);
        const ConsumerTile next = consumer_tile<Tl, kCausal>(walk.pos, bars, p);
        // (A tile cut between two CTAs takes the other way: once per CTA, and the registers that
        // its hand-over needs beside the next tile's scores would spill.)
        if (Tl::kQStages == 2 && cur.has_keys() && next.valid && next.has_keys() &&
            span_role<kCausal, Tl::kBlockM, Tl::kBlockN>(cur, p) == kWholeRows) {
            // The next tile's first S (its Q in the other stage) with this tile's last P V.
            RowStats next_stats;
            mbarrier_wait(bars.q_full(q_state.stage()), q_state.phase());
            issue_scores_and_values();
            if (next.hi - next.lo == 1) release_q();
            fold_block<Tl, kCausal>(s, next.hi - 1, next.m_block,
                                    ThreadRows<Tl::kBlockM>(next.m_block, group, warp, lane).row, lane, next_stats,
                                    scale, p);
            scale[0] = scale[1] = 1.f;  // the next tile's O starts at zero
            finish_values();
            store_tile(cur, true);
            stats = next_stats;
#pragma unroll
            for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
            pack_probabilities<kBlockN, kBf16>(s, pa);
        } else if (epilogue_under_scores<kCausal>(p) && cur.has_keys() && next.valid && next.has_keys() &&
                   span_role<kCausal, Tl::kBlockM, Tl::kBlockN>(cur, p) == kWholeRows) {
            // P[lo] V[lo], then the next tile's first S once its Q is in, and this tile's epilogue
            // while that S runs.
            issue_last_values();
            issue_first_scores();
            wgmma_wait<1>();
            register_fence(o);
            release_kv(bars.v_empty(v_state.stage()), lane);
            v_state.advance();
            store_tile(cur, true);
            stats = RowStats();
#pragma unroll
            for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
            wgmma_wait<0>();
            fold_first_block(next);
        } else {
            if (cur.has_keys()) {  // P[lo] V[lo] alone
                issue_last_values();
                wgmma_wait<0>();
                register_fence(o);
                release_kv(bars.v_empty(v_state.stage()), lane);
                v_state.advance();
            }
            store_tile(cur, false);
            stats = RowStats();
#pragma unroll
            for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
            if (next.valid && next.has_keys()) first_block(next);
        }
        cur = next;
    }
    if (store_pending) bulk_wait_read<0>();  // shared memory must outlive the last stores' reads
}

template <int kHeadDim, int kBlockN, int kGroups, bool kCausal, bool kBf16, bool kStagedOutput>
__global__ void __launch_bounds__(FwdTile<kHeadDim, kBlockN, kGroups, kStagedOutput>::kThreads, 1) CF_CLUSTER_DIMS
    flash_fwd_sm90(const __grid_constant__ FwdParams p) {
    using Tl = FwdTile<kHeadDim, kBlockN, kGroups, kStagedOutput>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // 128-byte swizzled TMA tiles need 1024-byte aligned destinations.
    const u32 smem = (smem_addr(smem_raw) + 1023) & ~1023u;
    const FwdBarriers bars{smem + Tl::kBarriers};
    if (threadIdx.x == 0) {
        mbarrier_init(bars.tile_full(), 1);
        mbarrier_init(bars.tile_empty(), 32 * Tl::kConsumerWarps);
        mbarrier_init(bars.o_empty(), Tl::kGroups);
        for (int s = 0; s < Tl::kQStages; ++s) {
            mbarrier_init(bars.q_full(s), 1);
            mbarrier_init(bars.q_empty(s), Tl::kConsumerWarps);
        }
        for (int s = 0; s < Tl::kStages; ++s) {
            mbarrier_init(bars.k_full(s), 1);
            mbarrier_init(bars.k_empty(s), Tl::kConsumerWarps * kClusterCtas);
            mbarrier_init(bars.v_full(s), 1);
            mbarrier_init(bars.v_empty(s), Tl::kConsumerWarps * kClusterCtas);
        }
        fence_barrier_init();
        TileWalk<kCausal>::take_place(bars, p);
    }
    __syncthreads();
#ifdef CF_CLUSTER_KV
    static_assert(!kCausal && !Tl::kOOverV, "clusters: non-causal whole-tile walks");
    cluster_sync();  // the other CTA's barriers are initialised before any multicast or arrival
#endif
    const int group = threadIdx.x / 128;
    if (group == 0) {
        registers_release<Tl::kProducerRegs>();
        if (threadIdx.x == 0) produce<Tl, kCausal>(p, smem, bars);
    } else {
        registers_claim<Tl::kConsumerRegs>();
        consume<Tl, kCausal, kBf16>(p, smem, bars, group - 1);
    }
#ifdef CF_CLUSTER_KV
    cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
#endif
}
