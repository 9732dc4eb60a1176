// Hopper's warpgroup MMA (wgmma, sm_90a): the pieces the sequence forward's
// full tiles use. A warpgroup (4 warps, 128 threads) computes
// D[64, N] (+)= A[64, 16] B[16, N]: A from registers, in the m16n8k16 A
// fragment layout per warp (warp w: rows 16w .. 16w+15), or from shared
// memory (wgmma_m64n64k16_ss: K-major, laid out as a K-major B), B from
// shared memory through a descriptor; D in registers, per warp the m16n8 C layout repeated
// over the N / 8 column tiles (d[4j .. 4j+3]: column tile j). So the 3S
// tiles' fragments (mma_utils.cuh) are wgmma's, four warps at a time.
//
// B's shared memory: rows of 128 bytes (64 16-bit elements) with the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); Sw128Tile
// in smem_tile.cuh), 8-row groups 1024 bytes apart, 1024-byte aligned.
// K-major B (rows = N, the row holds K: the key tile of Q K^T) or N-major B
// (rows = K, the row holds N: the value tile of P V, imm-trans-b = 1).
//
// Everything here compiles to nothing but a trap outside sm_90a
// (__CUDA_ARCH_FEAT_SM90_ALL): callers test kSeqWgmma first.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace gt_fused3s {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GT_WGMMA 1
#else
#define GT_WGMMA 0
#endif

// Whether the device runs `kernel`'s wgmma code: such kernels declare
// __launch_bounds__(GT_WGMMA ? threads : 32), so the image the device got
// (sm_90a, or another build's trap) tells by its bound, read back through
// cudaFuncGetAttributes (no device work; callers keep the answer).
template <typename Kernel>
inline bool wgmma_kernel_runs(Kernel kernel, int threads) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return attr.maxThreadsPerBlock >= threads;
}

// Descriptor of a 128-byte-swizzled operand starting at shared address
// base + offset (1024-byte aligned, or advanced along K inside a row: + 32 bytes a
// k-step of 16 for K-major B). SBO: the 8-row groups' stride (1024 bytes);
// LBO: unused by swizzled K-major layouts, the stride between 64-element
// column panels of N-major ones (one panel at N = 64): 1024 for both.
// The high word is a constant and the low word's address field (14 bits)
// holds any shared address >> 4, so a kernel keeps the low word of one base
// address and adds byte offsets >> 4 to it (wgmma_desc_sw128_at): two
// instructions a descriptor where the masks and shifts took five.
constexpr uint32_t kWgmmaSw128Hi = (1024 >> 4) | (1u << 30);   // SBO; 128-byte swizzle (bit 62)
__device__ __forceinline__ uint32_t wgmma_desc_sw128_lo(uint32_t addr) {
    return ((addr & 0x3FFFFu) >> 4) | ((1024 >> 4) << 16);   // address; LBO
}
__device__ __forceinline__ uint64_t wgmma_desc_sw128_at(uint32_t base_lo, uint32_t offset_bytes) {
    return (static_cast<uint64_t>(kWgmmaSw128Hi) << 32) | (base_lo + (offset_bytes >> 4));
}

// Registers written by other instructions before a wgmma reads them, or
// read after: wgmma.fence orders them; the empty asm keeps the compiler from
// moving accumulator accesses across the asynchronous MMA.
__device__ __forceinline__ void wgmma_fence() {
#if GT_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if GT_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if GT_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Register accesses kept on their side of an asynchronous MMA's wait (the
// MMA reads or writes them after its issue): accumulators, or A fragments.
template <int kN>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[kN][4]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
    }
}
#define GT_WGMMA_D32                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define GT_WGMMA_D32_OPERANDS(d)                                                                                     \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64, 64] (+)= A[64, 16] B[16, 64], fp32 accumulators; accumulate == false:
// D = A B. kTransB: B N-major (rows = K). TY: the PTX type of A and B.
#define GT_WGMMA_M64N64K16_RS(TY)                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " GT_WGMMA_D32                       \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                              \
                 : GT_WGMMA_D32_OPERANDS(d)                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), \
                   "n"(static_cast<int>(kTransB)))

template <typename T, bool kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                bool accumulate) {
#if GT_WGMMA
    if constexpr (std::is_same<T, __half>::value) {
        GT_WGMMA_M64N64K16_RS("f16");
    } else {
        GT_WGMMA_M64N64K16_RS("bf16");
    }
#else
    __trap();
#endif
}

// D[64, 64] (+)= A[64, 16] B[16, 64] with A from shared memory too: K-major
// (the layout of a K-major B: rows of the 64 M, 128-byte swizzled), or
// M-major with kTransA (rows = K, the layout of an N-major B).
#define GT_WGMMA_M64N64K16_SS(TY)                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " GT_WGMMA_D32                       \
                 ", %32, %33, p, 1, 1, %35, %36;\n}\n"                                                        \
                 : GT_WGMMA_D32_OPERANDS(d)                                                                    \
                 : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)),                               \
                   "n"(static_cast<int>(kTransA)), "n"(static_cast<int>(kTransB)))

template <typename T, bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if GT_WGMMA
    if constexpr (std::is_same<T, __half>::value) {
        GT_WGMMA_M64N64K16_SS("f16");
    } else {
        GT_WGMMA_M64N64K16_SS("bf16");
    }
#else
    __trap();
#endif
}

// D[64, 128] (+)= A[64, 16] B[16, 128], A and B K-major in shared memory
// (the band forward's S = Q K^T over 128 keys: seq_band_fwd.cuh); D per
// warp in the m16n8 C layout over 16 column tiles (d[4j .. 4j+3]).
#define GT_WGMMA_D64                                                                                                   \
    "{"                                                                                                              \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                        \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                              \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                              \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                                \
    "}"
#define GT_WGMMA_D64_OPERANDS(d)                                                                                       \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define GT_WGMMA_M64N128K16_SS(TY)                                                                           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " GT_WGMMA_D64                      \
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                               \
                 : GT_WGMMA_D64_OPERANDS(d)                                                                    \
                 : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)))

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if GT_WGMMA
    if constexpr (std::is_same<T, __half>::value) {
        GT_WGMMA_M64N128K16_SS("f16");
    } else {
        GT_WGMMA_M64N128K16_SS("bf16");
    }
#else
    __trap();
#endif
}

#undef GT_WGMMA_M64N128K16_SS
#undef GT_WGMMA_D64
#undef GT_WGMMA_D64_OPERANDS

#undef GT_WGMMA_M64N64K16_SS
#undef GT_WGMMA_M64N64K16_RS
#undef GT_WGMMA_D32
#undef GT_WGMMA_D32_OPERANDS

}  // namespace gt_fused3s
