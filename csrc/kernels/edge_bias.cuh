// Terms per edge: an additive attention bias, score_ij = scale q_i.k_j +
// bias_e,h for the edge e = j -> i (and, in the backward, its gradient dS and
// an additive dP term; the forward instances with scores write q_i.k_j per edge).
//
// Each non-zero of a BSB is one edge (a duplicate has a column of its own).
// Its place in the format's non-zero order (TCBs in order; inside a TCB,
// word 0 then word 1 of the bitmap, bits ascending) is
//     nnz = nnz_offset[tcb] + (set bits of the TCB below it),
// and slot_edge[nnz] is its edge id in the caller's order. The kernels read
// and write per-edge arrays in the caller's layout, [E, H] (element e of
// head h at e * H + h), through slot_edge: no permutation of them before or
// after a kernel (those were four gathers per attention call with a bias).
//
// The non-zeros of a TCB pair are one run [off, off + n) of that order (n: the
// pair's set bits: 14-17 on average, at most 64, on cora, citeseer, pubmed,
// zinc, molhiv, peptides, github and the 200k power-law graph, where a TCB's 8
// columns hold about one edge each; BSBGraph.stats: nnz_per_pair_*). So the warp loads a pair's edge ids and
// values together, lane l taking non-zeros l and l + 32 (two coalesced loads
// where each thread had eight dependent gathers, and 6 registers carried to
// the next pair instead of 24), and each thread takes its scores' values by
// shuffles from the lane of their rank in the pair (PairBias::expand).
// Per-edge outputs go the other way through a warp's 64 floats of shared memory
// (store_all). A pair with more than 64 non-zeros (denser than those graphs;
// tests: dense_pairs) reads and writes per element instead. A null bias
// (weights or dropout alone) reads as 0. Measured on an H100 (attention with
// an edge bias over attention without, forward + backward, 200k power-law
// graph, H = 4 / 1 / 8, D = 16 / 64 / 32; docs/edge_attention_h100_*.csv):
// 2.84 / 2.38 / 2.49x before, 1.81 / 1.44 / 1.66x with this and the backward's
// occupancy; forward alone 2.1 -> 1.8x. The eight gathers per thread, and the
// half occupancy they needed, were the cost, not their order: the caller's
// edges permuted into the format's order changed nothing (same run).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "fused3s_params.h"
#include "tcb_pair.cuh"

namespace gt_fused3s {

// A work item's non-zeros pair after pair: the next pair's first non-zero
// (each pair's follows from the previous pair's count, so only the item's
// two ends are read from nnz_offset) and the edge ids of its lanes, loaded a
// pair ahead of its values (PairBias::load), which are loaded a pair ahead
// of use: no load waits on another in the loop.
struct EdgeCursor {
    int32_t off, end;   // the next pair's first non-zero; the item's end
    int32_t le[2];      // slot_edge[off + lane], [off + lane + 32] (-1 past end), in flight
    __device__ __forceinline__ void fetch(const EdgeBiasArgs& eb, int lane) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = off + lane + 32 * h;
            le[h] = j < end ? __ldg(eb.slot_edge + j) : -1;
        }
    }
    __device__ __forceinline__ void start(const EdgeBiasArgs& eb, int tcb_begin, int tcb_end, int lane) {
        off = __ldg(eb.nnz_offset + tcb_begin);
        end = __ldg(eb.nnz_offset + tcb_end);
        fetch(eb, lane);
    }
};

