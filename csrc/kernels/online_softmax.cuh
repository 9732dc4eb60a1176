// Online (streaming) softmax over the columns of a row window, in fp32, in log2
// units (the scale is pre-multiplied by log2(e), so exp(x) = exp2(x * log2 e)).
//
// Each thread owns two rows of the window (g = lane / 4 and g + 8) and, per TCB
// pair, 4 scores of each row (columns 2t, 2t+1 of TCB a and of TCB b). Row max
// and the per-thread partial row sum are kept in registers; the row sum is
// reduced over the 4 threads of a row only at the end (as in FlashAttention-2).
//
// Masked entries are -inf (never 0). The running max starts at -inf; when a row
// has seen no edge yet its max stays -inf and exponentials are taken against 0,
// so no exp(-inf - -inf) = NaN ever appears.
#pragma once

#include <cmath>
#include "fused3s_params.h"
#include "mma_utils.cuh"

namespace gt_fused3s {

struct SoftmaxState {
    float m[2];   // running row max (log2 units) of rows g, g+8; -inf until an edge is seen
    float l[2];   // per-thread partial row sum of exp2(x - m)
};

__device__ __forceinline__ void softmax_init(SoftmaxState& st) {
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;
}

// O rescaled by the rows' alpha (rows g, g+8).
template <int kNT>
__device__ __forceinline__ void softmax_rescale(float (&o)[kNT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    }
}

// P (probabilities of kPairs pairs, mma C layout) packed as the A fragments
// of the SpMM's m16n8k16: k 0..7 = TCB a's columns, k 8..15 = TCB b's.
template <typename T, int kPairs>
__device__ __forceinline__ void softmax_pack(const float (&x)[kPairs][2][4], uint32_t (&p)[kPairs][4]) {
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
        p[c][0] = TypeTraits<T>::pack(x[c][0][0], x[c][0][1]);   // row g,   k 2t, 2t+1
        p[c][1] = TypeTraits<T>::pack(x[c][0][2], x[c][0][3]);   // row g+8, k 2t, 2t+1
        p[c][2] = TypeTraits<T>::pack(x[c][1][0], x[c][1][1]);   // row g,   k 2t+8, 2t+9
        p[c][3] = TypeTraits<T>::pack(x[c][1][2], x[c][1][3]);   // row g+8, k 2t+8, 2t+9
    }
}

// Several TCB pairs at once (kPairs x 16 columns): one row max, one
// rescale of O and of the row sums for all of them (FlashAttention's step
// over a block of keys); the pair version below is its one-pair case.
// s[x]: raw scores of pair x's TCBs a, b (mma C layout). mask[x]: 8 bits, bit
// 4b + i = element (b, i) (b: TCB a / b; i = 0, 1: row g cols 2t, 2t+1; i = 2,
// 3: row g+8); masked elements are -inf. bias(x, b, i, v): the score v (log2
// units) plus element (x, b, i)'s edge bias; drop(x, b, i, v): v times its
// dropout factor (applied to the SpMM's P only). On return p[x] holds the A
// fragment (packed T) of pair x's P[16, 16] for the SpMM, and o[kNT][4] (the
// SpMM accumulator of this thread) has been rescaled.
template <typename T, int kNT, int kPairs, typename AddBias, typename Drop>
__device__ __forceinline__ void online_softmax_pairs(const float (&s)[kPairs][2][4], const uint32_t (&mask)[kPairs],
                                                     float scale_log2, const AddBias& bias, const Drop& drop,
                                                     SoftmaxState& st, float (&o)[kNT][4], uint32_t (&p)[kPairs][4]) {
    // x[x][b][i]: scaled, masked score. i = 0,1: row g; i = 2,3: row g+8.
    float x[kPairs][2][4];
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bool on = (mask[c] >> (4 * b + i)) & 1u;
                x[c][b][i] = on ? bias(c, b, i, s[c][b][i] * scale_log2) : -INFINITY;
            }
        }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
            mx = fmaxf(mx, fmaxf(fmaxf(x[c][0][2 * r], x[c][0][2 * r + 1]), fmaxf(x[c][1][2 * r], x[c][1][2 * r + 1])));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(st.m[r], mx);
        // Reference point for the exponentials: 0 while the row is still empty.
        const float m_ref = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[r] = fast_exp2(st.m[r] - m_ref);   // m_old = -inf -> 0 (l and o are 0 anyway)
        st.m[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                x[c][b][2 * r] = fast_exp2(x[c][b][2 * r] - m_ref);
                x[c][b][2 * r + 1] = fast_exp2(x[c][b][2 * r + 1] - m_ref);
                sum += x[c][b][2 * r] + x[c][b][2 * r + 1];
            }
        }
        st.l[r] = st.l[r] * alpha[r] + sum;
    }
    // Dropout acts on the SpMM's P only: the row sums above are of the full P.
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
#pragma unroll
            for (int i = 0; i < 4; ++i) x[c][b][i] = drop(c, b, i, x[c][b][i]);
        }
    }
    softmax_rescale(o, alpha);
    softmax_pack<T>(x, p);
}

