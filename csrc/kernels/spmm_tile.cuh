// SpMM tile: O[16, D] += P[16, 16] * V[16 cols, D] on mma.m16n8k16, where the
// 16 k-columns are the 8 columns of TCB a followed by the 8 of TCB b.
//
// Load scheme. The mma's output index n is permuted: n-tile j, column g maps to
// head-dim index d = g * (D / 8) + j. Then the V values a thread needs from one
// gathered row are D / 8 consecutive elements (one or two 16-byte loads for
// D = 64, 128), and it needs 4 rows: columns 2t, 2t+1 of TCB a (k 2t, 2t+1)
// and of TCB b (k 2t+8, 2t+9). Pairs of rows are interleaved into the B
// registers with a byte permute.
//
// Accumulator layout after the permutation: thread (g, t) holds, for row g
// (c0, c1) and row g+8 (c2, c3) and every n-tile j, d = 2t * (D/8) + j and
// (2t+1) * (D/8) + j, i.e. the contiguous range [t * D/4, (t+1) * D/4).
#pragma once

#include "mma_utils.cuh"

namespace gt_fused3s {

template <int kDW>
struct SpmmLayout {
    static constexpr int kNT = kDW / 8;           // n-tiles of 8
    static constexpr int kRowWords = kDW / 16;    // 32-bit words per thread per V row
    // Element offset of thread g's segment inside a V row slice.
    static __device__ __forceinline__ int offset(int g) { return g * (kDW / 8); }
};

// V values of the 4 gathered rows of one thread for one TCB pair.
template <int kDW>
struct VFragment {
    uint32_t w[4][SpmmLayout<kDW>::kRowWords];
};

// v_row[i]: pointer to d = 0 of the warp's slice in gathered row i (cols 2t, 2t+1
// of TCB a, cols 2t, 2t+1 of TCB b); valid false (padding) -> zeros, no load.
template <int kDW>
__device__ __forceinline__ void load_v_fragment(VFragment<kDW>& vf, const uint16_t* const (&v_row)[4],
                                                const bool (&valid)[4], int g) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        load_words<SpmmLayout<kDW>::kRowWords>(vf.w[i], v_row[i] + SpmmLayout<kDW>::offset(g), valid[i]);
    }
}

// The same from shared-memory copies of the rows (zeros for padding).
template <int kDW>
__device__ __forceinline__ void load_v_fragment_shared(VFragment<kDW>& vf, const uint16_t* const (&v_row)[4], int g) {
#pragma unroll
    for (int i = 0; i < 4; ++i) shared_words<SpmmLayout<kDW>::kRowWords>(vf.w[i], v_row[i] + SpmmLayout<kDW>::offset(g));
}

// o[j] += P * V for every n-tile j.
template <typename T, int kDW>
__device__ __forceinline__ void spmm_pair(float (&o)[SpmmLayout<kDW>::kNT][4], const uint32_t (&p)[4],
                                          const VFragment<kDW>& vf) {
#pragma unroll
    for (int j = 0; j < SpmmLayout<kDW>::kNT; ++j) {
        const int w = j >> 1;
        // Element j of each row sits in word j/2, low half if j even.
        const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(vf.w[0][w], vf.w[1][w], sel);   // k 2t, 2t+1
        const uint32_t b1 = __byte_perm(vf.w[2][w], vf.w[3][w], sel);   // k 2t+8, 2t+9
        mma_16816<T>(o[j], p, b0, b1);
    }
}

// Store one row of the accumulator (the 2 * kNT values [t * D/4, (t+1) * D/4)
// of this thread, from o[j][c_lo] then o[j][c_hi]) times mul, as T or as fp32.
// dst points to the first element.
template <typename T, int kNT>
__device__ __forceinline__ void store_row(void* dst, bool out_fp32, const float (&o)[kNT][4], int c_lo, int c_hi,
                                          float mul) {
    if (out_fp32) {
        float* d = reinterpret_cast<float*>(dst);
        float vals[2 * kNT];
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
            vals[j] = o[j][c_lo] * mul;
            vals[kNT + j] = o[j][c_hi] * mul;
        }
#pragma unroll
        for (int i = 0; i < 2 * kNT; i += 4) {
            *reinterpret_cast<float4*>(d + i) = make_float4(vals[i], vals[i + 1], vals[i + 2], vals[i + 3]);
        }
    } else {
        uint32_t w[kNT];   // 2 * kNT halves
#pragma unroll
        for (int j = 0; j < kNT; j += 2) {
            w[j / 2] = TypeTraits<T>::pack(o[j][c_lo] * mul, o[j + 1][c_lo] * mul);
            w[kNT / 2 + j / 2] = TypeTraits<T>::pack(o[j][c_hi] * mul, o[j + 1][c_hi] * mul);
        }
        if constexpr (kNT % 4 == 0) {
#pragma unroll
            for (int i = 0; i < kNT; i += 4) {
                *reinterpret_cast<uint4*>(reinterpret_cast<uint32_t*>(dst) + i) = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
            }
        } else {   // kNT == 2 (D = 16): 4 halves = 8 bytes
            *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        }
    }
}

}  // namespace gt_fused3s
