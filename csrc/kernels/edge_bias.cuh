// Terms per edge: an additive attention bias, score_ij = scale q_i.k_j +
// bias_e,h for the edge e = j -> i (and, in the backward, its gradient dS and
// an additive dP term; the probability pass writes P per edge).
//
// Each non-zero of a BSB is one edge (a duplicate has a column of its own).
// Its place in the format's non-zero order (TCBs in order; inside a TCB,
// word 0 then word 1 of the bitmap, bits ascending) is
//     nnz = nnz_offset[tcb] + (set bits of the TCB below it),
// and slot_edge[nnz] is its edge id in the caller's order. The kernels read
// and write per-edge arrays in the caller's layout, [E, H] (element e of
// head h at e * H + h), through slot_edge: no permutation of them before or
// after a kernel (those were four gathers per attention call with a bias).
// A kernel finds the edge ids of a TCB pair's scores from the pair's bitmap
// words (PairRaw) and loads the next pair's values while the current one
// computes.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "fused3s_params.h"
#include "tcb_pair.cuh"

namespace gt_fused3s {

// The pair's first non-zeros, loaded with its columns and bitmap (two pairs
// ahead of use), so that the values of a pair need one dependent load only.
__device__ __forceinline__ void load_pair_offsets(PairRaw& r, const EdgeBiasArgs& eb, int tcb, int tcb_end) {
    r.off[0] = tcb < tcb_end ? __ldg(eb.nnz_offset + tcb) : 0;
    r.off[1] = tcb + 1 < tcb_end ? __ldg(eb.nnz_offset + tcb + 1) : 0;
}

// Edge ids of this thread's 8 scores of the pair (tcb, tcb + 1), in the mma
// C layout of the tiles (edge[x][i]: TCB x; i = 0, 1 row g, cols 2t, 2t+1;
// i = 2, 3 row g+8), -1 where there is no edge. `r` is the pair's raw data
// with its offsets (before it is overwritten by the pair after next).
__device__ __forceinline__ void pair_edges(int32_t (&edge)[2][4], const PairRaw& r, const int32_t* slot_edge,
                                           int lane) {
    const int sh = 2 * lane;   // bits 2L, 2L+1 of word 0 (row g) and word 1 (row g+8)
    const uint64_t below = (uint64_t(1) << sh) - 1u;
    int32_t nnz[2][4];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const uint4 w = x ? r.wb : r.wa;
        const uint64_t w0 = (uint64_t(w.y) << 32) | w.x, w1 = (uint64_t(w.w) << 32) | w.z;
        const int base = r.off[x];
        const int r0 = base + __popcll(w0 & below);
        const int r1 = base + __popcll(w0) + __popcll(w1 & below);
        const uint32_t b0 = static_cast<uint32_t>(w0 >> sh) & 3u, b1 = static_cast<uint32_t>(w1 >> sh) & 3u;
        nnz[x][0] = (b0 & 1u) ? r0 : -1;
        nnz[x][1] = (b0 & 2u) ? r0 + static_cast<int>(b0 & 1u) : -1;
        nnz[x][2] = (b1 & 1u) ? r1 : -1;
        nnz[x][3] = (b1 & 2u) ? r1 + static_cast<int>(b1 & 1u) : -1;
    }
#pragma unroll   // all 8 loads issued before any is used
    for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int i = 0; i < 4; ++i) edge[x][i] = nnz[x][i] >= 0 ? __ldg(slot_edge + nnz[x][i]) : -1;
    }
}

// Per-edge values of the pair's scores (0 where there is no edge, or no
// array): src[edge * H + head] * mul.
__device__ __forceinline__ void pair_edge_values(float (&out)[2][4], const int32_t (&edge)[2][4], const float* src,
                                                 float mul, int head, int num_heads) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int e = edge[x][i];
            out[x][i] = (src != nullptr && e >= 0)
                            ? __ldg(src + static_cast<int64_t>(e) * num_heads + head) * mul : 0.f;
        }
    }
}

// The edge data a pass keeps per pair: the edge ids (for the outputs per
// edge), the bias in log2 units and, in the backward, the dP bias.
// Attention dropout: a counter-based hash of (seed, head, caller's edge id),
// so the backward regenerates the forward's mask and a test can reproduce
// it (gt_fused3s/ops.py: dropout_keep computes the same in PyTorch). An edge
// is kept iff hash >= threshold = round(p * 2^32).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {   // "lowbias32" finaliser
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ uint32_t dropout_hash(const EdgeBiasArgs& eb, int head, int32_t edge) {
    const uint32_t a = mix32(eb.seed_lo ^ (static_cast<uint32_t>(head) * 0x9E3779B9u));
    return mix32(mix32(a ^ static_cast<uint32_t>(edge)) + eb.seed_hi);
}

// kDrop: the instance applies attention dropout (only those pay for it).
template <bool kEdges, bool kDpBias = false, bool kDrop = false>
struct PairBias {
    int32_t edge[2][4];
    float b2[2][4];
    float c[kDpBias ? 2 : 1][4];
    uint32_t keep;   // bit 4x + i: element (x, i) survives dropout (all set without dropout)
    __device__ __forceinline__ void load(const PairRaw& r, const EdgeBiasArgs& eb, int lane, int head) {
        pair_edges(edge, r, eb.slot_edge, lane);
        pair_edge_values(b2, edge, eb.bias, 1.4426950408889634f, head, eb.num_heads);
        if constexpr (kDpBias) pair_edge_values(c, edge, eb.dp_bias, 1.f, head, eb.num_heads);
        keep = 0xffu;
        if constexpr (kDrop) {   // keyed by the caller's edge id: the same in every pass
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int e = edge[x][i];
                    if (e >= 0 && dropout_hash(eb, head, e) < eb.drop_threshold) keep &= ~(1u << (4 * x + i));
                }
            }
        }
    }
    // v times element (x, i)'s dropout factor: 1 / (1 - p) if kept, else 0
    // (1 without dropout)
    __device__ __forceinline__ float drop(float v, int x, int i, const EdgeBiasArgs& eb) const {
        if constexpr (kDrop) return ((keep >> (4 * x + i)) & 1u) ? v * eb.drop_scale : 0.f;
        else return v;
    }
    // score (log2 units) of element (x, i) plus its bias
    __device__ __forceinline__ float add(float v, int x, int i) const { return v + b2[x][i]; }
    // dP of element (x, i) plus its dP bias
    __device__ __forceinline__ float add_dp(float v, int x, int i) const {
        if constexpr (kDpBias) return v + c[x][i];
        else return v;
    }
    // out[edge * H + head] = v for element (x, i), if it is an edge
    __device__ __forceinline__ void store(float* out, int num_heads, int head, int x, int i, float v) const {
        if (edge[x][i] >= 0) out[static_cast<int64_t>(edge[x][i]) * num_heads + head] = v;
    }
};

// Without edge terms: nothing stored, nothing loaded (the compiler removes
// every trace of it).
template <>
struct PairBias<false, false> {
    __device__ __forceinline__ void load(const PairRaw&, const EdgeBiasArgs&, int, int) {}
    __device__ __forceinline__ float add(float v, int, int) const { return v; }
    __device__ __forceinline__ float add_dp(float v, int, int) const { return v; }
    __device__ __forceinline__ float drop(float v, int, int, const EdgeBiasArgs&) const { return v; }
};

}  // namespace gt_fused3s