// A tile of kPairs pairs every score of which counts, without bias or
// dropout (the inside of a sequence mask's band): no mask tests, and the
// scale folded into the exponent, exp2(s * scale - m) in one FFMA per score.
// The row max is taken on the raw scores, which needs scale_log2 >= 0 (the
// sequence op passes a negative scale as -q and -scale). Max and sum are
// trees (a chain of 16 dependent adds per row was a fixed-latency stall).
// The reference point m moves only when a row's max passes it by more than
// kLazyLog2 (FlashAttention-4's conditional rescale): P stays below
// 2^kLazyLog2 (fine in fp16 / bf16, the sums in fp32), and most tiles skip
// the rescale of O and l. Same state (m: the reference, not necessarily
// the max), O and P fragments as online_softmax_pairs.
template <typename T, int kNT, int kPairs>
__device__ __forceinline__ void online_softmax_full(float (&s)[kPairs][2][4], float scale_log2, SoftmaxState& st,
                                                    float (&o)[kNT][4], uint32_t (&p)[kPairs][4]) {
    static_assert(kPairs == 4, "a tile of four pairs (the trees below)");
    constexpr float kLazyLog2 = 8.f;
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float pm[kPairs];
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
            pm[c] = fmaxf(fmaxf(s[c][0][2 * r], s[c][0][2 * r + 1]), fmaxf(s[c][1][2 * r], s[c][1][2 * r + 1]));
        }
        float m = fmaxf(fmaxf(pm[0], pm[1]), fmaxf(pm[2], pm[3]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx[r] = m * scale_log2;
    }
    // warp-uniform: move every row's reference when one row needs it
    if (__any_sync(0xffffffffu, mx[0] > st.m[0] + kLazyLog2 || mx[1] > st.m[1] + kLazyLog2)) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(st.m[r], mx[r]);
            alpha[r] = fast_exp2(st.m[r] - m_new);   // m_old = -inf -> 0 (l and o are 0 anyway)
            st.m[r] = m_new;
            st.l[r] *= alpha[r];
        }
        softmax_rescale(o, alpha);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float ps[kPairs];
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
            float e[4];
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                e[2 * b] = s[c][b][2 * r] = fast_exp2(fmaf(s[c][b][2 * r], scale_log2, -st.m[r]));
                e[2 * b + 1] = s[c][b][2 * r + 1] = fast_exp2(fmaf(s[c][b][2 * r + 1], scale_log2, -st.m[r]));
            }
            ps[c] = (e[0] + e[1]) + (e[2] + e[3]);
        }
        st.l[r] += (ps[0] + ps[1]) + (ps[2] + ps[3]);
    }
    softmax_pack<T>(s, p);
}

// One pair: the graph kernels' step. bias: the pair's edge terms
// (edge_bias.cuh: PairBias): the bias, added in log2 units, and the dropout
// mask, applied to the P of the SpMM.
template <typename T, int kNT, typename Bias>
__device__ __forceinline__ void online_softmax_pair(const float (&s)[2][4], uint32_t mask, float scale_log2,
                                                    const Bias& bias, const EdgeBiasArgs& eb, SoftmaxState& st,
                                                    float (&o)[kNT][4], uint32_t (&p)[4]) {
    const float (&s1)[1][2][4] = *reinterpret_cast<const float (*)[1][2][4]>(&s);
    uint32_t (&p1)[1][4] = *reinterpret_cast<uint32_t (*)[1][4]>(&p);
    const uint32_t m1[1] = {mask};
    online_softmax_pairs<T, kNT, 1>(
        s1, m1, scale_log2, [&](int, int b, int i, float v) { return bias.add(v, b, i); },
        [&](int, int b, int i, float v) { return bias.drop(v, b, i, eb); }, st, o, p1);
}

// Full row sums (the 4 threads of a row hold partial sums).
__device__ __forceinline__ void softmax_finish(SoftmaxState& st) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    }
}

}  // namespace gt_fused3s
