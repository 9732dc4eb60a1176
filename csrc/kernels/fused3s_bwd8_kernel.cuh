// Fused 3S backward over 8-row windows (rows8_params.h, tiles: rows8_tile.cuh):
// scores recomputed per block from q, k and the forward's lse, as the 16-row
// backward (fused3s_bwd_kernel.cuh) does, in two passes of one warp per
// (window, head), windows heaviest first:
//   dQ pass (the graph's format; rows i):
//     S^T = K Q^T, dP^T = V dO^T            [16 columns j, 8 rows i]
//     P = exp2(S scale log2 e - lse_i log2 e), dS = P (dP - delta_i)
//     dQ^T [D, 8] += K^T dS^T                (K^T from the 4 gathered rows)
//     delta_i = rowsum(dO_i * O_i) first, (lse_i log2 e, delta_i) written
//   dKV pass (the transposed graph's format; rows = keys j, columns = queries i):
//     S = Q K^T, dP = dO V^T                 [16 queries i, 8 keys j]
//     with each query's (lse log2 e, delta) from the dQ pass
//     dV^T [D, 8] += dO^T P,  dK^T [D, 8] += Q^T dS
// A gathered row serves two fragment shapes (A of the scores, X^T of the
// sums): it is loaded twice from global memory (the second load hits L1 or
// L2), where the 16-row backward stages rows in shared memory.
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "fused3s_fwd8_kernel.cuh"

namespace gt_fused3s {

// rowsum(dO * O) over this lane's head dims of one row (the permuted dims of
// its KFragment of dO), O in T or fp32; the 4 lanes of the row then add.
template <typename T, int kDW>
__device__ __forceinline__ float partial_delta(const KFragment<kDW>& dob, const void* o_row, bool o_fp32, bool valid,
                                               int t) {
    using L = SddmmLayout<kDW>;
    if (!valid) return 0.f;
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < L::kChunks; ++u) {
        const int off = L::offset(u, t);    // this lane's kChunk / 4 consecutive dims
#pragma unroll
        for (int s = 0; s < L::kStepsPerChunk; ++s) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const float2 d = TypeTraits<T>::unpack(dob.b[u * L::kStepsPerChunk + s][x]);
                const int e = off + 2 * (2 * s + x);    // word 2s + x of the chunk's load
                float2 ov;
                if (o_fp32) {
                    ov = *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(o_row) + e);
                } else {
                    ov = TypeTraits<T>::unpack(*reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint16_t*>(o_row) + e));
                }
                acc += d.x * ov.x + d.y * ov.y;
            }
        }
    }
    return acc;
}

template <typename T, int kDW>
__global__ void __launch_bounds__(32, rows8_min_blocks<kDW>())
fused3s_bwd8_dq_kernel(const Bwd8Params p) {
    constexpr int kMT = kDW / 16;
    const Rows8Item w(p.fmt, p.num_heads, kDW);
    const int lane = w.lane, g = w.g, t = w.t, head = w.head, window = w.window, row = w.row();
    const HeadRows k(p.k, head), v(p.v, head);
    const bool in = row < p.num_nodes;   // B operands: column n = g is this lane's row
    const int r = w.clamped_row(p.num_nodes);
    KFragment<kDW> qb, db;
    load_k_fragment<kDW>(qb, HeadRows(p.q, head).row(r), in, t);
    load_k_fragment<kDW>(db, HeadRows(p.dout, head).row(r), in, t);
    const int64_t o_at = static_cast<int64_t>(r) * p.out.row_stride + static_cast<int64_t>(head) * p.out.head_stride;
    const void* o_row = p.o_fp32 ? static_cast<const void*>(reinterpret_cast<const float*>(p.out.ptr) + o_at)
                                 : static_cast<const void*>(reinterpret_cast<const uint16_t*>(p.out.ptr) + o_at);
    float dl = partial_delta<T, kDW>(db, o_row, p.o_fp32, in, t);
    dl += __shfl_xor_sync(0xffffffffu, dl, 1);
    dl += __shfl_xor_sync(0xffffffffu, dl, 2);
    const float lse = in ? __ldg(p.lse + static_cast<int64_t>(row) * p.num_heads + head) : 0.f;
    const float lse2 = lse == -INFINITY ? 0.f : lse * 1.4426950408889634f;   // no edge: no block reads it
    if (in && t == 0) p.stats[static_cast<int64_t>(row) * p.num_heads + head] = make_float2(lse2, dl);
    float row_lse2[2], row_dl[2];   // rows 2t, 2t + 1 (held by lanes 4 (2t), 4 (2t + 1))
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        row_lse2[i] = __shfl_sync(0xffffffffu, lse2, 4 * (2 * t + i));
        row_dl[i] = __shfl_sync(0xffffffffu, dl, 4 * (2 * t + i));
    }
    float acc[kMT][4];
