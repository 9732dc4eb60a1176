// Tensor-core and small device utilities shared by the 3S tiles.
#pragma once

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace gt_fused3s {

// ---------------------------------------------------------------------------
// Element-type traits: the mma instruction and the fp32 -> packed conversion.
// ---------------------------------------------------------------------------
template <typename T> struct TypeTraits;

template <> struct TypeTraits<__half> {
    // Two fp32 -> one .f16x2 register (lo = a, hi = b).
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t x) {
        return __half22float2(*reinterpret_cast<__half2*>(&x));
    }
};

template <> struct TypeTraits<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t*>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t x) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
    }
};

// D[16x8] (fp32) += A[16x16] (row) * B[16x8] (col), fp16 or bf16 operands.
// Fragment layout (g = lane / 4, t = lane % 4):
//   A: a0 = (row g,   k 2t..2t+1)   a1 = (row g+8, k 2t..2t+1)
//      a2 = (row g,   k 2t+8..+9)   a3 = (row g+8, k 2t+8..+9)
//   B: b0 = (k 2t..2t+1, n g)        b1 = (k 2t+8..+9, n g)
//   C: c0,c1 = (row g, n 2t, 2t+1)   c2,c3 = (row g+8, n 2t, 2t+1)
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          uint32_t b0, uint32_t b1);

// TY: the PTX type of A and B.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define GT_MMA_16816(TY)                                                                     \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 "                  \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"         \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#else
#define GT_MMA_16816(TY) __trap()
#endif

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    GT_MMA_16816("f16");
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
    GT_MMA_16816("bf16");
}

#undef GT_MMA_16816

// 2^x with the hardware approximation; ex2.approx(-inf) = +0 by definition, so
// masked scores (-inf) give exactly 0 whatever the compiler flags.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------
// Vector loads of kWords 32-bit words from global memory (read-only path).
// kWords in {1, 2, 4, 8}; the address must be aligned to min(16, 4*kWords) bytes.
// A null-free predicate: pred == false gives zeros and issues no load.
// ---------------------------------------------------------------------------
template <int kWords>
__device__ __forceinline__ void load_words(uint32_t (&dst)[kWords], const void* ptr, bool pred) {
    static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "unsupported vector width");
    if constexpr (kWords % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kWords / 4; ++i) {
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (pred) x = __ldg(reinterpret_cast<const uint4*>(ptr) + i);
            dst[4 * i + 0] = x.x; dst[4 * i + 1] = x.y;
            dst[4 * i + 2] = x.z; dst[4 * i + 3] = x.w;
        }
    } else if constexpr (kWords == 2) {
        uint2 x = make_uint2(0u, 0u);
        if (pred) x = __ldg(reinterpret_cast<const uint2*>(ptr));
        dst[0] = x.x; dst[1] = x.y;
    } else {
        uint32_t x = 0u;
        if (pred) x = __ldg(reinterpret_cast<const unsigned int*>(ptr));
        dst[0] = x;
    }
}

// kWords 32-bit words from shared memory (a staged copy, zeros where a
// row was padding: no predicate), `ptr` aligned to the vector.
template <int kWords>
__device__ __forceinline__ void shared_words(uint32_t (&dst)[kWords], const void* ptr) {
    static_assert(kWords == 1 || kWords == 2 || kWords % 4 == 0, "unsupported vector width");
    if constexpr (kWords % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kWords / 4; ++i) {
            const uint4 x = reinterpret_cast<const uint4*>(ptr)[i];
            dst[4 * i + 0] = x.x; dst[4 * i + 1] = x.y;
            dst[4 * i + 2] = x.z; dst[4 * i + 3] = x.w;
        }
    } else if constexpr (kWords == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(ptr);
        dst[0] = x.x; dst[1] = x.y;
    } else {
        dst[0] = *reinterpret_cast<const uint32_t*>(ptr);
    }
}

// at[0] += a, at[1] += b (8-byte aligned): one vector atomic where the
// device has it (sm_90), two otherwise.
__device__ __forceinline__ void add_pair(float* at, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(at), make_float2(a, b));
#else
    atomicAdd(at, a);
    atomicAdd(at + 1, b);
#endif
}

}  // namespace gt_fused3s
