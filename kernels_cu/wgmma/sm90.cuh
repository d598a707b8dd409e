// Hopper (sm_90a) building blocks of the wgmma kernel family: mbarriers, turn counters, TMA tensor
// copies, warpgroup MMA protocol, shared-memory matrix descriptors, register reallocation and named
// barriers. Bare PTX (no CUDA headers), so NVRTC compiles it without a toolkit.
#pragma once
#include "common/ptx.cuh"

typedef unsigned long long u64;

// The 16-bit element type (common/ptx.cuh: Bf16 or Fp16) of the kernels' kBf16 flag (the flag also
// picks the wgmma instruction: wgmma_ops.cuh).
template <bool kBf16>
struct Element16Of {
    using T = Bf16;
};
template <>
struct Element16Of<false> {
    using T = Fp16;
};
template <bool kBf16>
using Element16 = typename Element16Of<kBf16>::T;

// A CUtensorMap as the driver encodes it (cuTensorMapEncodeTiled): 128 opaque bytes, 64-aligned.
// Kernels take it inside a __grid_constant__ parameter and hand its generic address to the TMA.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

// ---- shared-memory words the compiler cannot keep in registers instead ---------------------------
// For values that must stay out of registers across a loop that needs all of them (a tile hand-over
// slot, a walk's place), and that the compiler would otherwise forward from the store to the load.
CF_DEVICE void st_shared_volatile(u32 addr, int value) {
    asm volatile("st.volatile.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(value) : "memory");
}
CF_DEVICE int ld_shared_volatile(u32 addr) {
    int value;
    asm volatile("ld.volatile.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
    return value;
}

// ---- mbarriers ---------------------------------------------------------------------------------
CF_DEVICE void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(arrivals));
}
// Makes the initialised barriers visible to the async proxy (TMA) before anyone uses them.
CF_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// The barrier functions take the barrier's shared-window address (smem_addr): 32 bits to keep
// live instead of a 64-bit generic pointer, which matters in the producer's few registers.
// Producer: one arrival that also announces `bytes` of TMA traffic the phase must wait for.
CF_DEVICE void mbarrier_arrive_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
CF_DEVICE void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
CF_DEVICE bool mbarrier_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Waits until the phase of parity `parity` has completed. CF_HANG_CHECK builds (the debug variant
// the GPU tests run) trap after 4 seconds instead of hanging the GPU on a lost arrival: the launch
// then fails with an error. (No printf: a call would serialise the wgmmas.)
CF_DEVICE u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
    return t;
}
CF_DEVICE void mbarrier_wait(u32 bar, u32 parity) {
#ifdef CF_HANG_CHECK
    if (mbarrier_try_wait(bar, parity)) return;
    const u64 start = global_timer_ns();
    while (!mbarrier_try_wait(bar, parity))
        if (global_timer_ns() - start > 4000000000ull) asm volatile("trap;\n");
#else
    while (!mbarrier_try_wait(bar, parity)) {
    }
#endif
}

// ---- turn counters in global memory (CTAs taking turns) ----------------------------------------
CF_DEVICE int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
CF_DEVICE void add_release_gpu(int* p, int v) { asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory"); }
// Orders global accesses between the generic proxy (the counters) and the async proxy (bulk copies).
CF_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// Spins until *counter == turn (then acquires what the previous holder released). CF_HANG_CHECK
// builds trap after 4 seconds, like the barrier waits.
CF_DEVICE void wait_for_turn(const int* counter, int turn) {
#ifdef CF_HANG_CHECK
    if (ld_acquire_gpu(counter) == turn) return;
    const u64 start = global_timer_ns();
    while (ld_acquire_gpu(counter) != turn)
        if (global_timer_ns() - start > 4000000000ull) asm volatile("trap;\n");
#else
    while (ld_acquire_gpu(counter) != turn) {
    }
#endif
}

// ---- TMA: tensor tiles global -> shared, completing on an mbarrier ----------------------------
CF_DEVICE void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
}
// L2 eviction priorities for cache-hinted loads (values from the PTX createpolicy encoding).
constexpr u64 kEvictFirst = 0x12F0000000000000ull, kEvictLast = 0x14F0000000000000ull;

// dst and bar: shared-window addresses.
CF_DEVICE void tma_load_4d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
        :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
        : "memory");
}

// The same tile into the shared memory of every CTA of the cluster in `cta_mask` (same offset in
// each), completing on the mbarrier at `bar`'s offset in each of them.
CF_DEVICE void tma_load_4d_multicast(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2, int c3,
                                     unsigned short cta_mask, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7, %8;\n"
        :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask), "l"(policy)
        : "memory");
}

// ---- clusters ----------------------------------------------------------------------------------------
CF_DEVICE u32 cluster_cta_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
// Every thread of every CTA of the cluster (threads may arrive from divergent paths).
CF_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// An arrival on the mbarrier at `bar`'s offset in CTA `cta` of the cluster. CTA-scoped release, as
// CUTLASS writes it: the .cluster-scoped form compiles to a full memory barrier before the arrive.
CF_DEVICE void mbarrier_arrive_cluster(u32 bar, u32 cta) {
    asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
                 " mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" :: "r"(bar), "r"(cta) : "memory");
}

