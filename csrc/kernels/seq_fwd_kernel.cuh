// Sparse attention over sequences, forward: the graph kernel's tiles (SDDMM,
// online softmax, SpMM on mma.m16n8k16) over the implicit key sets of
// seq_mask.cuh instead of a stored BSB.
//
// Work decomposition. One warp runs one (row window of 16 queries, head); a
// block holds kWarps warps on consecutive windows of one head, whose key
// ranges overlap almost entirely (a band) and which walk them in the same
// ascending order, so most of a block's K and V row loads hit L1 (read-only
// path) after the first warp's. Windows never split: each key set is at most
// a few thousand keys (global rows, the one exception, are computed apart).
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "seq_params.h"
#include "seq_mask.cuh"
#include "edge_bias.cuh"
#include "mma_utils.cuh"
#include "sddmm_tile.cuh"
#include "online_softmax.cuh"
#include "spmm_tile.cuh"

namespace gt_fused3s {

template <int kHeadDim>
struct SeqFwdConfig {
    static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128, "sequence head dim must be 32, 64 or 128");
    static constexpr int kWarps = 4;   // windows per block
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kNT = kHeadDim / 8;
    // Resident blocks per SM the register budget allows (as the graph kernel).
    static constexpr int kMinBlocks = (kHeadDim == 32 ? 16 : (kHeadDim == 64 ? 12 : 8)) / kWarps;
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(SeqFwdConfig<kHeadDim>::kThreads, SeqFwdConfig<kHeadDim>::kMinBlocks)
seq_fwd_kernel(const SeqFwdParams p) {
    using Cfg = SeqFwdConfig<kHeadDim>;
    constexpr int kNT = Cfg::kNT;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int64_t w = static_cast<int64_t>(blockIdx.x) * Cfg::kWarps + (threadIdx.x >> 5);
    const int head = blockIdx.y;

    SeqWindow win;
    if (w >= p.num_windows || !seq_window(p, w, win) || win.rows == 0) return;   // warp-uniform
    const SeqMask& mk = p.mask;

    const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q_ptr) + head * p.q_head_stride;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(p.k_ptr) + head * p.k_head_stride;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(p.v_ptr) + head * p.v_head_stride;
    const bool in0 = g < win.rows, in1 = g + 8 < win.rows;
    const int64_t tok0 = win.doc_start + win.base + static_cast<int64_t>(win.stride) * g;
    const int64_t tok1 = tok0 + static_cast<int64_t>(win.stride) * 8;

    QFragment<kHeadDim> qf;
    load_q_fragment<kHeadDim>(qf, q + (in0 ? tok0 : 0) * p.q_row_stride, in0, q + (in1 ? tok1 : 0) * p.q_row_stride,
                              in1, t);
    float o[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    SoftmaxState st;
    softmax_init(st);

    SeqTileCursor cur;
    if (cur.first(mk, win)) {
        KFragment<kHeadDim> kf[2];
        VFragment<kHeadDim> vf;
        auto load_k = [&](const PairMeta& m) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int c = m.colk[x];
                load_k_fragment<kHeadDim>(kf[x], k + static_cast<int64_t>(c < 0 ? 0 : c) * p.k_row_stride, c >= 0, t);
            }
        };
        auto load_v = [&](const PairMeta& m) {
            const uint16_t* rows[4];
            bool valid[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = m.colv[i];
                valid[i] = c >= 0;
                rows[i] = v + static_cast<int64_t>(c < 0 ? 0 : c) * p.v_row_stride;
            }
            load_v_fragment<kHeadDim>(vf, rows, valid, g);
        };
        const PairBias<false, false> no_bias;
        const EdgeBiasArgs no_edges{};
        PairMeta m = seq_pair_meta(mk, win, cur, lane);
        load_k(m);
        load_v(m);
        for (;;) {
            float s[2][4];
            sddmm_pair<T, kHeadDim>(s, qf, kf);
            const bool has_next = cur.next(mk, win);
            PairMeta nxt;
            if (has_next) {
                nxt = seq_pair_meta(mk, win, cur, lane);
                load_k(nxt);   // K of the next pair flies during softmax + SpMM
            }
            uint32_t pa[4];
            online_softmax_pair<T, kNT>(s, m.mask, p.scale_log2, no_bias, no_edges, st, o, pa);
            spmm_pair<T, kHeadDim>(o, pa, vf);
            if (!has_next) break;
            load_v(nxt);   // V of the next pair flies during the next SDDMM
            m = nxt;
        }
    }
    softmax_finish(st);

    const int col0 = t * (kHeadDim / 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!(r == 0 ? in0 : in1)) continue;
        const int64_t tok = r == 0 ? tok0 : tok1;
        const float l = st.l[r];
        const float inv = l != 0.f ? 1.f / l : 0.f;   // NaN l (NaN scores) stays NaN, as in the graph kernel
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.o_ptr) + tok * p.o_row_stride + head * p.o_head_stride + col0;
        store_row<T, kNT>(dst, false, o, 2 * r, 2 * r + 1, inv);
        if (t == 0) {
            p.lse_ptr[tok * p.lse_row_stride + head * p.lse_head_stride] =
                l != 0.f ? (st.m[r] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
        }
    }
}

template <typename T, int kHeadDim>
void run_seq_fwd(const SeqFwdParams& params, cudaStream_t stream) {
    using Cfg = SeqFwdConfig<kHeadDim>;
    const int64_t blocks = (params.num_windows + Cfg::kWarps - 1) / Cfg::kWarps;
    if (blocks <= 0 || params.num_heads <= 0) return;
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(params.num_heads));
    seq_fwd_kernel<T, kHeadDim><<<grid, Cfg::kThreads, 0, stream>>>(params);
}

}  // namespace gt_fused3s
