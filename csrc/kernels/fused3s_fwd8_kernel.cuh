// Fused 3S forward over 8-row windows (rows8_params.h, tiles: rows8_tile.cuh).
// One warp runs one (window, head), windows heaviest first (fmt.windows);
// per block of 16 columns: S^T = K Q^T on the mma, the online softmax of
// each row over the 8 lanes that hold it (shuffles across g), O^T += V^T P^T
// with P^T transposed in registers. K of the next block is loaded during this
// block's softmax and SpMM, V of the next block during its scores (the 16-row
// kernel's order). A window's blocks run in one warp: there is no split of
// heavy windows (the plan warns where a window is long, plan.py).
// Measured against the 16-row kernel: README, "8-row windows".
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "rows8_tile.cuh"

namespace gt_fused3s {

// Resident warps per SM the registers allow (occupancy hint), by head dim:
// the backward's; the forward's asks for more at D = 64 and 128, still
// without spills (ptxas, sm_90a). Measured on an H100 (profiler, L2
// flushed, two runs, git d37ec44 against this): forward at D = 128 12
// blocks an SM instead of 8: zinc x1024 14.9 -> 13.5 us, molhiv 14.0 ->
// 12.5, peptides 72.5 -> 63.4, cora / citeseer / pubmed within 2%; at
// D = 64 / H = 8 16 instead of 12: within 1%. The backward's passes at
// D = 64 with 16 / 14: cora and pubmed 3-16% slower, so they keep these.
template <int kDW>
constexpr int rows8_min_blocks() { return kDW <= 32 ? 16 : (kDW == 64 ? 12 : 8); }
template <int kDW>
constexpr int rows8_fwd_min_blocks() { return kDW <= 32 ? 16 : (kDW == 64 ? 16 : 12); }

template <typename T, int kDW>
__global__ void __launch_bounds__(32, rows8_fwd_min_blocks<kDW>())
fused3s_fwd8_kernel(const Fwd8Params p) {
    constexpr int kSteps = kDW / 16, kMT = kDW / 16;
    const Rows8Item w(p.fmt, p.num_heads, kDW);
    const int lane = w.lane, g = w.g, t = w.t, head = w.head, window = w.window;
    const int tcb_begin = w.begin, tcb_end = w.end;
    const HeadRows k(p.k, head), v(p.v, head);

    KFragment<kDW> qb;   // B = Q^T: column n = g is this lane's row
    load_k_fragment<kDW>(qb, HeadRows(p.q, head).row(w.clamped_row(p.num_nodes)), w.row() < p.num_nodes, t);

    float o[kMT][4];
#pragma unroll
    for (int j = 0; j < kMT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    // rows 2t, 2t + 1: the running max (log2 units) and this lane's share of the row sum
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    if (tcb_begin < tcb_end) {
        Block8 cur;
        load_block8(cur, p.fmt, tcb_begin, lane);
        QFragment<kDW> ka;
        VFragment<kDW> vf;
        load_columns_a<kDW>(ka, k, cur.c, g, t);
        load_columns_t<kDW>(vf, v, cur.c, g, t);
        for (int tcb = tcb_begin;; ++tcb) {
            const bool has_next = tcb + 1 < tcb_end;
            Block8 nxt;
            if (has_next) load_block8(nxt, p.fmt, tcb + 1, lane);
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int st = 0; st < kSteps; ++st) mma_16816<T>(s, ka.a[st], qb.b[st][0], qb.b[st][1]);
            if (has_next) load_columns_a<kDW>(ka, k, nxt.c, g, t);   // flies during softmax + SpMM
            const uint32_t mask = block8_mask(cur, lane);
#pragma unroll
            for (int i = 0; i < 4; ++i) s[i] = ((mask >> i) & 1u) ? s[i] * p.scale_log2 : -INFINITY;
            float alpha[2], base[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // row 2t + i: its 16 values over the 8 lanes of this t
                float mx = fmaxf(s[i], s[2 + i]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mn = fmaxf(m[i], mx);
                base[i] = mn == -INFINITY ? 0.f : mn;   // a row with no edge yet: exponentials of -inf, 0
                alpha[i] = fast_exp2(m[i] - base[i]);
                m[i] = mn;
            }
            float pr[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(s[i] - base[i & 1]);
#pragma unroll
            for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + pr[i] + pr[2 + i];
#pragma unroll
            for (int j = 0; j < kMT; ++j) {
                o[j][0] *= alpha[0]; o[j][2] *= alpha[0];
                o[j][1] *= alpha[1]; o[j][3] *= alpha[1];
            }
            uint32_t b0, b1;
            columns_as_b<T>(b0, b1, pr);
            accumulate_t<T, kDW>(o, vf, b0, b1);
            if (!has_next) break;
            load_columns_t<kDW>(vf, v, nxt.c, g, t);   // flies during the next scores
            cur = nxt;
        }
    }
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 4);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 8);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 16);
        // l == 0: no edge, out 0 and lse -inf; a NaN l (a NaN or Inf score)
        // makes the row and its lse NaN, as in the 16-row kernel
        inv[i] = l[i] != 0.f ? 1.f / l[i] : 0.f;
    }
    store_rows8<T, kDW>(p.out, p.out_fp32, w.out_stride, head, window * 8, p.num_nodes, g, t, o, inv);
    if (g == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = window * 8 + 2 * t + i;
            if (row < p.num_nodes)
                p.lse[static_cast<int64_t>(row) * p.num_heads + head] =
                    l[i] != 0.f ? (m[i] + __log2f(l[i])) * 0.69314718055994531f : -INFINITY;
        }
    }
}

template <typename T, int kHeadDim>
cudaError_t run_fused3s_fwd8(const Fwd8Params& params, cudaStream_t stream) {
    const int64_t work = static_cast<int64_t>(params.fmt.num_windows) * params.num_heads;
    if (work <= 0) return cudaSuccess;
    fused3s_fwd8_kernel<T, kHeadDim><<<static_cast<unsigned>(work), 32, 0, stream>>>(params);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
