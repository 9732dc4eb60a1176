// Fused 3S backward: one kernel, two passes (fused3s_bwd_params.h), on tensor
// cores, with nothing of size [E, H] in memory.
//
// Work decomposition as in the forward: a block is a warp-team (one warp, two
// for D = 256, each owning half of the head dim) running one (chunk of a row
// window, head or head group) work item from the same heaviest-first
// schedule; chunks of a
// split window add their fp32 partials and the last one to finish writes.
//
// Per TCB pair (a, b), with the window's 16 rows as the mma M dimension:
//   S  [16, 16] = A1 G1^T        scores, recomputed
//   dP [16, 16] = A2 G2^T
//   P  = exp2(S * scale log2e + bias log2e - lse log2e)   (bitmap mask -> 0;
//        bias: the edge bias, in instances that have one, edge_bias.cuh)
//   dS = P * (dP + dp_bias - delta)           (dropout: dP = m dO.v with the
//        forward's factor m, 0 or 1 / (1 - p), and dV uses m P; dp_bias: an extra dP per edge,
//        the gradient of the probabilities if they were returned; the dQ
//        pass writes dS per edge as the bias gradient)
//   out1 [16, D] += dS G1        (dQ pass: dQ; dKV pass: dK)
//   out2 [16, D] += P  G2        (dKV pass: dV)
// G1 and G2 serve both as B^T (scores) and as B (accumulation), so their
// gathered rows go through shared memory (cp.async, double buffered: the next
// pair's rows load while this pair computes) and are read by ldmatrix in both
// shapes. lse and delta belong to the destination i: per window row in the dQ
// pass, per gathered column in the dKV pass.
//
// Head groups (kG > 1: head dims 16 and 32, the kG heads of every operand
// adjacent in memory): one warp runs kG consecutive heads of an
// item, w = item * (H / kG) + group. Each gathered row's kG heads are then one
// copy of kG x D elements (a 128-byte row at kG x D = 64, where a warp per
// head copied 32 or 64 bytes per row and head), and the pair's columns and
// bitmap are walked once for kG heads; each head keeps its own scores, P,
// dS, row statistics and accumulators (the tile's k-steps and n-tiles of
// head h are h's own); the edge terms load each non-zero's kG values in one
// access and place them once for the kG heads (edge_bias.cuh).
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "fused3s_bwd_params.h"
#include "edge_bias.cuh"
#include "mma_utils.cuh"
#include "smem_tile.cuh"
#include "tcb_pair.cuh"
#include "team.cuh"

// Widest head-dim slice one warp owns (a tuning knob, -DGT_FUSED3S_BWD_SLICE=64
// to try). Measured on an H100 (kernel time, dQ + dKV pass, D = 128): slices
// of 128 beat 64 (teams of 2 warps exchanging partial scores each pair) by
// 3-10% and 32 by 35-75%, although 64 doubles the resident warps.
#ifndef GT_FUSED3S_BWD_SLICE
#define GT_FUSED3S_BWD_SLICE 128
#endif

namespace gt_fused3s {

template <int kHeadDim, bool kDKV, int kG = 1>
struct BwdConfig {
    static_assert(kHeadDim == 16 || kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                  "head dim must be 16, 32, 64, 128 or 256");
    // Head-dim slice per warp: at most kMaxSlice (a warp's accumulators are one
    // [16, kDW] fp32 tile in the dQ pass, two in the dKV pass); wider head dims
    // split over a team of warps that add up their partial scores.
    static constexpr int kMaxSlice = GT_FUSED3S_BWD_SLICE;
    static constexpr int kDW = kHeadDim < kMaxSlice ? kHeadDim : kMaxSlice;
    static constexpr int kSplit = kHeadDim / kDW;                        // warps per team
    static constexpr int kThreads = kSplit * 32;
    static constexpr int kNT = kDW / 8;        // n-tiles of the accumulators
    static constexpr int kSteps = kDW / 16;    // k-steps of the score mmas
    static constexpr int kGroupDim = kDW * kG;
    using Tile = RowTile<kGroupDim>;   // a head group's rows side by side
    // Per warp: A1, A2 and two stages of (G1, G2).
    static constexpr int kWarpSmem = 6 * Tile::kBytes;
    static constexpr int kSmemBytes = kSplit * kWarpSmem;
    // Resident warps per SM the registers allow (occupancy hint).
    static constexpr int kWarpsPerSM = kGroupDim <= 32 ? 16 : (kGroupDim == 64 ? 12 : 8);
    static constexpr int kMinBlocks = kWarpsPerSM / kSplit > 0 ? kWarpsPerSM / kSplit : 1;
};

// Stores two consecutive values (fp32 in) as T or fp32.
template <typename T>
__device__ __forceinline__ void store_pair(void* base, int64_t off, bool as_fp32, float x, float y) {
    if (as_fp32) {
        *reinterpret_cast<float2*>(reinterpret_cast<float*>(base) + off) = make_float2(x, y);
    } else {
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(base) + off) = TypeTraits<T>::pack(x, y);
    }
}

