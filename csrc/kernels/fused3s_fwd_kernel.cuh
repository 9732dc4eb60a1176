// Fused 3S forward: SDDMM + online softmax + SpMM per row window, on tensor cores.
//
// Work decomposition. A work item is (chunk of consecutive TCBs of one row
// window, head, or a group of kG heads: head groups, below); one thread block
// (a warp-team: one warp, two for D = 256) runs one item. The host-side
// schedule lists chunks heaviest first and block b runs work index w = b =
// item * (H / kG) + group, so the hardware block scheduler
// starts items in decreasing order of work on whichever SM slot frees up
// (greedy LPT at the granularity of one team). A chunk covering a whole window
// writes the normalised output and lse directly; the chunks of a split (heavy)
// window write their unnormalised fp32 partial (O, m, l) to a workspace slot,
// and the team that completes the window's last chunk (an arrival counter per
// window and head) merges them, so there is no second kernel.
//
// Within a team (one warp; two warps for D = 256, each owning half of the head
// dim), the window's 16 rows are the mma M dimension. Per TCB pair (a, b):
//   SDDMM   S_a, S_b [16, 8] = Q_win K_cols^T      (mma, K gathered from global)
//   softmax online, fp32, log2 domain, -inf masking (bitmap), plus the edge
//           bias if the instance has one (loaded one pair ahead, edge_bias.cuh)
//   SpMM    O[16, D] += [P_a P_b] [16, 16] V[16, D] (P reused from registers)
// K and V rows of the next pair are loaded while the current pair is computed.
//
// Head groups (kG > 1 at head dims 16 and 32, the host's choice: bindings.cpp
// head_group): one warp runs kG consecutive heads of an item, w = item *
// (H / kG) + group. The pair's columns, bitmap and loop are then walked once
// for kG heads instead of once per head, and the kG heads' products are
// independent chains in flight together; each head keeps its own Q, K, V
// fragments (a head's scores sum over its own head dim only), softmax state
// and O. A group's K and V rows are copied to shared memory as whole rows of
// kG x D elements (cp.async, the next pair's during this one's products; the
// heads adjacent in memory), where a warp per head gathered 32- or 64-byte
// pieces of each row straight into its fragments, and each head's fragments
// are read from there in the same layout. The edge terms load each
// non-zero's kG values in one access and place them once for the kG heads
// (edge_bias.cuh). The occupancy hint is the one of a head dim of kG x D
// (group_edge_warps with edge terms).
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "fused3s_params.h"
#include "edge_bias.cuh"
#include "mma_utils.cuh"
#include "sddmm_tile.cuh"
#include "online_softmax.cuh"
#include "smem_tile.cuh"
#include "spmm_tile.cuh"
#include "tcb_pair.cuh"
#include "team.cuh"