// Ranks in the pair's run of this thread's 8 scores, in the mma C layout of
// the tiles (x: TCB a, b; i = 0, 1 row g, cols 2t, 2t+1; i = 2, 3 row g+8),
// one byte each (element (x, i) in byte i of rank[x]), and which of them are
// edges (bit 4x + i of `on`); n: the pair's non-zeros.
__device__ __forceinline__ void pair_ranks(uint32_t (&rank)[2], uint32_t& on, int& n, const PairRaw& r, int lane) {
    const int sh = 2 * lane;   // bits 2L, 2L+1 of word 0 (row g) and word 1 (row g+8)
    const uint64_t below = (uint64_t(1) << sh) - 1u;
    int base = 0;
    on = 0u;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const uint4 w = x ? r.wb : r.wa;
        const uint64_t w0 = (uint64_t(w.y) << 32) | w.x, w1 = (uint64_t(w.w) << 32) | w.z;
        const int r0 = base + __popcll(w0 & below);
        const int r1 = base + __popcll(w0) + __popcll(w1 & below);
        const uint32_t b0 = static_cast<uint32_t>(w0 >> sh) & 3u, b1 = static_cast<uint32_t>(w1 >> sh) & 3u;
        rank[x] = static_cast<uint32_t>(r0) | (static_cast<uint32_t>(r0 + (b0 & 1u)) << 8) |
                  (static_cast<uint32_t>(r1) << 16) | (static_cast<uint32_t>(r1 + (b1 & 1u)) << 24);
        on |= (b0 | (b1 << 2)) << (4 * x);
        base += __popcll(w0) + __popcll(w1);
    }
    n = base;
}

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

// Non-zeros one warp moves per pair through lanes (two per lane).
constexpr int kPairLaneNnz = 64;

// The edge terms of one TCB pair. `load` (one pair ahead of use) fetches the
// pair's run lane by lane; `expand` (in uniform control flow: it shuffles)
// gives this thread's 8 scores their values: the bias in log2 units, the dP
// bias (kDpBias, backward) and the dropout mask (kDrop: only the instances
// with dropout pay for it).
template <bool kEdges, bool kDpBias = false, bool kDrop = false>
struct PairBias {
    // Loaded: the run [off, off + n); lane l's non-zeros l and l + 32 (edge
    // id, -1 past n; bias log2e; dP bias); this thread's ranks and edge bits.
    int32_t off, n;
    uint32_t rank[2], on;
    int32_t le[2];
    float lb[2];
    float lc[kDpBias ? 2 : 1];
    // Expanded: per element (x, i) of this thread; edge ids only for a pair
    // beyond kPairLaneNnz (for its dropout hashes and bias loads).
    float b2[2][4];
    float c[kDpBias ? 2 : 1][4];
    int32_t edge[2][4];
    uint32_t keep;   // bit 4x + i: element (x, i) survives dropout (all set without dropout)

    __device__ __forceinline__ bool has(int x, int i) const { return (on >> (4 * x + i)) & 1u; }
    __device__ __forceinline__ int rank_of(int x, int i) const { return (rank[x] >> (8 * i)) & 0xffu; }

    // The pair of `r`, the cursor's next; the cursor moves on to the pair
    // after it and fetches that one's edge ids.
    __device__ __forceinline__ void load(const PairRaw& r, EdgeCursor& ec, const EdgeBiasArgs& eb, int lane,
                                         int head) {
        pair_ranks(rank, on, n, r, lane);
        off = ec.off;
#pragma unroll
        for (int h = 0; h < 2; ++h) le[h] = (lane + 32 * h < n && n <= kPairLaneNnz) ? ec.le[h] : -1;
        ec.off += n;
        ec.fetch(eb, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t at = static_cast<int64_t>(le[h]) * eb.num_heads + head;
            lb[h] = (le[h] >= 0 && eb.bias != nullptr) ? __ldg(eb.bias + at) * 1.4426950408889634f : 0.f;
            if constexpr (kDpBias) lc[h] = (le[h] >= 0 && eb.dp_bias != nullptr) ? __ldg(eb.dp_bias + at) : 0.f;
        }
    }