// delta = rowsum(dO * O) of one row, full head dim, summed over the 4 threads
// t of the row (each takes 8 consecutive elements of every 32).
template <typename T, int kHeadDim>
__device__ __forceinline__ float row_delta(const Fused3SBwdParams& p, int row, int head, int t) {
    float acc = 0.f;
    if (row < p.num_nodes) {
        const uint16_t* dout = reinterpret_cast<const uint16_t*>(p.d_out.ptr) + row * p.d_out.row_stride +
                               head * p.d_out.head_stride;
        const int64_t o_off = row * p.out.row_stride + head * p.out.head_stride;
#pragma unroll
        for (int d = 8 * t; d < kHeadDim; d += 32) {
            const uint4 g = __ldg(reinterpret_cast<const uint4*>(dout + d));
            const uint32_t gw[4] = {g.x, g.y, g.z, g.w};
            float o[8];
            if (p.o_fp32) {
                const float4* src = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p.out.ptr) + o_off + d);
                const float4 x = __ldg(src), y = __ldg(src + 1);
                o[0] = x.x; o[1] = x.y; o[2] = x.z; o[3] = x.w; o[4] = y.x; o[5] = y.y; o[6] = y.z; o[7] = y.w;
            } else {
                const uint4 x = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p.out.ptr) + o_off + d));
                const uint32_t xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = TypeTraits<T>::unpack(xw[i]);
                    o[2 * i] = f.x; o[2 * i + 1] = f.y;
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = TypeTraits<T>::unpack(gw[i]);
                acc += f.x * o[2 * i] + f.y * o[2 * i + 1];
            }
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    return acc;
}

// kEdges: 0 none, 1 edge terms, 2 edge terms and attention dropout; 3 and
// 4: 1 and 2 with a dP bias (dp_bias: edge features, returned weights). The
// dP bias is an instance of its own: a bias alone then carries none of its
// registers and places (the dQ pass of groups of 4 fits 168 registers).
// Instances with edge terms ask for 3/4 of the plain kernel's resident
// blocks (all of them at D = 16 without dropout): the most without spills
// (ptxas, sm_90a; but 4 bytes of stack in the D = 64 dK/dV instances) since
// the warp loads the edge terms lane by lane (edge_bias.cuh); they asked for
// 1/2 before, which cost more than the loads (200k power-law graph, H100:
// dK/dV pass with a bias 2.76 -> 1.55 ms at H = 4, D = 16).
// Head groups with edge terms: kBwdGroupEdgeWarps resident warps an SM (a
// warp sits in one of an SM's four register partitions: 12 warps give 168
// registers a thread, 8 give 255; at kG x D = 64 the tiles and the edge
// terms' places of 10 warps fill its shared memory).
constexpr int kBwdGroupEdgeWarps = 8;
// The dQ pass of groups of 2 runs 10 (168 registers, no spills at sm_90a;
// the shared memory of 10 needs the largest carveout, prefer_max_shared):
// 6-8% faster with a bias than at 8 (H = 8, D = 32 on the 200k power-law
// graph, github and zinc x1024, H100). Groups of 4 run 10 without a dP bias
// (4 bytes of spills); with one they spill 52-64 bytes at 168 registers and
// measured 15-24% slower at 10. The dK/dV pass of groups of 2 runs 10 too
// (0-12 bytes of spills at D = 16, 8-64 at D = 32): 2-6% faster with a dP bias
// on zinc and molhiv x1024, 3% with a bias at H = 8, D = 32 on the 200k
// graph, 1-2% slower on github there (docs/bwd_group_warps_ab_h100_aa6f350.csv);
// groups of 4 spill 40-72 bytes there and stay at 8.
__host__ __device__ constexpr bool bwd_dropout(int kEdges) { return kEdges == 2 || kEdges == 4; }
__host__ __device__ constexpr bool bwd_dp_bias(int kEdges) { return kEdges >= 3; }