#pragma unroll
    for (int j = 0; j < kMT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    Block8 b;   // this block's columns and bitmap, loaded a block ahead
    if (w.begin < w.end) load_block8(b, p.fmt, w.begin, lane);
    for (int tcb = w.begin; tcb < w.end; ++tcb) {
        Block8 nb;
        if (tcb + 1 < w.end) load_block8(nb, p.fmt, tcb + 1, lane);
        VFragment<kDW> kt;
        load_columns_t<kDW>(kt, k, b.c, g, t);
        float s[4], dp[4];   // S^T = K Q^T, dP^T = V dO^T
        block_scores2<T, kDW>(s, dp, k, v, qb, db, b.c, w);
        const uint32_t mask = block8_mask(b, lane);
        float ds[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float pr = ((mask >> i) & 1u) ? fast_exp2(s[i] * p.scale_log2 - row_lse2[i & 1]) : 0.f;
            ds[i] = pr * (dp[i] - row_dl[i & 1]);
        }
        uint32_t b0, b1;
        columns_as_b<T>(b0, b1, ds);
        accumulate_t<T, kDW>(acc, kt, b0, b1);
        b = nb;
    }
    const float mul[2] = {p.scale, p.scale};
    store_rows8<T, kDW>(p.dq, p.grad_fp32, w.out_stride, head, window * 8, p.num_nodes, g, t, acc, mul);
}

template <typename T, int kDW>
__global__ void __launch_bounds__(32, rows8_min_blocks<kDW>())
fused3s_bwd8_dkv_kernel(const Bwd8Params p) {
    constexpr int kMT = kDW / 16;
    const Rows8Item w(p.t_fmt, p.num_heads, kDW);
    const int lane = w.lane, g = w.g, t = w.t, head = w.head, window = w.window;
    const HeadRows q(p.q, head), dout(p.dout, head);
    const bool in = w.row() < p.num_nodes;   // B operands: column n = g is this lane's key
    const int r = w.clamped_row(p.num_nodes);
    KFragment<kDW> kb, vb;
    load_k_fragment<kDW>(kb, HeadRows(p.k, head).row(r), in, t);
    load_k_fragment<kDW>(vb, HeadRows(p.v, head).row(r), in, t);
    float dk[kMT][4], dv[kMT][4];
#pragma unroll
    for (int j = 0; j < kMT; ++j) {
        dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.f;
        dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.f;
    }
    Block8 b;   // this block's columns and bitmap, loaded a block ahead
    if (w.begin < w.end) load_block8(b, p.t_fmt, w.begin, lane);
    for (int tcb = w.begin; tcb < w.end; ++tcb) {
        Block8 nb;
        if (tcb + 1 < w.end) load_block8(nb, p.t_fmt, tcb + 1, lane);
        // (lse log2 e, delta) of this lane's queries: columns g (m = g) and g + 8
        const int c0 = __shfl_sync(0xffffffffu, b.c, g), c1 = __shfl_sync(0xffffffffu, b.c, g + 8);
        const float2 st0 = c0 >= 0 ? __ldg(p.stats + static_cast<int64_t>(c0) * p.num_heads + head) : make_float2(0.f, 0.f);
        const float2 st1 = c1 >= 0 ? __ldg(p.stats + static_cast<int64_t>(c1) * p.num_heads + head) : make_float2(0.f, 0.f);
        float s[4], dp[4];   // S = Q K^T, dP = dO V^T (queries on m, keys on n)
        block_scores2<T, kDW>(s, dp, q, dout, kb, vb, b.c, w);
        const uint32_t mask = block8_mask(b, lane);
        float pr[4], ds[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 sq = i < 2 ? st0 : st1;
            pr[i] = ((mask >> i) & 1u) ? fast_exp2(s[i] * p.scale_log2 - sq.x) : 0.f;
            ds[i] = pr[i] * (dp[i] - sq.y);
        }
        uint32_t pb0, pb1, sb0, sb1;
        columns_as_b<T>(pb0, pb1, pr);
        columns_as_b<T>(sb0, sb1, ds);
        VFragment<kDW> xt;   // dO^T, then Q^T (the scores' operands are dead here)
        load_columns_t<kDW>(xt, dout, b.c, g, t);
        accumulate_t<T, kDW>(dv, xt, pb0, pb1);
        load_columns_t<kDW>(xt, q, b.c, g, t);
        accumulate_t<T, kDW>(dk, xt, sb0, sb1);
        b = nb;
    }
    const float mul_k[2] = {p.scale, p.scale}, mul_v[2] = {1.f, 1.f};
    store_rows8<T, kDW>(p.dk, p.grad_fp32, w.out_stride, head, window * 8, p.num_nodes, g, t, dk, mul_k);
    store_rows8<T, kDW>(p.dv, p.grad_fp32, w.out_stride, head, window * 8, p.num_nodes, g, t, dv, mul_v);
}

template <typename T, int kHeadDim>
cudaError_t run_fused3s_bwd8(const Bwd8Params& params, cudaStream_t stream) {
    // The dQ pass writes the stats the dKV pass reads: same stream, in order.
    const int64_t dq_work = static_cast<int64_t>(params.fmt.num_windows) * params.num_heads;
    if (dq_work > 0) fused3s_bwd8_dq_kernel<T, kHeadDim><<<static_cast<unsigned>(dq_work), 32, 0, stream>>>(params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const int64_t dkv_work = static_cast<int64_t>(params.t_fmt.num_windows) * params.num_heads;
    if (dkv_work > 0) fused3s_bwd8_dkv_kernel<T, kHeadDim><<<static_cast<unsigned>(dkv_work), 32, 0, stream>>>(params);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
