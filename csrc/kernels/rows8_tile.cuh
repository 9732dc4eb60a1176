// The tiles of the 8-row kernels (rows8_params.h). Per block, lane (g, t) =
// (lane / 4, lane % 4) holds, in the mma's fragments:
//   S^T accumulator (m = column, n = row): columns g and g + 8, rows 2t, 2t + 1
//   (mask bits 2 lane, 2 lane + 1 of bitmap words 0 and 1, as in the BSB);
//   Q^T as B (k = head dim, n = row): row g, the head-dim permutation of
//   sddmm_tile.cuh (KFragment), and K rows as A (m = column): columns g,
//   g + 8 (QFragment), so that S^T = K Q^T reuses the 16-row loaders;
//   X^T as A (m = head dim, k = column) for O^T = V^T P^T and the backward's
//   K^T, Q^T, dO^T: 4 gathered rows (columns 2t, 2t + 1, 2t + 8, 2t + 9),
//   each lane D / 8 consecutive head dims of each (VFragment of spmm_tile.cuh),
//   m-tile j taking dims g D / 8 + 2j (m = g) and + 1 (m = g + 8);
//   P^T as B (k = column, n = row) from the S^T accumulator by movmatrix
//   (the 8 x 8 transpose of each half);
//   accumulators O^T (m = head dim, n = row): rows 2t, 2t + 1, dims
//   g D / 8 + 2j and + 1 for every m-tile j: D / 8 consecutive dims per row.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "mma_utils.cuh"
#include "rows8_params.h"
#include "sddmm_tile.cuh"
#include "spmm_tile.cuh"

namespace gt_fused3s {

// A block's column ids (lane l: column l % 16) and bitmap, as loaded.
struct Block8 {
    int32_t c;
    uint4 w;   // (word 0 low, word 0 high, word 1 low, word 1 high)
};

__device__ __forceinline__ void load_block8(Block8& b, const Rows8Format& f, int tcb, int lane) {
    b.c = __ldg(f.cols + tcb * 16 + (lane & 15));
    b.w = __ldg(f.bitmap + tcb);
}

// This lane's 4 edge bits, in accumulator order: (column g, rows 2t, 2t + 1),
// (column g + 8, rows 2t, 2t + 1).
__device__ __forceinline__ uint32_t block8_mask(const Block8& b, int lane) {
    const bool hi = lane >= 16;
    const int sh = (2 * lane) & 31;
    const uint32_t w0 = hi ? b.w.y : b.w.x, w1 = hi ? b.w.w : b.w.z;
    return ((w0 >> sh) & 3u) | (((w1 >> sh) & 3u) << 2);
}

// The 8 x 8 transpose of a b16 matrix held one row pair per lane (sm_75+).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
    uint32_t y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
#else
    y = x;
    __trap();
#endif
    return y;
}

// B fragment (k = column, n = row) of a [16 columns, 8 rows] matrix whose
// accumulator values this lane holds as x[0..3] (S^T order).
template <typename T>
__device__ __forceinline__ void columns_as_b(uint32_t& b0, uint32_t& b1, const float (&x)[4]) {
    b0 = transpose8x8(TypeTraits<T>::pack(x[0], x[1]));
    b1 = transpose8x8(TypeTraits<T>::pack(x[2], x[3]));
}

// A fragment of m-tile j of X^T from the 4 gathered rows of this lane.
template <int kDW>
__device__ __forceinline__ void transposed_a(uint32_t (&a)[4], const VFragment<kDW>& f, int j) {
    a[0] = __byte_perm(f.w[0][j], f.w[1][j], 0x5410u);
    a[1] = __byte_perm(f.w[0][j], f.w[1][j], 0x7632u);
    a[2] = __byte_perm(f.w[2][j], f.w[3][j], 0x5410u);
    a[3] = __byte_perm(f.w[2][j], f.w[3][j], 0x7632u);
}

// One head of an input operand: its rows' base and stride (2-byte elements).
struct HeadRows {
    const uint16_t* base;
    int64_t stride;
    __device__ __forceinline__ HeadRows(const Rows8Operand& x, int head)
        : base(reinterpret_cast<const uint16_t*>(x.ptr) + static_cast<int64_t>(head) * x.head_stride),
          stride(x.row_stride) {}
    __device__ __forceinline__ const uint16_t* row(int64_t r) const { return base + r * stride; }
};

// X rows of the block's columns g and g + 8 as the A fragment of S^T.
template <int kDW>
__device__ __forceinline__ void load_columns_a(QFragment<kDW>& f, const HeadRows& x, int c, int g, int t) {
    const int c0 = __shfl_sync(0xffffffffu, c, g), c1 = __shfl_sync(0xffffffffu, c, g + 8);
    load_q_fragment<kDW>(f, x.row(c0 < 0 ? 0 : c0), c0 >= 0, x.row(c1 < 0 ? 0 : c1), c1 >= 0, t);
}