template <bool kDKV, int kG, int kEdges>
constexpr int bwd_group_edge_warps() {
    const bool fits = kG == 2 || (!kDKV && !bwd_dp_bias(kEdges));
    return fits ? 10 : kBwdGroupEdgeWarps;
}

template <int kEdges, int kMinBlocks, int kDW, int kG = 1, bool kDKV = false>
constexpr int bwd_min_blocks() {
    constexpr int kEdgeWarps = bwd_group_edge_warps<kDKV, kG, kEdges>();
    return kG > 1 ? (kEdges == 0 ? kMinBlocks : (kMinBlocks < kEdgeWarps ? kMinBlocks : kEdgeWarps))
                  : ((kEdges == 0 || (!bwd_dropout(kEdges) && kDW == 16)) ? kMinBlocks : (kMinBlocks * 3 + 3) / 4);
}

template <typename T, int kHeadDim, bool kDKV, int kEdges, int kG>
__global__ void __launch_bounds__(BwdConfig<kHeadDim, kDKV, kG>::kThreads,
                                  bwd_min_blocks<kEdges, BwdConfig<kHeadDim, kDKV, kG>::kMinBlocks,
                                                 BwdConfig<kHeadDim, kDKV, kG>::kDW, kG, kDKV>())
fused3s_bwd_kernel(const Fused3SBwdParams p) {
    constexpr bool kBias = kEdges > 0;
    using Cfg = BwdConfig<kHeadDim, kDKV, kG>;
    static_assert(kG == 1 || (Cfg::kSplit == 1 && kG <= max_head_group(kHeadDim)), "head groups: head dims 16 and 32");
    using Tile = typename Cfg::Tile;
    constexpr int kDW = Cfg::kDW;
    constexpr int kNT = Cfg::kNT;
    constexpr int kSteps = Cfg::kSteps;   // k-steps of one head
    constexpr int kSplit = Cfg::kSplit;
    constexpr float kLog2e = 1.4426950408889634f;

    extern __shared__ __align__(16) unsigned char smem[];
    // D = 256: partial S and dP of the team's warps, [double buffer][part][16][32].
    __shared__ float s_xchg[kSplit > 1 ? 2 * kSplit * 16 * 32 : 1];
    __shared__ int s_bcast;
    // Each warp's places of its pairs' edge terms (edge_bias.cuh: PairSlots).
    using Bias = PairBias<kBias, bwd_dp_bias(kEdges), bwd_dropout(kEdges), kG>;
    __shared__ typename Bias::Slots s_slots[kBias ? kSplit : 1];

    const int lane = threadIdx.x & 31;
    const int part = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = lane == 0 && part == 0;

    const uint32_t warp_smem = smem_addr(smem) + part * Cfg::kWarpSmem;
    const uint32_t tile_a1 = warp_smem, tile_a2 = warp_smem + Tile::kBytes;
    auto tile_g = [&](int stage, int which) { return warp_smem + (2 + 2 * stage + which) * Tile::kBytes; };
    // acc += V B: V [16, 16] a pair's two TCBs in the mma C layout (rows g,
    // g + 8; columns 2t, 2t + 1 of TCB a, then of TCB b) packed as the A
    // operand (k 0..7 = TCB a's columns, k 8..15 = TCB b's), B head h's
    // slice of the staged tile at `tile`.
    auto pair_product = [&](float (&acc)[Cfg::kNT][4], const float (&v)[2][4], uint32_t tile, int h) {
        const uint32_t va[4] = {TypeTraits<T>::pack(v[0][0], v[0][1]), TypeTraits<T>::pack(v[0][2], v[0][3]),
                                TypeTraits<T>::pack(v[1][0], v[1][1]), TypeTraits<T>::pack(v[1][2], v[1][3])};
#pragma unroll
        for (int jj = 0; jj < Cfg::kNT / 2; ++jj) {
            uint32_t b[4];
            Tile::b_frags(b, tile, h * (Cfg::kNT / 2) + jj, lane);
            mma_16816<T>(acc[2 * jj], va, b[0], b[1]);
            mma_16816<T>(acc[2 * jj + 1], va, b[2], b[3]);
        }
    };

    const int w = blockIdx.x;   // work index = item * (H / kG) + group, heaviest items first
    const int groups = p.num_heads / kG;
    const int item_idx = w / groups;
    const int head0 = (w - item_idx * groups) * kG;   // the group's first head
    const int4 it = __ldg(reinterpret_cast<const int4*>(p.items_ptr) + item_idx);
    const int window = it.x, tcb_begin = it.y, tcb_end = it.z, slot = it.w;
    if (window < 0) return;   // an unused item of a schedule at capacity (the whole block)
    const int row0 = window * 16 + g, row1 = row0 + 8;
    const int64_t H = p.num_heads;

    auto slice = [&](const Fused3SOperand& op) {
        return reinterpret_cast<const uint16_t*>(op.ptr) + head0 * op.head_stride + part * kDW;
    };
    const uint16_t* g1 = slice(p.g1);
    const uint16_t* g2 = slice(p.g2);

    // dQ pass: lse (log2 units) and delta of the rows g, g+8 per head
    // (computed once the first copies are in flight).
    float row_lse2[kG][2], row_dl[kG][2];
#pragma unroll
    for (int h = 0; h < kG; ++h) row_lse2[h][0] = row_lse2[h][1] = row_dl[h][0] = row_dl[h][1] = 0.f;
    auto load_row_stats = [&]() {
        if constexpr (!kDKV) {
#pragma unroll
            for (int h = 0; h < kG; ++h) {
                const int head = head0 + h;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = r ? row1 : row0;
                    row_dl[h][r] = row_delta<T, kHeadDim>(p, row, head, t);
                    if (row < p.num_nodes) {
                        row_lse2[h][r] = __ldg(p.lse_ptr + row * H + head) * kLog2e;
                        if (kBias && p.delta_extra_ptr != nullptr) row_dl[h][r] += __ldg(p.delta_extra_ptr + row * H + head);
                    }
                }
            }
        }
    };
    // dKV pass: (lse log2e, delta) of the columns 2t, 2t+1 of TCB a, b of a pair, per head.
    auto load_col_stats = [&](const PairMeta& m, float2 (&st)[kG][4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = m.colv[i];
#pragma unroll
            for (int h = 0; h < kG; ++h) st[h][i] = c >= 0 ? __ldg(p.stats_ptr + c * H + head0 + h) : make_float2(0.f, 0.f);
        }
    };

    // The dQ pass keeps its window operands (Q, dO) in registers; the dKV
    // pass, with two accumulators, reads K and V from shared memory per pair.
    constexpr bool kARegs = !kDKV;
    uint32_t a1f[kARegs ? kG * kSteps : 1][4], a2f[kARegs ? kG * kSteps : 1][4];
    // acc += A B^T for k-step `step` of a pair's two TCBs: A the window's 16
    // rows (from registers `af` with kARegs, else from the tile at `tile_a`),
    // B^T the pair's 16 staged rows at `tile_b`.
    auto step_product = [&](float (&acc)[2][4], const uint32_t (&af)[kARegs ? kG * kSteps : 1][4], uint32_t tile_a,
                            uint32_t tile_b, int step) {
        uint32_t a[4], b[4];
        if constexpr (kARegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = af[step][i];
        } else {
            Tile::a_frag(a, tile_a, step, lane);
        }
        Tile::bt_frags(b, tile_b, step, lane);
        mma_16816<T>(acc[0], a, b[0], b[1]);
        mma_16816<T>(acc[1], a, b[2], b[3]);
    };
    // the products' accumulators per head: dQ (dQ pass), dK and dV (dKV pass)
    float acc1[kG][kNT][4];
    float acc2[kG][kDKV ? kNT : 1][4];