namespace gt_fused3s {

template <int kHeadDim>
struct FwdConfig {
    static_assert(kHeadDim == 16 || kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                  "head dim must be 16, 32, 64, 128 or 256");
    static constexpr int kSplit = kHeadDim > 128 ? kHeadDim / 128 : 1;   // warps per team (head-dim split)
    static constexpr int kDW = kHeadDim / kSplit;                        // head-dim slice per warp
    static constexpr int kThreads = kSplit * 32;   // one team per block
    static constexpr int kNT = kDW / 8;
    // Resident warps per SM the register budget allows (occupancy hint).
    static constexpr int kWarpsPerSM = kDW == 16 ? 24 : (kDW == 32 ? 16 : (kDW == 64 ? 12 : 8));
    static constexpr int kMinBlocks = kWarpsPerSM / kSplit;
};

// kEdges: 0 none, 1 edge terms (bias, non-zero offsets), 2 edge terms and
// attention dropout; 3 and 4: 1 and 2 that also write each edge's score
// (the attention weights follow from it and lse, with no pass of their own).
// The edge terms carry a few registers per pair (6 since the warp loads
// them lane by lane, edge_bias.cuh): at D = 16 they ask for 3/4 of the
// resident blocks (1/2 with dropout), the most without spills (ptxas,
// sm_90a); wider head dims keep the plain kernel's occupancy. The scores
// are instances of their own: storing them from the instances without cost
// 8% on the bias forward (200k power-law graph, H = 4, H100).
__host__ __device__ constexpr bool edge_dropout(int kEdges) { return kEdges == 2 || kEdges == 4; }
__host__ __device__ constexpr bool edge_scores(int kEdges) { return kEdges >= 3; }

template <int kEdges, int kMinBlocks, int kDW>
constexpr int edge_min_blocks() {
    return (kEdges == 0 || kDW >= 32) ? kMinBlocks
                                      : (!edge_dropout(kEdges) ? (kMinBlocks * 3 + 3) / 4 : (kMinBlocks + 1) / 2);
}

// Resident warps an SM of the head-group instances with edge terms: 8 for
// groups of 4 (255 registers a thread: 12 gave 168, with 92-160 bytes of
// spills, and forward + weights 1.18 ms against 1.01 on the 200k graph, H = 4,
// D = 16, when each head's K and V were gathered into registers; with the
// staged rows 12 compile without spills (4 bytes in the dropout-and-scores
// instance), but their shared memory needs the largest carveout,
// prefer_max_shared, which left them 5-9% faster with a bias on the 200k
// graph at H = 4 and 8, D = 16, and 17% slower on github at H = 8: not
// switched), 12 for groups of 2 (8 cost them a third of their
// warps: 2.14 -> 2.86 ms with a bias at H = 8, D = 32). A warp sits in one of
// an SM's four register partitions, so 9-12 warps all give 168 registers.
template <int kG>
constexpr int group_edge_warps() { return kG >= 4 ? 8 : 12; }

template <int kEdges, int kG, int kHeadDim>
constexpr int fwd_min_blocks() {
    return kG > 1 ? (kEdges == 0 ? FwdConfig<kHeadDim * kG>::kMinBlocks : group_edge_warps<kG>())
                  : edge_min_blocks<kEdges, FwdConfig<kHeadDim>::kMinBlocks, FwdConfig<kHeadDim>::kDW>();
}

template <typename T, int kHeadDim, int kEdges, int kG>
__global__ void __launch_bounds__(FwdConfig<kHeadDim>::kThreads, fwd_min_blocks<kEdges, kG, kHeadDim>())
fused3s_fwd_kernel(const Fused3SParams p) {
    constexpr bool kBias = kEdges > 0;
    using Cfg = FwdConfig<kHeadDim>;
    static_assert(kG == 1 || (Cfg::kSplit == 1 && kG <= max_head_group(kHeadDim)), "head groups: head dims 16 and 32");
    constexpr int kDW = Cfg::kDW;
    constexpr int kNT = Cfg::kNT;
    constexpr int kSplit = Cfg::kSplit;

    const int lane = threadIdx.x & 31;
    const int part = threadIdx.x >> 5;   // which head-dim slice this warp owns (0 unless D = 256)
    const int g = lane >> 2, t = lane & 3;
    const bool leader = lane == 0 && part == 0;

    // Exchange buffer of partial S between the warps of a D = 256 team:
    // [double buffer][part][8 values][32 lanes] fp32.
    __shared__ float s_xchg[2][kSplit][8][32];
    __shared__ int s_bcast;
    // Each warp's places of its pairs' edge terms (edge_bias.cuh: PairSlots).
    using Bias = PairBias<kBias, false, edge_dropout(kEdges), kG>;
    __shared__ typename Bias::Slots s_slots[kBias ? kSplit : 1];
    // Head groups: two stages of the pair's K and V rows, kG heads wide.
    constexpr bool kStaged = kG > 1;
    using KVTile = RowTile<kStaged ? kDW * kG : 16>;
    __shared__ alignas(16) uint16_t s_kv[kStaged ? 2 * KVTile::kBytes : 8];   // [stage][K, V] tiles
    auto kv_tile = [&](int stage, int which) { return s_kv + (2 * stage + which) * (KVTile::kBytes / 2); };

    const uint4* bitmap = reinterpret_cast<const uint4*>(p.bitmap_ptr);
    int buf = 0;   // S exchange double buffer index (D = 256)

    {
        const int w = blockIdx.x;   // work index = item * (H / kG) + group, heaviest items first
        const int groups = p.num_heads / kG;
        const int item_idx = w / groups;
        const int head0 = (w - item_idx * groups) * kG;   // the group's first head
        const int4 it = __ldg(reinterpret_cast<const int4*>(p.items_ptr) + item_idx);
        const int window = it.x, tcb_begin = it.y, tcb_end = it.z, slot = it.w;
        if (window < 0) return;   // an unused item of a schedule at capacity (the whole block)

        const int row0 = window * 16 + g;   // rows g and g+8 of the window
        const int row1 = row0 + 8;
        const bool in0 = row0 < p.num_nodes, in1 = row1 < p.num_nodes;

        const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q_ptr) + head0 * p.q_head_stride + part * kDW;
        const uint16_t* k = reinterpret_cast<const uint16_t*>(p.k_ptr) + head0 * p.k_head_stride + part * kDW;
        const uint16_t* v = reinterpret_cast<const uint16_t*>(p.v_ptr) + head0 * p.v_head_stride + part * kDW;

        // [16, kDW] slice of Q in A-fragment registers per head, never read past row N-1.
        QFragment<kDW> qf[kG];
#pragma unroll
        for (int h = 0; h < kG; ++h) {
            const uint16_t* qh = q + h * p.q_head_stride;
            load_q_fragment<kDW>(qf[h], qh + static_cast<int64_t>(in0 ? row0 : 0) * p.q_row_stride, in0,
                                 qh + static_cast<int64_t>(in1 ? row1 : 0) * p.q_row_stride, in1, t);
        }

        float o[kG][kNT][4];
        SoftmaxState st[kG];
#pragma unroll
        for (int h = 0; h < kG; ++h) {
#pragma unroll
            for (int j = 0; j < kNT; ++j) o[h][j][0] = o[h][j][1] = o[h][j][2] = o[h][j][3] = 0.f;
            softmax_init(st[h]);
        }

        if (tcb_begin < tcb_end) {
            PairRaw raw;
            auto load_raw = [&](int tcb) { load_pair_raw(raw, p.cols_ptr, bitmap, tcb, tcb_end, lane); };
            EdgeCursor ec;   // the edge terms' walk over the item's non-zeros
            if constexpr (kBias) ec.start(p.bias, tcb_begin, tcb_end, lane);
            load_raw(tcb_begin);
            PairMeta cur = decode_pair(raw, lane);
            auto copy_kv = [&](int stage) {   // (staged) the pair of `raw`: its 16 K and V rows
                KVTile::load_async(smem_addr(kv_tile(stage, 0)), k, p.k_row_stride, smem_addr(kv_tile(stage, 1)), v,
                                   p.v_row_stride, raw.c, lane);
            };
            int stage = 0;
            if constexpr (kStaged) {
                copy_kv(0);
                cp_async_commit();
            }
            Bias bcur, bnxt;
            typename Bias::Slots& slots = s_slots[kBias ? part : 0];
            bcur.load(raw, ec, p.bias, lane, head0);
            if (tcb_begin + 2 < tcb_end) load_raw(tcb_begin + 2);

            KFragment<kDW> kf[kG][2];
            VFragment<kDW> vf[kG];
            auto load_k = [&](const PairMeta& m) {
#pragma unroll
                for (int h = 0; h < kG; ++h) {
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int c = m.colk[x];
                        load_k_fragment<kDW>(kf[h][x],
                                             k + h * p.k_head_stride + static_cast<int64_t>(c < 0 ? 0 : c) * p.k_row_stride,
                                             c >= 0, t);
                    }
                }
            };
            auto load_v = [&](const PairMeta& m) {
#pragma unroll
                for (int h = 0; h < kG; ++h) {
                    const uint16_t* rows[4];
                    bool valid[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int c = m.colv[i];
                        valid[i] = c >= 0;
                        rows[i] = v + h * p.v_head_stride + static_cast<int64_t>(c < 0 ? 0 : c) * p.v_row_stride;
                    }
                    load_v_fragment<kDW>(vf[h], rows, valid, g);
                }
            };
            // (staged) head h's fragments from this pair's rows in shared memory
            auto read_k = [&]() {
#pragma unroll
                for (int h = 0; h < kG; ++h) {
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        load_k_fragment_shared<kDW>(kf[h][x], kv_tile(stage, 0) + (8 * x + g) * KVTile::kRowElems + h * kDW, t);
                    }
                }
            };
            auto read_v = [&](int h, VFragment<kDW>& f) {
                const uint16_t* rows[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    rows[i] = kv_tile(stage, 1) + (8 * (i >> 1) + 2 * t + (i & 1)) * KVTile::kRowElems + h * kDW;
                }
                load_v_fragment_shared<kDW>(f, rows, g);
            };
            if constexpr (!kStaged) {
                load_k(cur);
                load_v(cur);
            }