// X rows of the block's columns 2t, 2t + 1, 2t + 8, 2t + 9, for X^T.
template <int kDW>
__device__ __forceinline__ void load_columns_t(VFragment<kDW>& f, const HeadRows& x, int c, int g, int t) {
    const uint16_t* rows[4];
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int cc = __shfl_sync(0xffffffffu, c, 2 * t + (i & 1) + 8 * (i >> 1));
        valid[i] = cc >= 0;
        rows[i] = x.row(cc < 0 ? 0 : cc);
    }
    load_v_fragment<kDW>(f, rows, valid, g);
}

// One warp's work: (window, head) w = blockIdx.x = item * H + head, the
// window's blocks [begin, end) (one 16-byte load), and this lane's place.
struct Rows8Item {
    int lane, g, t, head, window, begin, end;
    int64_t out_stride;   // H * D: the outputs' rows ([N, H, D] contiguous)
    __device__ __forceinline__ Rows8Item(const Rows8Format& f, int num_heads, int head_dim) {
        lane = threadIdx.x;
        g = lane >> 2;
        t = lane & 3;
        const int item = blockIdx.x / num_heads;
        head = blockIdx.x - item * num_heads;
        const int4 wi = __ldg(f.windows + item);
        window = wi.x;
        begin = wi.y;
        end = wi.z;
        out_stride = static_cast<int64_t>(num_heads) * head_dim;
    }
    // this lane's window row (n = g of the B operands); clamped to row 0 past N
    __device__ __forceinline__ int row() const { return window * 8 + g; }
    __device__ __forceinline__ int clamped_row(int num_nodes) const { return row() < num_nodes ? row() : 0; }
};

// Two score-shaped products of a block, s = X_cols Y^T and s2 = Z_cols W^T
// (A: the block's columns' rows of x and z; B: the window rows' fragments).
template <typename T, int kDW>
__device__ __forceinline__ void block_scores2(float (&s)[4], float (&s2)[4], const HeadRows& x, const HeadRows& z,
                                              const KFragment<kDW>& yb, const KFragment<kDW>& wb, int c,
                                              const Rows8Item& w) {
    QFragment<kDW> xa, za;
    load_columns_a<kDW>(xa, x, c, w.g, w.t);
    load_columns_a<kDW>(za, z, c, w.g, w.t);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = s2[i] = 0.f;
#pragma unroll
    for (int st = 0; st < kDW / 16; ++st) {
        mma_16816<T>(s, xa.a[st], yb.b[st][0], yb.b[st][1]);
        mma_16816<T>(s2, za.a[st], wb.b[st][0], wb.b[st][1]);
    }
}

// acc[j] += X^T (m-tile j) B for every m-tile, X^T from 4 gathered rows.
template <typename T, int kDW>
__device__ __forceinline__ void accumulate_t(float (&acc)[kDW / 16][4], const VFragment<kDW>& xt, uint32_t b0,
                                             uint32_t b1) {
#pragma unroll
    for (int j = 0; j < kDW / 16; ++j) {
        uint32_t a[4];
        transposed_a<kDW>(a, xt, j);
        mma_16816<T>(acc[j], a, b0, b1);
    }
}

// Rows 2t, 2t + 1 of window rows row0.. of an O^T-shaped accumulator, times
// mul[i] (row 2t + i), as T or fp32, into [N, H, D] at head `head`.
template <typename T, int kDW>
__device__ __forceinline__ void store_rows8(void* out, bool as_fp32, int64_t row_stride, int head, int row0,
                                            int num_nodes, int g, int t, const float (&acc)[kDW / 16][4],
                                            const float (&mul)[2]) {
    constexpr int kMT = kDW / 16;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = row0 + 2 * t + i;
        if (row >= num_nodes) continue;
        const int64_t off = static_cast<int64_t>(row) * row_stride + static_cast<int64_t>(head) * kDW + g * (kDW / 8);
        if (as_fp32) {
            float* dst = reinterpret_cast<float*>(out) + off;
#pragma unroll
            for (int j = 0; j < kMT; ++j)
                *reinterpret_cast<float2*>(dst + 2 * j) = make_float2(acc[j][i] * mul[i], acc[j][2 + i] * mul[i]);
            continue;
        }
        uint32_t w[kMT];
#pragma unroll
        for (int j = 0; j < kMT; ++j) w[j] = TypeTraits<T>::pack(acc[j][i] * mul[i], acc[j][2 + i] * mul[i]);
        uint32_t* dst = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(out) + off);
        if constexpr (kMT >= 4) {
#pragma unroll
            for (int x = 0; x < kMT; x += 4) *reinterpret_cast<uint4*>(dst + x) = make_uint4(w[x], w[x + 1], w[x + 2], w[x + 3]);
        } else if constexpr (kMT == 2) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        } else {
            *dst = w[0];
        }
    }
}

}  // namespace gt_fused3s
