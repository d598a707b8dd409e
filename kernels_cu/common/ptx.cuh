// PTX wrappers used by every cuflash2 kernel family: cp.async, ldmatrix / stmatrix, bulk reductions,
// fast math, shuffles and the 16-bit element types' conversions (the tensor-core MMA instructions
// live with their family: mma_sync/mma.cuh).
// No CUDA toolkit header is included anywhere: bare NVRTC must be able to compile these sources,
// so 16-bit floats travel as raw u16/u32 bit patterns and are converted with PTX.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define CF_DEVICE __device__ __forceinline__

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }  // for compile-time sizes

// 16 bytes moved as one vectorised access.
struct alignas(16) Chunk16 {
    u32 x, y, z, w;
};

// ---- vector width of the call's global accesses ------------------------------------------------
// Bytes per global load/store of q/k/v/out/dout/dq/dk/dv and the caches: the largest of 16/8/4/2
// that divides every base pointer, every stride in bytes and head_dim * 2, chosen by the host per
// call (cuflash2/families/mma_sync/kernel_config.py: vector_width). Each program holds one kernel
// instantiation, so the width comes as a -D define rather than a template argument: without it the
// kernels are 16 bytes wide and compile to exactly the code (and symbols) they had before narrower
// widths existed. Because the
// width divides head_dim * 2, a piece of kVecBytes never straddles head_dim: it is whole or absent.
#ifndef CF_VEC_BYTES
#define CF_VEC_BYTES 16
#endif
enum : int { kVecBytes = CF_VEC_BYTES };  // an enumerator: a constexpr variable would be emitted as a PTX global
static_assert(kVecBytes == 16 || kVecBytes == 8 || kVecBytes == 4 || kVecBytes == 2, "vector width 16/8/4/2 bytes");

// Columns per row of the kernels' own fp32 scratch (dQ/dK/dV accumulators, split-KV partials): the
// head dim, rounded up to 8 when it may not be a multiple of 8 (vector widths below 16), so that the
// scratch keeps its 16-byte rows and paired stores stay inside a row
// (cuflash2/families/mma_sync/kernel_config.py: fp32_cols).
CF_DEVICE int fp32_cols(int head_dim) { return kVecBytes == 16 ? head_dim : (head_dim + 7) & ~7; }

// Generic pointer -> 32-bit shared-state-space address (what ldmatrix / cp.async expect).
CF_DEVICE u32 smem_addr(const void* ptr) {
    u32 addr;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n"
                 : "=r"(addr) : "l"(ptr));
    return addr;
}

// ---- cp.async: global -> shared, 16 bytes, zero-filled when `valid` is false -------------------
CF_DEVICE void cp_async_16(u32 dst, const void* src, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// Narrow cp.async for rows that are only 8- or 4-byte aligned (.ca: .cg takes 16 bytes only),
// zero-filled when `valid` is false (nothing is read then).
template <int kBytes>
CF_DEVICE void cp_async_narrow(u32 dst, const void* src, bool valid) {
    static_assert(kBytes == 8 || kBytes == 4, "cp.async.ca moves 4, 8 or 16 bytes");
    int src_bytes = valid ? kBytes : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" :: "r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes));
}
// 16 bytes into shared memory from registers (the synchronous 2-byte path fills chunks this way).
CF_DEVICE void st_shared_v4(u32 addr, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// 16 bytes to global memory from registers, one instruction (a 16-byte aligned address): written in
// C++, the compiler split some such stores into four 4-byte ones.
CF_DEVICE void st_global_v4(void* ptr, u32 x, u32 y, u32 z, u32 w) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "l"(ptr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
CF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
CF_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(kPending)); }

// ---- ldmatrix: four 8x8 b16 matrices; lane i supplies the row address for matrix i/8 ----------
CF_DEVICE void ldmatrix_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
CF_DEVICE void ldmatrix_x4_trans(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- stmatrix (sm_90): the inverse of ldmatrix_x4 -----------------------------------------------
// Register i of every lane holds its pair of matrix i in the MMA fragment layout (row lane / 4,
// columns 2 (lane % 4), +1); lane i supplies the row address for matrix i / 8, as for ldmatrix.
// One instruction stores what takes four 32-bit stores, with addresses an LdsmCursor
// (mma_sync/swizzled_tile.cuh) provides.
// Lanes store rows other lanes address: order them before another lane's reads (__syncwarp).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
CF_DEVICE void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
#endif

// ---- fast math ---------------------------------------------------------------------------------
CF_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// 1 / x within one ulp, without the IEEE division's fix-up branch for special operands.
CF_DEVICE float fast_reciprocal(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
CF_DEVICE float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// The same value, opaque to the optimiser: what is computed from it is computed where it is used
// instead of being kept live from an earlier identical computation.
CF_DEVICE int opaque_int(int x) {
    int y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
// A value the same in every lane of the warp, read from lane 0: ptxas can then keep it and what is
// computed from it (shared-memory addresses, wgmma descriptors) in uniform registers, as it cannot
// for threadIdx.x / 128 itself although that is warp-uniform too.
CF_DEVICE int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
CF_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
CF_DEVICE u32 shfl_xor_u32(u32 v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

#define CF_INF __int_as_float(0x7f800000)

// ---- element types: float <-> 16-bit conversions ------------------------------------------------
// Kernels are templates on the element type T (Bf16 or Fp16), which also selects the MMA instruction
// of each family (mma_sync/mma.cuh).
struct Bf16 {
    // (lo, hi) -> one register, lo in the low half.
    static CF_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static CF_DEVICE float to_float(u16 x) { return __uint_as_float(((u32)x) << 16); }
};

struct Fp16 {
    static CF_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static CF_DEVICE float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
};

// 4-byte cp.async (for per-row fp32 vectors such as LSE), zero-filled when `valid` is false.
CF_DEVICE void cp_async_4(u32 dst, const void* src, bool valid) {
    int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}

// ---- plain shared-memory loads and stores on a 32-bit shared address ---------------------------
CF_DEVICE void st_shared_f32x2(u32 addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(addr), "f"(x), "f"(y) : "memory");
}
CF_DEVICE void st_shared_f32x4(u32 addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
CF_DEVICE void st_shared_b32(u32 addr, u32 x) { asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(x) : "memory"); }
CF_DEVICE float4 ld_shared_f32x4(u32 addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
CF_DEVICE float2 ld_shared_f32x2(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

// ---- bulk asynchronous reduction, shared -> global (sm_90 and later) ---------------------------
// The copy engine adds `bytes` (a multiple of 16, both addresses 16-byte aligned) of fp32 from shared
// memory into global memory. Shared-memory writes must be ordered before it by fence_proxy_async.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CF_HAS_BULK_REDUCE 1
CF_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
CF_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
CF_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most kPending of this thread's bulk groups still read their shared-memory source.
template <int kPending>
CF_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(kPending) : "memory"); }
// Wait until every bulk group of this thread has completed (global writes included).
CF_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
#else
#define CF_HAS_BULK_REDUCE 0
#endif