    __device__ __forceinline__ void expand(const EdgeBiasArgs& eb, int head) {
        keep = 0xffu;
        if (n <= kPairLaneNnz) {   // warp-uniform
            const bool two = n > 32;
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    // every lane shuffles (a shuffle under a lane-dependent
                    // condition hangs the warp); `two` is warp-uniform
                    const int k = rank_of(x, i);
                    float b = __shfl_sync(0xffffffffu, lb[0], k & 31);
                    if (two) {
                        const float b1 = __shfl_sync(0xffffffffu, lb[1], k & 31);
                        b = k < 32 ? b : b1;
                    }
                    b2[x][i] = has(x, i) ? b : 0.f;
                    if constexpr (kDpBias) {
                        float cv = __shfl_sync(0xffffffffu, lc[0], k & 31);
                        if (two) {
                            const float c1 = __shfl_sync(0xffffffffu, lc[1], k & 31);
                            cv = k < 32 ? cv : c1;
                        }
                        c[x][i] = has(x, i) ? cv : 0.f;
                    }
                }
            }
            if constexpr (kDrop) {   // one hash per non-zero, spread by ballots
                const uint32_t k0 = __ballot_sync(0xffffffffu, le[0] >= 0 && dropout_hash(eb, head, le[0]) >= eb.drop_threshold);
                const uint32_t k1 = __ballot_sync(0xffffffffu, le[1] >= 0 && dropout_hash(eb, head, le[1]) >= eb.drop_threshold);
#pragma unroll
                for (int x = 0; x < 2; ++x) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int k = rank_of(x, i);
                        const uint32_t bit = ((k < 32 ? k0 : k1) >> (k & 31)) & 1u;
                        if (has(x, i) && !bit) keep &= ~(1u << (4 * x + i));
                    }
                }
            }
        } else {   // a dense pair: per element
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) edge[x][i] = has(x, i) ? __ldg(eb.slot_edge + off + rank_of(x, i)) : -1;
            }
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int e = edge[x][i];
                    const int64_t at = static_cast<int64_t>(e) * eb.num_heads + head;
                    b2[x][i] = (e >= 0 && eb.bias != nullptr) ? __ldg(eb.bias + at) * 1.4426950408889634f : 0.f;
                    if constexpr (kDpBias) c[x][i] = (e >= 0 && eb.dp_bias != nullptr) ? __ldg(eb.dp_bias + at) : 0.f;
                    if constexpr (kDrop) {
                        if (e >= 0 && dropout_hash(eb, head, e) < eb.drop_threshold) keep &= ~(1u << (4 * x + i));
                    }
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
    // out[edge * H + head] = v[x][i] for every edge of the pair (after
    // expand; the whole warp calls it). xfer: 64 floats of shared memory of
    // this warp, where the values go from their rank's thread to its lane.
    __device__ __forceinline__ void store_all(float* out, int num_heads, int head, const float (&v)[2][4],
                                              float* xfer, int lane, const EdgeBiasArgs& eb) const {
        if (n <= kPairLaneNnz) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (has(x, i)) xfer[rank_of(x, i)] = v[x][i];
                }
            }
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (le[h] >= 0) out[static_cast<int64_t>(le[h]) * num_heads + head] = xfer[lane + 32 * h];
            }
            __syncwarp();   // xfer is free for the next pair
        } else {   // edge ids read again (not kept in registers from expand)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (has(x, i)) {
                        const int e = __ldg(eb.slot_edge + off + rank_of(x, i));
                        out[static_cast<int64_t>(e) * num_heads + head] = v[x][i];
                    }
                }
            }
        }
    }
};

// Without edge terms: nothing stored, nothing loaded (the compiler removes
// every trace of it).
template <>
struct PairBias<false, false> {
    __device__ __forceinline__ void load(const PairRaw&, EdgeCursor&, const EdgeBiasArgs&, int, int) {}
    __device__ __forceinline__ void expand(const EdgeBiasArgs&, int) {}
    __device__ __forceinline__ float add(float v, int, int) const { return v; }
    __device__ __forceinline__ float add_dp(float v, int, int) const { return v; }
    __device__ __forceinline__ float drop(float v, int, int, const EdgeBiasArgs&) const { return v; }
};

}  // namespace gt_fused3s