#pragma unroll
    for (int h = 0; h < kG; ++h) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) acc1[h][j][0] = acc1[h][j][1] = acc1[h][j][2] = acc1[h][j][3] = 0.f;
#pragma unroll
        for (int j = 0; j < (kDKV ? kNT : 1); ++j) acc2[h][j][0] = acc2[h][j][1] = acc2[h][j][2] = acc2[h][j][3] = 0.f;
    }

    if (tcb_begin == tcb_end) load_row_stats();   // rows without in-neighbours: delta = 0, lse = -inf
    if (tcb_begin < tcb_end) {
        const uint4* bitmap = reinterpret_cast<const uint4*>(p.bitmap_ptr);
        const int wrow = window * 16 + (lane & 15);
        Tile::load_async(tile_a1, slice(p.a1), p.a1.row_stride, tile_a2, slice(p.a2), p.a2.row_stride,
                         wrow < p.num_nodes ? wrow : -1, lane);
        cp_async_commit();

        PairRaw raw;
        auto load_raw = [&](int tcb) { load_pair_raw(raw, p.cols_ptr, bitmap, tcb, tcb_end, lane); };
        EdgeCursor ec;   // the edge terms' walk over the item's non-zeros
        if constexpr (kBias) ec.start(p.bias, tcb_begin, tcb_end, lane);
        load_raw(tcb_begin);
        PairMeta cur = decode_pair(raw, lane);
        Bias bcur, bnxt;
        typename Bias::Slots& slots = s_slots[kBias ? part : 0];
        bcur.load(raw, ec, p.bias, lane, head0);
        Tile::load_async(tile_g(0, 0), g1, p.g1.row_stride, tile_g(0, 1), g2, p.g2.row_stride, raw.c, lane);
        cp_async_commit();
        load_row_stats();
        if constexpr (kARegs) {
            cp_async_wait<1>();   // the window tiles (not yet the first pair's rows)
            __syncwarp();
#pragma unroll
            for (int step = 0; step < kG * kSteps; ++step) {
                Tile::a_frag(a1f[step], tile_a1, step, lane);
                Tile::a_frag(a2f[step], tile_a2, step, lane);
            }
        }
        float2 cur_st[kG][4];
        if constexpr (kDKV) load_col_stats(cur, cur_st);
        if (tcb_begin + 2 < tcb_end) load_raw(tcb_begin + 2);

        int stage = 0, buf = 0;
        for (int base = tcb_begin;; base += 2) {
            const bool has_next = base + 2 < tcb_end;
            PairMeta nxt;
            float2 nxt_st[kG][4];
            if (has_next) {   // rows of the next pair fly while this one computes
                nxt = decode_pair(raw, lane);
                Tile::load_async(tile_g(stage ^ 1, 0), g1, p.g1.row_stride, tile_g(stage ^ 1, 1), g2,
                                 p.g2.row_stride, raw.c, lane);
                if constexpr (kDKV) load_col_stats(nxt, nxt_st);
                bnxt.load(raw, ec, p.bias, lane, head0);
                if (base + 4 < tcb_end) load_raw(base + 4);
            }
            cp_async_commit();
            cp_async_wait<1>();   // this pair's rows (and the window tiles) have landed
            __syncwarp();
            // this pair's edge terms per element (edge_bias.cuh), ahead of the
            // products, whose latency hides the places' round trip
            bcur.expand(p.bias, head0, slots, lane);

#pragma unroll
            for (int h = 0; h < kG; ++h) {
                // Scores and dP of head h for TCBs a (x = 0) and b (x = 1): its own k-steps.
                float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
                for (int hs = 0; hs < kSteps; ++hs) {
                    const int step = h * kSteps + hs;
                    step_product(s, a1f, tile_a1, tile_g(stage, 0), step);    // S = Q K^T
                    step_product(dp, a2f, tile_a2, tile_g(stage, 1), step);   // dP = dO V^T
                }
                if constexpr (kSplit > 1) {
                    // Sum the team's partial dot products (same order in every warp).
                    float* x = s_xchg + buf * kSplit * 16 * 32;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        x[(part * 16 + i) * 32 + lane] = s[i >> 2][i & 3];
                        x[(part * 16 + 8 + i) * 32 + lane] = dp[i >> 2][i & 3];
                    }
                    __syncthreads();
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        float sa = 0.f, da = 0.f;
#pragma unroll
                        for (int q2 = 0; q2 < kSplit; ++q2) {
                            sa += x[(q2 * 16 + i) * 32 + lane];
                            da += x[(q2 * 16 + 8 + i) * 32 + lane];
                        }
                        s[i >> 2][i & 3] = sa;
                        dp[i >> 2][i & 3] = da;
                    }
                    buf ^= 1;
                }

                // P and dS in the mma C layout: i = 0, 1 row g, i = 2, 3 row g+8;
                // column 2t + (i & 1) of TCB x.
                bcur.select(p.bias, slots, h, lane);   // head h's edge terms
                float pv[2][4], ds[2][4];
#pragma unroll
                for (int x = 0; x < 2; ++x) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const bool on = (cur.mask >> (4 * x + i)) & 1u;
                        const float lse2 = kDKV ? cur_st[h][2 * x + (i & 1)].x : row_lse2[h][i >> 1];
                        const float dl = kDKV ? cur_st[h][2 * x + (i & 1)].y : row_dl[h][i >> 1];
                        pv[x][i] = on ? fast_exp2(bcur.add(s[x][i] * p.scale_log2, x, i) - lse2) : 0.f;
                        // dropout: dP = dO.v times the element's factor (0 or 1 / (1 - p))
                        ds[x][i] = pv[x][i] * (bcur.add_dp(bcur.drop(dp[x][i], x, i, p.bias), x, i) - dl);
                    }
                }
                if constexpr (kBias && !kDKV) {
                    // d loss / d bias_e = dS_ij: each edge is one score of one chunk, written once.
                    if (p.bias.grad != nullptr && part == 0) bcur.stage(slots, h, ds, lane);   // warp-uniform
                }
                pair_product(acc1[h], ds, tile_g(stage, 0), h);     // dQ = dS K (dK = dS^T Q)
                if constexpr (kDKV) {
                    // dV = P^T dO with the dropped P of the forward's SpMM
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) pv[x][i] = bcur.drop(pv[x][i], x, i, p.bias);
                    }
                    pair_product(acc2[h], pv, tile_g(stage, 1), h);
                }
            }
            if constexpr (kBias && !kDKV) {
                if (p.bias.grad != nullptr && part == 0) bcur.flush(p.bias.grad, p.bias.num_heads, head0, slots, lane, p.bias);
            }
            if (!has_next) break;
            __syncwarp();   // every lane is done with this stage before it is refilled
            cur = nxt;
            bcur = bnxt;
            if constexpr (kDKV) {
#pragma unroll
                for (int h = 0; h < kG; ++h) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) cur_st[h][i] = nxt_st[h][i];
                }
            }
            stage ^= 1;
        }
    }

    // Accumulator layout: acc[h][j][0, 1] = row g, d = 8j + 2t, +1; [2, 3] = row g+8.
    const int col0 = part * kDW + 2 * t;
    bool write_out = slot < 0;
    if (!write_out) {
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            const int64_t prow = (static_cast<int64_t>(slot) * H + head0 + h) * 16;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int64_t off = (prow + g + 8 * r) * kHeadDim + col0;
#pragma unroll
                for (int j = 0; j < kNT; ++j) {
                    store_pair<T>(p.part1_ptr, off + 8 * j, true, acc1[h][j][2 * r], acc1[h][j][2 * r + 1]);
                    if constexpr (kDKV) store_pair<T>(p.part2_ptr, off + 8 * j, true, acc2[h][j][2 * r], acc2[h][j][2 * r + 1]);
                }
            }
        }
        __threadfence();   // partial visible GPU-wide before the arrival is counted
        team_sync<kSplit>();
        const int4 si = __ldg(reinterpret_cast<const int4*>(p.slots_ptr) + slot);
        const int s0 = si.y, s1 = si.z;
        // one counter per group (its first head's)
        const int prev = leader ? atomicAdd(p.counters_ptr + static_cast<int64_t>(s0) * H + head0, 1) : 0;
        write_out = team_broadcast<kSplit>(prev, leader, s_bcast) == s1 - s0 - 1;   // this team completed the window
        if (write_out) {
            __threadfence();
#pragma unroll
            for (int h = 0; h < kG; ++h) {
#pragma unroll
                for (int j = 0; j < kNT; ++j) {
                    acc1[h][j][0] = acc1[h][j][1] = acc1[h][j][2] = acc1[h][j][3] = 0.f;
                    if constexpr (kDKV) acc2[h][j][0] = acc2[h][j][1] = acc2[h][j][2] = acc2[h][j][3] = 0.f;
                }
                for (int sl = s0; sl < s1; ++sl) {
                    const int64_t srow = (static_cast<int64_t>(sl) * H + head0 + h) * 16;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int64_t off = (srow + g + 8 * r) * kHeadDim + col0;
#pragma unroll
                        for (int j = 0; j < kNT; ++j) {
                            const float2 x = __ldcg(reinterpret_cast<const float2*>(p.part1_ptr + off + 8 * j));
                            acc1[h][j][2 * r] += x.x;
                            acc1[h][j][2 * r + 1] += x.y;
                            if constexpr (kDKV) {
                                const float2 y = __ldcg(reinterpret_cast<const float2*>(p.part2_ptr + off + 8 * j));
                                acc2[h][j][2 * r] += y.x;
                                acc2[h][j][2 * r + 1] += y.y;
                            }
                        }
                    }
                }
            }
        }
    }
    if (write_out) {
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            const int head = head0 + h;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = r ? row1 : row0;
                if (row >= p.num_nodes) continue;
                const int64_t off = (row * H + head) * kHeadDim + col0;
#pragma unroll
                for (int j = 0; j < kNT; ++j) {
                    store_pair<T>(p.out1_ptr, off + 8 * j, p.grad_fp32, acc1[h][j][2 * r] * p.scale,
                                  acc1[h][j][2 * r + 1] * p.scale);
                    if constexpr (kDKV) {
                        store_pair<T>(p.out2_ptr, off + 8 * j, p.grad_fp32, acc2[h][j][2 * r], acc2[h][j][2 * r + 1]);
                    }
                }
                if constexpr (!kDKV) {
                    if (t == 0 && part == 0) p.stats_ptr[row * H + head] = make_float2(row_lse2[h][r], row_dl[h][r]);
                }
            }
        }
    }
}