            for (int base = tcb_begin;; base += 2) {
                const bool has_next = base + 2 < tcb_end;
                if constexpr (kStaged) {
                    if (has_next) copy_kv(stage ^ 1);   // the next pair's rows fly during this one
                    cp_async_commit();
                    cp_async_wait<1>();                  // this pair's rows have landed
                    __syncwarp();
                    read_k();
                }
                // this pair's bias (and dropout mask) per score (edge_bias.cuh),
                // ahead of the product, whose latency hides the places' round trip
                bcur.expand(p.bias, head0, slots, lane);
                float s[kG][2][4];
#pragma unroll
                for (int h = 0; h < kG; ++h) sddmm_pair<T, kDW>(s[h], qf[h], kf[h]);
                if constexpr (kSplit > 1) {
                    // Sum the partial scores of the team's warps (same order in every
                    // warp, so all of them hold bit-identical S and softmax state).
#pragma unroll
                    for (int i = 0; i < 8; ++i) s_xchg[buf][part][i][lane] = s[0][i >> 2][i & 3];
                    __syncthreads();
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        float acc = 0.f;
#pragma unroll
                        for (int q2 = 0; q2 < kSplit; ++q2) acc += s_xchg[buf][q2][i][lane];
                        s[0][i >> 2][i & 3] = acc;
                    }
                    buf ^= 1;
                }
                PairMeta nxt;
                if (has_next) {
                    nxt = decode_pair(raw, lane);
                    if constexpr (!kStaged) load_k(nxt);   // K of the next pair flies during softmax + SpMM
                    bnxt.load(raw, ec, p.bias, lane, head0);   // its bias too
                    if (base + 4 < tcb_end) load_raw(base + 4);
                }
#pragma unroll
                for (int h = 0; h < kG; ++h) {
                    bcur.select(p.bias, slots, h, lane);   // head h's bias and dropout mask
                    if constexpr (edge_scores(kEdges)) {
                        // the raw dot products q_i.k_j (the caller adds scale and bias)
                        if (part == 0) bcur.stage(slots, h, s[h], lane);
                    }
                    uint32_t pa[4];
                    online_softmax_pair<T, kNT>(s[h], cur.mask, p.scale_log2, bcur, p.bias, st[h], o[h], pa);
                    if constexpr (kStaged) read_v(h, vf[h]);
                    spmm_pair<T, kDW>(o[h], pa, vf[h]);
                }
                if constexpr (edge_scores(kEdges)) {
                    if (part == 0) bcur.flush(p.scores_ptr, p.num_heads, head0, slots, lane, p.bias);
                }
                if (!has_next) break;
                if constexpr (kStaged) {
                    __syncwarp();   // every lane is done with this stage before it is refilled
                    stage ^= 1;
                } else {
                    load_v(nxt);       // V of the next pair flies during the next SDDMM
                }
                cur = nxt;
                bcur = bnxt;
            }
        }
