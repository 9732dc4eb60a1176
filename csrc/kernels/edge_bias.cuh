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
// the next pair instead of 24). Each non-zero's place among the threads' mma
// fragments, slot_pos = 128 x + 4 lane + i (element i of TCB x of the pair
// in that lane: online_softmax.cuh), is built with the plan
// (graph.edge_slots), so a lane writes its non-zeros' values to their places
// in the warp's 256 floats of shared memory (PairSlots) and each thread reads
// its 8 places as two float4, free of bank conflicts (PairBias::expand and
// select); per-edge outputs go the other way (stage, flush). A warp running
// a head group (the kernels' head groups) loads each non-zero's values of
// its kG heads in one vector access and writes all of them to kG arrays of
// places at once. A pair with more than 64
// non-zeros (denser than those graphs; tests: dense_pairs) moves the rest
// the same way, 32 a round, loaded where used. A null bias (weights or
// dropout alone) reads as 0.
// Measured on an H100 (attention with an edge bias over attention without,
// forward + backward, 200k power-law graph, H = 4 / 1 / 8, D = 16 / 64 / 32;
// docs/edge_attention_h100_*.csv): 2.84 / 2.38 / 2.49x before, 1.81 / 1.44 /
// 1.66x with the lane loads and the backward's occupancy; forward alone 2.1
// -> 1.8x. The eight gathers per thread, and the half occupancy they needed,
// were the cost, not their order: the caller's edges permuted into the
// format's order changed nothing (same run). Then each thread's ranks of its
// 8 bits (16 popcounts a pair) and a shuffle per element were: 1.72 -> 1.49x
// and 1.45 -> 1.32x at H = 4 and 1 with the places (README: the places of
// the non-zeros). Head groups cut a bias call's kernels 15-17% on the 200k
// graph at 4 and 8 heads, less than the plain attention's 17-31%, so the
// ratio rose there (README: head groups). Then the bias's scaling to log2
// units and the packing of the places, done where they were loaded, made
// the warp wait for those loads in the same iteration (Nsight Compute,
// forward at H = 4, D = 16: 1.16 long-scoreboard stalls an instruction,
// 0.46 without a bias); done where used, a pair later: forward with a bias
// 0.79 -> 0.65 ms (1.97 -> 1.64x the plain one), 1.87 -> 1.65 ms at H = 8,
// D = 32, 0.47 -> 0.42 ms at H = 1, D = 64; the backward 3% faster to 4%
// slower (docs/bias_loads_ab_h100_fa2e58e.csv).
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
    uint32_t lp[2];     // their slot_pos, in flight (combined into one register by PairBias::load,
                        // a pair later: an operation on them here would wait for the loads)
    __device__ __forceinline__ void fetch(const EdgeBiasArgs& eb, int lane) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = off + lane + 32 * h;
            le[h] = j < end ? __ldg(eb.slot_edge + j) : -1;
            lp[h] = j < end ? __ldg(eb.slot_pos + j) : 0u;
        }
    }
    __device__ __forceinline__ void start(const EdgeBiasArgs& eb, int tcb_begin, int tcb_end, int lane) {
        off = __ldg(eb.nnz_offset + tcb_begin);
        end = __ldg(eb.nnz_offset + tcb_end);
        fetch(eb, lane);
    }
};

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
    // (a seed in device memory: one uniform 8-byte load, an L1 hit after the first)
    const uint2 seed = eb.seed_ptr != nullptr ? __ldg(reinterpret_cast<const uint2*>(eb.seed_ptr))
                                              : make_uint2(eb.seed_lo, eb.seed_hi);
    const uint32_t a = mix32(seed.x ^ (static_cast<uint32_t>(head) * 0x9E3779B9u));
    return mix32(mix32(a ^ static_cast<uint32_t>(edge)) + seed.y);
}

// Non-zeros one warp moves per pair through lanes (two per lane).
constexpr int kPairLaneNnz = 64;

// One warp's shared memory for its pairs' edge terms: element (x, i) of
// lane l of head h (of the warp's kG heads) at [h][128 x + 4 l + i] (the
// places of slot_pos), for the bias, the dP bias (kDpBias) and the dropout
// flags (kDrop: 1 = dropped).
template <bool kDpBias, bool kDrop, int kG = 1>
struct PairSlots {
    alignas(16) float bias[kG][256];
    alignas(16) float dp[kDpBias ? kG : 1][kDpBias ? 256 : 4];
    alignas(16) uint8_t drop[kDrop ? kG : 1][kDrop ? 256 : 16];
};

// The 8 floats of this lane's places.
__device__ __forceinline__ void read_places(const float* slots, int lane, float (&v)[2][4]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const float4 a = *reinterpret_cast<const float4*>(slots + 128 * x + 4 * lane);
        v[x][0] = a.x; v[x][1] = a.y; v[x][2] = a.z; v[x][3] = a.w;
    }
}
__device__ __forceinline__ void write_places(float* slots, int lane, const float (&v)[2][4]) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        *reinterpret_cast<float4*>(slots + 128 * x + 4 * lane) = make_float4(v[x][0], v[x][1], v[x][2], v[x][3]);
    }
}