template <typename T, int kHeadDim, bool kDKV, int kEdges, int kG>
cudaError_t launch_fused3s_bwd_pass(const Fused3SBwdParams& params, cudaStream_t stream) {
    using Cfg = BwdConfig<kHeadDim, kDKV, kG>;
    const int64_t work = static_cast<int64_t>(params.num_items) * (params.num_heads / kG);
    if (work <= 0) return cudaSuccess;
    if (params.num_slots > 0) {
        const size_t bytes = sizeof(int32_t) * static_cast<size_t>(params.num_slots) * params.num_heads;
        const cudaError_t err = cudaMemsetAsync(params.counters_ptr, 0, bytes, stream);
        if (err != cudaSuccess) return err;
    }
    constexpr auto kernel = fused3s_bwd_kernel<T, kHeadDim, kDKV, kEdges, kG>;
    cudaError_t err = set_max_dynamic_smem<kernel>(Cfg::kSmemBytes);
    if (err != cudaSuccess) return err;
    if (kG > 1 && kEdges > 0 && bwd_group_edge_warps<kDKV, kG, kEdges>() > kBwdGroupEdgeWarps) {   // their shared memory
        err = prefer_max_shared<kernel>();
        if (err != cudaSuccess) return err;
    }
    kernel<<<static_cast<unsigned>(work), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
    return cudaGetLastError();
}