#pragma unroll
        for (int h = 0; h < kG; ++h) softmax_finish(st[h]);   // st.l: full row sums

        const int col0 = part * kDW + t * (kDW / 4);   // first head-dim index this thread holds
        bool write_out = slot < 0;
        if (!write_out) {
            // Partial of a split window: unnormalised O, m, l in fp32, per head.
#pragma unroll
            for (int h = 0; h < kG; ++h) {
                const int64_t base_row = (static_cast<int64_t>(slot) * p.num_heads + head0 + h) * 16;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int rw = g + 8 * r;
                    store_row<T, kNT>(p.part_o_ptr + (base_row + rw) * kHeadDim + col0, true, o[h], 2 * r, 2 * r + 1, 1.f);
                    if (t == 0 && part == 0) {
                        *reinterpret_cast<float2*>(p.part_ml_ptr + (base_row + rw) * 2) =
                            make_float2(st[h].m[r], st[h].l[r]);
                    }
                }
            }
            __threadfence();   // partial visible GPU-wide before the arrival is counted
            team_sync<kSplit>();
            const int4 si = __ldg(reinterpret_cast<const int4*>(p.slots_ptr) + slot);
            const int s0 = si.y, s1 = si.z;
            // one counter per group (its first head's)
            const int prev = leader ? atomicAdd(p.counters_ptr + static_cast<int64_t>(s0) * p.num_heads + head0, 1) : 0;
            write_out = team_broadcast<kSplit>(prev, leader, s_bcast) == s1 - s0 - 1;   // this team completed the window
            if (write_out) {
                __threadfence();
#pragma unroll
                for (int h = 0; h < kG; ++h) {
                    const int head = head0 + h;
                    // Merge: out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
                    float m_ref[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int rw = g + 8 * r;
                        auto ml_at = [&](int sl) {
                            return __ldcg(reinterpret_cast<const float2*>(p.part_ml_ptr) +
                                          ((static_cast<int64_t>(sl) * p.num_heads + head) * 16 + rw));
                        };
                        float mx = -INFINITY;
                        for (int sl = s0 + t; sl < s1; sl += 4) mx = fmaxf(mx, ml_at(sl).x);
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                        m_ref[r] = mx == -INFINITY ? 0.f : mx;
                        float l = 0.f;
                        for (int sl = s0 + t; sl < s1; sl += 4) {
                            const float2 ml = ml_at(sl);
                            l += fast_exp2(ml.x - m_ref[r]) * ml.y;
                        }
                        l += __shfl_xor_sync(0xffffffffu, l, 1);
                        l += __shfl_xor_sync(0xffffffffu, l, 2);
                        st[h].m[r] = mx;
                        st[h].l[r] = l;
                    }
#pragma unroll
                    for (int j = 0; j < kNT; ++j) o[h][j][0] = o[h][j][1] = o[h][j][2] = o[h][j][3] = 0.f;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int rw = g + 8 * r;
                        // 4 slots per step: their loads are independent and in flight together.
#pragma unroll 4
                        for (int sl = s0; sl < s1; ++sl) {
                            const int64_t prow = (static_cast<int64_t>(sl) * p.num_heads + head) * 16 + rw;
                            const float wgt =
                                fast_exp2(__ldcg(reinterpret_cast<const float2*>(p.part_ml_ptr) + prow).x - m_ref[r]);
                            const float4* src = reinterpret_cast<const float4*>(p.part_o_ptr + prow * kHeadDim + col0);
#pragma unroll
                            for (int e4 = 0; e4 < kNT / 2; ++e4) {   // 2 * kNT floats = kNT / 2 float4
                                const float4 x = __ldcg(src + e4);
                                const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                                for (int i = 0; i < 4; ++i) {
                                    const int e = 4 * e4 + i;
                                    if (e < kNT) o[h][e][2 * r] += wgt * xs[i];
                                    else o[h][e - kNT][2 * r + 1] += wgt * xs[i];
                                }
                            }
                        }
                    }
                }
            }
        }
        if (write_out) {
            // Normalise and write out, lse.
#pragma unroll
            for (int h = 0; h < kG; ++h) {
                const int head = head0 + h;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = r == 0 ? row0 : row1;
                    if (row >= p.num_nodes) continue;
                    // l == 0: no edge (or all scores -inf): 0. A NaN l (a NaN or
                    // Inf among the scores) makes the row and its lse NaN, as in
                    // message passing, instead of 0.
                    const float l = st[h].l[r];
                    const float inv = l != 0.f ? 1.f / l : 0.f;
                    const int64_t off = static_cast<int64_t>(row) * p.o_row_stride + head * p.o_head_stride + col0;
                    void* dst = p.out_fp32 ? static_cast<void*>(reinterpret_cast<float*>(p.o_ptr) + off)
                                           : static_cast<void*>(reinterpret_cast<uint16_t*>(p.o_ptr) + off);
                    store_row<T, kNT>(dst, p.out_fp32, o[h], 2 * r, 2 * r + 1, inv);
                    if (t == 0 && part == 0) {
                        p.lse_ptr[static_cast<int64_t>(row) * p.lse_row_stride + head * p.lse_head_stride] =
                            l != 0.f ? (st[h].m[r] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
                    }
                }
            }
        }
    }
}

