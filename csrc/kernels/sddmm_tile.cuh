// SDDMM tile: S[16, 8] = Q_window[16, D] * K_cols[8, D]^T for one TCB, on
// mma.m16n8k16 with fp32 accumulation.
//
// Load scheme. The mma's k index (= head-dim index d) is permuted so that each
// thread's B values for two consecutive k-steps are 8 consecutive d of one K
// row: a single 16-byte load. For a chunk of 32 d (two k-steps) and thread
// t = lane % 4:
//   step 2u,   k 2t..2t+1  -> d = 32u + 8t + 0..1     (b0 / a0, a1)
//   step 2u,   k 2t+8..+9  -> d = 32u + 8t + 2..3     (b1 / a2, a3)
//   step 2u+1, k 2t..2t+1  -> d = 32u + 8t + 4..5
//   step 2u+1, k 2t+8..+9  -> d = 32u + 8t + 6..7
// The dot product over d is order-independent, so permuting Q's A fragment the
// same way gives the exact S. For D = 16 (one k-step) the chunk is 16 d and each
// thread loads 4 consecutive d (8 bytes).
#pragma once

#include "mma_utils.cuh"

namespace gt_fused3s {

template <int kDW>
struct SddmmLayout {
    static_assert(kDW == 16 || kDW % 32 == 0, "head-dim slice must be 16 or a multiple of 32");
    static constexpr int kSteps = kDW / 16;                   // k-steps of 16
    static constexpr int kChunk = kDW >= 32 ? 32 : 16;        // d per permutation chunk
    static constexpr int kChunks = kDW / kChunk;
    static constexpr int kWordsPerChunk = kChunk / 8;         // 32-bit words per thread per chunk
    static constexpr int kStepsPerChunk = kChunk / 16;
    // Element offset of thread t's load inside chunk u.
    static __device__ __forceinline__ int offset(int u, int t) { return u * kChunk + t * (kChunk / 4); }
};

// A fragments of Q for the whole head-dim slice: [kSteps][4] words, rows g, g+8.
template <int kDW>
struct QFragment {
    uint32_t a[SddmmLayout<kDW>::kSteps][4];
};

// B fragments of K for one TCB: [kSteps][2] words, column g of the TCB.
template <int kDW>
struct KFragment {
    uint32_t b[SddmmLayout<kDW>::kSteps][2];
};

// q_row0 / q_row1: pointers to d = 0 of the warp's slice in rows g and g+8 (may be
// dangling when the row is out of range: valid0 / valid1 false -> zeros).
template <int kDW>
__device__ __forceinline__ void load_q_fragment(QFragment<kDW>& qf, const uint16_t* q_row0, bool valid0,
                                                const uint16_t* q_row1, bool valid1, int t) {
    using L = SddmmLayout<kDW>;
#pragma unroll
    for (int u = 0; u < L::kChunks; ++u) {
        uint32_t w0[L::kWordsPerChunk], w1[L::kWordsPerChunk];
        load_words<L::kWordsPerChunk>(w0, q_row0 + L::offset(u, t), valid0);
        load_words<L::kWordsPerChunk>(w1, q_row1 + L::offset(u, t), valid1);
#pragma unroll
        for (int s = 0; s < L::kStepsPerChunk; ++s) {
            const int step = u * L::kStepsPerChunk + s;
            qf.a[step][0] = w0[2 * s];
            qf.a[step][1] = w1[2 * s];
            qf.a[step][2] = w0[2 * s + 1];
            qf.a[step][3] = w1[2 * s + 1];
        }
    }
}

// The B fragments of one K row, its words read by load(words, pointer).
template <int kDW, typename Load>
__device__ __forceinline__ void k_fragment_from(KFragment<kDW>& kf, const uint16_t* k_row, int t, const Load& load) {
    using L = SddmmLayout<kDW>;
#pragma unroll
    for (int u = 0; u < L::kChunks; ++u) {
        uint32_t w[L::kWordsPerChunk];
        load(w, k_row + L::offset(u, t));
#pragma unroll
        for (int s = 0; s < L::kStepsPerChunk; ++s) {
            const int step = u * L::kStepsPerChunk + s;
            kf.b[step][0] = w[2 * s];
            kf.b[step][1] = w[2 * s + 1];
        }
    }
}

// k_row: pointer to d = 0 of the warp's slice in the K row of this thread's TCB
// column (g); valid false (padding column -1) -> zeros, no load.
template <int kDW>
__device__ __forceinline__ void load_k_fragment(KFragment<kDW>& kf, const uint16_t* k_row, bool valid, int t) {
    k_fragment_from<kDW>(kf, k_row, t, [&](uint32_t (&w)[SddmmLayout<kDW>::kWordsPerChunk], const uint16_t* p) {
        load_words<SddmmLayout<kDW>::kWordsPerChunk>(w, p, valid);
    });
}

// The same from a shared-memory copy of the row (zeros for padding).
template <int kDW>
__device__ __forceinline__ void load_k_fragment_shared(KFragment<kDW>& kf, const uint16_t* k_row, int t) {
    k_fragment_from<kDW>(kf, k_row, t, [](uint32_t (&w)[SddmmLayout<kDW>::kWordsPerChunk], const uint16_t* p) {
        shared_words<SddmmLayout<kDW>::kWordsPerChunk>(w, p);
    });
}

// S for two TCBs at once (two independent accumulation chains for ILP).
// s[x][0..3] = accumulator of TCB x (c0..c3 layout), unscaled.
template <typename T, int kDW>
__device__ __forceinline__ void sddmm_pair(float (&s)[2][4], const QFragment<kDW>& qf,
                                           const KFragment<kDW> (&kf)[2]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[x][i] = 0.f;
    }
#pragma unroll
    for (int step = 0; step < SddmmLayout<kDW>::kSteps; ++step) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            mma_16816<T>(s[x], qf.a[step], kf[x].b[step][0], kf[x].b[step][1]);
        }
    }
}

}  // namespace gt_fused3s
