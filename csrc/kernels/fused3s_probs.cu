// Attention probabilities per edge from the forward's log-sum-exp: one score
// pass, P_e = exp2(S_ij scale log2e + bias_e log2e - lse_i log2e) for every
// edge e = j -> i, written [E, H] in the caller's edge order (through the
// BSB's slot_edge, edge_bias.cuh): return_attention_weights, and
// terms built on the probabilities such as TransformerConv's edge features.
//
// Work: the forward's schedule (chunks of a row window, heaviest first), one
// warp per (chunk, head); chunks are independent here (nothing accumulates
// across TCBs), so split windows need no merge. The warp computes S for a
// TCB pair on tensor cores (sddmm_tile.cuh) over head-dim slices of at most
// 128, and writes the pair's probabilities lane by lane (edge_bias.cuh:
// store_all).
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "edge_bias.cuh"
#include "fused3s_params.h"
#include "mma_utils.cuh"
#include "sddmm_tile.cuh"
#include "tcb_pair.cuh"

namespace gt_fused3s {

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(32) fused3s_probs_kernel(const Fused3SParams p) {
    constexpr int kDW = kHeadDim > 128 ? 128 : kHeadDim;   // slice per S step
    constexpr int kSlices = kHeadDim / kDW;
    constexpr float kLog2e = 1.4426950408889634f;
    const int lane = threadIdx.x;
    __shared__ float xfer[kPairLaneNnz];   // the probabilities on their way to the edges' lanes
    const int g = lane >> 2, t = lane & 3;

    const int w = blockIdx.x;
    const int item_idx = w / p.num_heads;
    const int head = w - item_idx * p.num_heads;
    const int4 it = __ldg(reinterpret_cast<const int4*>(p.items_ptr) + item_idx);
    const int window = it.x, tcb_begin = it.y, tcb_end = it.z;
    if (window < 0 || tcb_begin >= tcb_end) return;

    const int row0 = window * 16 + g, row1 = row0 + 8;
    const bool in0 = row0 < p.num_nodes, in1 = row1 < p.num_nodes;
    const float lse2[2] = {in0 ? __ldg(p.lse_ptr + row0 * p.lse_row_stride + head * p.lse_head_stride) * kLog2e : 0.f,
                           in1 ? __ldg(p.lse_ptr + row1 * p.lse_row_stride + head * p.lse_head_stride) * kLog2e : 0.f};
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q_ptr) + head * p.q_head_stride;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(p.k_ptr) + head * p.k_head_stride;
    const uint4* bitmap = reinterpret_cast<const uint4*>(p.bitmap_ptr);

    // Q of the window: held for the whole chunk when one slice covers D.
    QFragment<kDW> qf;
    auto load_q = [&](int u) {
        load_q_fragment<kDW>(qf, q + static_cast<int64_t>(in0 ? row0 : 0) * p.q_row_stride + u * kDW, in0,
                             q + static_cast<int64_t>(in1 ? row1 : 0) * p.q_row_stride + u * kDW, in1, t);
    };
    if constexpr (kSlices == 1) load_q(0);

    PairRaw raw;
    auto load_raw = [&](int tcb) { load_pair_raw(raw, p.cols_ptr, bitmap, tcb, tcb_end, lane); };
    EdgeCursor ec;
    ec.start(p.bias, tcb_begin, tcb_end, lane);
    KFragment<kDW> kf[2];
    auto load_k = [&](const PairMeta& m, int u) {
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const int c = m.colk[x];
            load_k_fragment<kDW>(kf[x], k + static_cast<int64_t>(c < 0 ? 0 : c) * p.k_row_stride + u * kDW, c >= 0, t);
        }
    };
    // As in the forward: the next pair's K rows (one slice covering D) and
    // edge values are loaded while this pair computes, its columns and bitmap
    // two pairs ahead.
    load_raw(tcb_begin);
    PairMeta cur = decode_pair(raw, lane);
    PairBias<true> bcur, bnxt;
    bcur.load(raw, ec, p.bias, lane, head);
    if (tcb_begin + 2 < tcb_end) load_raw(tcb_begin + 2);
    if constexpr (kSlices == 1) load_k(cur, 0);
    for (int base = tcb_begin;; base += 2) {
        float s[2][4] = {};
#pragma unroll
        for (int u = 0; u < kSlices; ++u) {
            if constexpr (kSlices > 1) {
                load_q(u);
                load_k(cur, u);
            }
            float part[2][4];
            sddmm_pair<T, kDW>(part, qf, kf);
#pragma unroll
            for (int x = 0; x < 2; ++x) {
#pragma unroll
                for (int i = 0; i < 4; ++i) s[x][i] += part[x][i];
            }
        }
        const bool has_next = base + 2 < tcb_end;
        PairMeta nxt;
        if (has_next) {
            nxt = decode_pair(raw, lane);
            if constexpr (kSlices == 1) load_k(nxt, 0);
            bnxt.load(raw, ec, p.bias, lane, head);
            if (base + 4 < tcb_end) load_raw(base + 4);
        }
        bcur.expand(p.bias, head);
        float pr[2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
#pragma unroll
            for (int i = 0; i < 4; ++i) pr[x][i] = fast_exp2(bcur.add(s[x][i] * p.scale_log2, x, i) - lse2[i >> 1]);
        }
        bcur.store_all(p.probs_ptr, p.bias.num_heads, head, pr, xfer, lane);
        if (!has_next) break;
        cur = nxt;
        bcur = bnxt;
    }
}

template <typename T, int kHeadDim>
void run_fused3s_probs(const Fused3SParams& params, cudaStream_t stream) {
    const int64_t work = static_cast<int64_t>(params.num_items) * params.num_heads;
    if (work <= 0) return;
    fused3s_probs_kernel<T, kHeadDim><<<static_cast<unsigned>(work), 32, 0, stream>>>(params);
}

#define GT_FUSED3S_PROBS(T) \
    template void run_fused3s_probs<T, 16>(const Fused3SParams&, cudaStream_t); \
    template void run_fused3s_probs<T, 32>(const Fused3SParams&, cudaStream_t); \
    template void run_fused3s_probs<T, 64>(const Fused3SParams&, cudaStream_t); \
    template void run_fused3s_probs<T, 128>(const Fused3SParams&, cudaStream_t); \
    template void run_fused3s_probs<T, 256>(const Fused3SParams&, cudaStream_t);
GT_FUSED3S_PROBS(__half)
GT_FUSED3S_PROBS(__nv_bfloat16)
#undef GT_FUSED3S_PROBS

}  // namespace gt_fused3s