// ---- TMA: a tensor tile shared -> global, one bulk group of the issuing thread -------------------
// Writes outside the map's sizes are dropped (partial tiles at the sequence end or the head dim).
// The shared-memory writes must be ordered before it by fence_proxy_async_smem; the source may be
// rewritten once bulk_wait_read (common/ptx.cuh) says the copy has read it.
CF_DEVICE void tma_store_4d(const TensorMap* map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 :: "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src) : "memory");
}

// ---- bulk copy global -> shared (no tensor map), completing on an mbarrier ----------------------
// `bytes` (a multiple of 16, from a 16-byte aligned address) into shared memory at dst; bar expects them.
CF_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// ---- warpgroup MMA protocol --------------------------------------------------------------------
CF_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CF_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
CF_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(kPending) : "memory"); }

// Keeps the compiler from moving reads or writes of wgmma registers across the asynchronous region
// (otherwise ptxas serialises the MMAs with injected waits).
template <int N>
CF_DEVICE void register_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int M, int N>
CF_DEVICE void register_fence(u32 (&r)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j]) :: "memory");
}

// ---- shared-memory matrix descriptors (128-byte swizzle) ---------------------------------------
// Tiles are stored as panels of 64 16-bit columns: row r of a panel is 128 bytes at r * 128, its
// 16-byte chunks XOR-swizzled by r % 8 (what a TMA box of {64, rows} with SWIZZLE_128B writes into
// a 1024-byte aligned destination). Eight rows form a 1024-byte swizzle atom.
//   K-major operand (the reduction dim runs along the 64 columns): atoms of 8 rows follow each
//     other at 1024 bytes (stride offset); the leading offset is unused.
//   MN-major operand (the reduction dim runs down the rows): 8-row atoms at 1024 bytes (stride),
//     the next panel of 64 output columns at `panel_bytes` (leading).
CF_DEVICE u64 smem_descriptor(u32 saddr, u32 leading_bytes, u32 stride_bytes) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)((leading_bytes & 0x3FFFF) >> 4) << 16) |
           ((u64)((stride_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in such a panel.
CF_DEVICE u32 swizzled_chunk(int row, int chunk) { return row * 128 + ((chunk ^ (row % 8)) * 16); }

// A warpgroup's 64-row fp32 accumulator (register 4j + 2r + e: row 16 warp + lane/4 + 8r, column
// 8j + 2 (lane%4) + e), rows times scale[r], as 16-bit values into 64-column panels (`panel_bytes`
// apart from `panels`) laid out as a TMA store of SWIZZLE_128B boxes reads them. stmatrix writes
// four 8 x 8 blocks per instruction: lane l addresses row l % 8 of block l / 8; blocks 0 and 1 are
// rows 0-7 and 8-15 of the warp at columns 8j, blocks 2 and 3 the same rows at 8 (j + 1).
template <bool kBf16, int kRegs>
CF_DEVICE void stage_accumulator(const float (&acc)[kRegs], const float (&scale)[2], u32 panels, u32 panel_bytes,
                                 int warp, int lane) {
    const int block = lane / 8, row = 16 * warp + 8 * (block % 2) + lane % 8;
#pragma unroll
    for (int j = 0; j < kRegs / 4; j += 2) {
        u32 r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int at = 4 * (j + i / 2) + 2 * (i % 2);  // block i: rows i % 2, columns of j + i / 2
            r[i] = Element16<kBf16>::pack(acc[at] * scale[i % 2], acc[at + 1] * scale[i % 2]);
        }
        stmatrix_x4(panels + (j / 8) * panel_bytes + swizzled_chunk(row, j % 8 + block / 2), r);
    }
}

// ---- register reallocation and named barriers --------------------------------------------------
template <int kRegs>
CF_DEVICE void registers_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegs)); }
template <int kRegs>
CF_DEVICE void registers_claim() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegs)); }

template <int kId, int kThreads>
CF_DEVICE void named_barrier_sync() { asm volatile("bar.sync %0, %1;\n" :: "n"(kId), "n"(kThreads) : "memory"); }
// The same barrier reached from different instructions (one code path per consumer group): the
// non-.aligned form, since bar.sync (barrier.sync.aligned) requires every participating thread to
// execute the same instruction.
template <int kId, int kThreads>
CF_DEVICE void named_barrier_sync_across_paths() {
    asm volatile("barrier.sync %0, %1;\n" :: "n"(kId), "n"(kThreads) : "memory");
}
// A barrier whose id is only known at run time (one per consumer group, say): one instruction
// with the id in a register, rather than a branch per id (ptxas then treated the code around the
// branches as divergent and moved the loop's wgmma descriptor arithmetic off the uniform datapath).
template <int kThreads>
CF_DEVICE void named_barrier_sync(int id) { asm volatile("bar.sync %0, %1;\n" :: "r"(id), "n"(kThreads) : "memory"); }
template <int kId, int kThreads>
CF_DEVICE void named_barrier_arrive() { asm volatile("bar.arrive %0, %1;\n" :: "n"(kId), "n"(kThreads) : "memory"); }