template <typename T, int kHeadDim, int kEdges>
void run_fused3s_fwd(const Fused3SParams& params, cudaStream_t stream) {
    using Cfg = FwdConfig<kHeadDim>;
    const int group = params.head_group > 1 ? params.head_group : 1;   // validated by the host (head_group())
    const int64_t work = static_cast<int64_t>(params.num_items) * (params.num_heads / group);
    if (work <= 0) return;
    if (params.num_slots > 0) {   // arrival counters of the split windows
        const size_t bytes = sizeof(int32_t) * static_cast<size_t>(params.num_slots) * params.num_heads;
        if (cudaMemsetAsync(params.counters_ptr, 0, bytes, stream) != cudaSuccess) return;   // error stays set
    }
    const dim3 grid(static_cast<unsigned>(work));
    if constexpr (max_head_group(kHeadDim) > 1) {
        if (group == 2) {
            fused3s_fwd_kernel<T, kHeadDim, kEdges, 2><<<grid, Cfg::kThreads, 0, stream>>>(params);
            return;
        }
        if constexpr (max_head_group(kHeadDim) >= 4) {
            if (group == 4) {
                fused3s_fwd_kernel<T, kHeadDim, kEdges, 4><<<grid, Cfg::kThreads, 0, stream>>>(params);
                return;
            }
        }
    }
    fused3s_fwd_kernel<T, kHeadDim, kEdges, 1><<<grid, Cfg::kThreads, 0, stream>>>(params);
}

}  // namespace gt_fused3s