// One pass with the head group the host asked for (params.head_group: 1, or
// 2 / 4 where max_head_group allows).
template <typename T, int kHeadDim, bool kDKV, int kEdges>
cudaError_t launch_fused3s_bwd_group(const Fused3SBwdParams& params, cudaStream_t stream) {
    if constexpr (max_head_group(kHeadDim) > 1) {
        if (params.head_group == 2) return launch_fused3s_bwd_pass<T, kHeadDim, kDKV, kEdges, 2>(params, stream);
        if constexpr (max_head_group(kHeadDim) >= 4) {
            if (params.head_group == 4) return launch_fused3s_bwd_pass<T, kHeadDim, kDKV, kEdges, 4>(params, stream);
        }
    }
    return launch_fused3s_bwd_pass<T, kHeadDim, kDKV, kEdges, 1>(params, stream);
}

template <typename T, int kHeadDim, int kEdges>
cudaError_t run_fused3s_bwd(const Fused3SBwdParams& dq_pass, const Fused3SBwdParams& dkv_pass, cudaStream_t stream) {
    // The dQ pass writes delta, which the dKV pass reads: same stream, in order.
    const cudaError_t err = launch_fused3s_bwd_group<T, kHeadDim, false, kEdges>(dq_pass, stream);
    if (err != cudaSuccess) return err;
    return launch_fused3s_bwd_group<T, kHeadDim, true, kEdges>(dkv_pass, stream);
}

}  // namespace gt_fused3s