// kG consecutive floats of an [E, H] array at `at` (kG divides H and `at`,
// and the array is aligned to kG floats: one vector access).
template <int kG>
__device__ __forceinline__ void load_heads(const float* src, int64_t at, float (&v)[kG]) {
    if constexpr (kG == 4) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(src + at));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else if constexpr (kG == 2) {
        const float2 a = __ldg(reinterpret_cast<const float2*>(src + at));
        v[0] = a.x; v[1] = a.y;
    } else {
        v[0] = __ldg(src + at);
    }
}
template <int kG>
__device__ __forceinline__ void store_heads(float* dst, int64_t at, const float (&v)[kG]) {
    if constexpr (kG == 4) {
        *reinterpret_cast<float4*>(dst + at) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (kG == 2) {
        *reinterpret_cast<float2*>(dst + at) = make_float2(v[0], v[1]);
    } else {
        dst[at] = v[0];
    }
}

// The edge terms of one TCB pair, for the warp's kG heads head0 ..
// head0 + kG - 1 (head groups: the kernels' head loop). `load` (one pair
// ahead of use) fetches the first kPairLaneNnz non-zeros of the pair's run
// lane by lane, each one's kG values in one access; `expand` (in uniform
// control flow: it synchronises the warp) writes every head's values to the
// warp's places (PairSlots) and `select(h)` gives this thread's 8 scores
// head h's: the bias in log2 units, the dP bias (kDpBias, backward) and the
// dropout mask (kDrop: only the instances with dropout pay for it). Per-edge
// outputs go the other way: `stage(h)` puts head h's values in this
// thread's places, `flush` writes every head's for each non-zero. A pair of
// more non-zeros (denser than the graphs above) moves the rest in rounds of
// 32, loaded where used.
template <bool kEdges, bool kDpBias = false, bool kDrop = false, int kG = 1>
struct PairBias {
    using Slots = PairSlots<kDpBias, kDrop, kG>;
    // Loaded: the run [off, off + n); lane l's non-zeros l and l + 32 (edge
    // id, -1 past n; places; bias as given; dP bias), per head.
    int32_t off, n;
    int32_t le[2];
    uint32_t lp;   // places, bytes 0 and 1
    float lb[2][kG];
    float lc[kDpBias ? 2 : 1][kDpBias ? kG : 1];
    // Selected: head h's value per element (x, i) of this thread.
    float b2[2][4];
    float c[kDpBias ? 2 : 1][4];
    uint32_t keep;   // bit 4x + i: element (x, i) survives dropout (all set without dropout)

    __device__ __forceinline__ uint32_t place(int k) const { return (lp >> (8 * k)) & 0xffu; }

    // The pair of `r`, the cursor's next; the cursor moves on to the pair
    // after it and fetches that one's edge ids and places.
    __device__ __forceinline__ void load(const PairRaw& r, EdgeCursor& ec, const EdgeBiasArgs& eb, int lane,
                                         int head0) {
        n = __popc(r.wa.x) + __popc(r.wa.y) + __popc(r.wa.z) + __popc(r.wa.w) + __popc(r.wb.x) + __popc(r.wb.y) +
            __popc(r.wb.z) + __popc(r.wb.w);
        off = ec.off;
#pragma unroll
        for (int k = 0; k < 2; ++k) le[k] = lane + 32 * k < n ? ec.le[k] : -1;
        lp = ec.lp[0] | (ec.lp[1] << 8);
        ec.off += n;
        ec.fetch(eb, lane);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int64_t at = static_cast<int64_t>(le[k]) * eb.num_heads + head0;
#pragma unroll
            for (int h = 0; h < kG; ++h) lb[k][h] = 0.f;
            // (scaled to log2 units where placed: an operation here would
            // wait for the load within this iteration)
            if (le[k] >= 0 && eb.bias != nullptr) load_heads<kG>(eb.bias, at, lb[k]);
            if constexpr (kDpBias) {
#pragma unroll
                for (int h = 0; h < kG; ++h) lc[k][h] = 0.f;
                if (le[k] >= 0 && eb.dp_bias != nullptr) load_heads<kG>(eb.dp_bias, at, lc[k]);
            }
        }
    }

    // Non-zero `edge`'s terms into its place, every head: the bias in log2
    // units (dropped: flag 1).
    __device__ __forceinline__ void put(Slots& sl, const EdgeBiasArgs& eb, int head0, int32_t edge, uint32_t at,
                                        const float (&b)[kG], const float (&cv)[kG]) const {
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            sl.bias[h][at] = b[h] * 1.4426950408889634f;
            if (kDpBias && eb.dp_bias != nullptr) sl.dp[h][at] = cv[h];
            if constexpr (kDrop) {
                if (dropout_hash(eb, head0 + h, edge) < eb.drop_threshold) sl.drop[h][at] = 1u;
            }
        }
    }

    __device__ __forceinline__ void expand(const EdgeBiasArgs& eb, int head0, Slots& sl, int lane) {
        // this lane's places cleared (no edge: bias 0, kept), then every
        // lane's non-zeros written to their places
        const float zero[2][4] = {};
        const bool dp = kDpBias && eb.dp_bias != nullptr;   // (uniform: a null dP bias reads as 0)
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            write_places(sl.bias[h], lane, zero);
            if (dp) write_places(sl.dp[h], lane, zero);
            if constexpr (kDrop) {
                *reinterpret_cast<uint32_t*>(&sl.drop[h][4 * lane]) = 0u;
                *reinterpret_cast<uint32_t*>(&sl.drop[h][128 + 4 * lane]) = 0u;
            }
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if (le[k] >= 0) {
                if constexpr (kDpBias) put(sl, eb, head0, le[k], place(k), lb[k], lc[k]);
                else put(sl, eb, head0, le[k], place(k), lb[k], lb[k]);
            }
        }
        for (int r = kPairLaneNnz + lane; r < n; r += 32) {   // a dense pair's further non-zeros
            const int32_t e = __ldg(eb.slot_edge + off + r);
            const int64_t at = static_cast<int64_t>(e) * eb.num_heads + head0;
            float b[kG] = {}, cv[kG] = {};
            if (eb.bias != nullptr) load_heads<kG>(eb.bias, at, b);
            if (kDpBias && eb.dp_bias != nullptr) load_heads<kG>(eb.dp_bias, at, cv);
            put(sl, eb, head0, e, __ldg(eb.slot_pos + off + r), b, cv);
        }
        __syncwarp();
    }

    // Head h's values (after expand) in this thread's elements.
    __device__ __forceinline__ void select(const EdgeBiasArgs& eb, const Slots& sl, int h, int lane) {
        read_places(sl.bias[h], lane, b2);
        if constexpr (kDpBias) {
            if (eb.dp_bias != nullptr) {
                read_places(sl.dp[h], lane, c);
            } else {
#pragma unroll
                for (int x = 0; x < 2; ++x) c[x][0] = c[x][1] = c[x][2] = c[x][3] = 0.f;
            }
        }
        keep = 0xffu;
        if constexpr (kDrop) {
            const uint32_t d[2] = {*reinterpret_cast<const uint32_t*>(&sl.drop[h][4 * lane]),
                                   *reinterpret_cast<const uint32_t*>(&sl.drop[h][128 + 4 * lane])};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (((d[e >> 2] >> (8 * (e & 3))) & 0xffu) != 0u) keep &= ~(1u << e);
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
    // Head h's per-edge values v[x][i] into this thread's places (after
    // select(h): the places of head h are then free). Then flush.
    __device__ __forceinline__ void stage(Slots& sl, int h, const float (&v)[2][4], int lane) const {
        write_places(sl.bias[h], lane, v);
    }
    // out[edge * H + head0 + h] = the staged values, every edge of the pair
    // and head (the whole warp calls it).
    __device__ __forceinline__ void flush(float* out, int num_heads, int head0, const Slots& sl, int lane,
                                          const EdgeBiasArgs& eb) const {
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if (le[k] >= 0) {
                float v[kG];
#pragma unroll
                for (int h = 0; h < kG; ++h) v[h] = sl.bias[h][place(k)];
                store_heads<kG>(out, static_cast<int64_t>(le[k]) * num_heads + head0, v);
            }
        }
        for (int r = kPairLaneNnz + lane; r < n; r += 32) {   // a dense pair's further non-zeros
            const uint32_t at = __ldg(eb.slot_pos + off + r);
            float v[kG];
#pragma unroll
            for (int h = 0; h < kG; ++h) v[h] = sl.bias[h][at];
            store_heads<kG>(out, static_cast<int64_t>(__ldg(eb.slot_edge + off + r)) * num_heads + head0, v);
        }
        __syncwarp();   // the places are free for the next pair
    }
};

// Without edge terms: nothing stored, nothing loaded (the compiler removes
// every trace of it).
template <int kG>
struct PairBias<false, false, false, kG> {
    using Slots = PairSlots<false, false>;
    __device__ __forceinline__ void load(const PairRaw&, EdgeCursor&, const EdgeBiasArgs&, int, int) {}
    __device__ __forceinline__ void expand(const EdgeBiasArgs&, int, Slots&, int) {}
    __device__ __forceinline__ void select(const EdgeBiasArgs&, const Slots&, int, int) {}
    __device__ __forceinline__ float add(float v, int, int) const { return v; }
    __device__ __forceinline__ float add_dp(float v, int, int) const { return v; }
    __device__ __forceinline__ float drop(float v, int, int, const EdgeBiasArgs&) const { return v; }
};

}  // namespace gt_fused3s
