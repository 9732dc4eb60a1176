// Dense rows of sequence attention: a few queries (the global rows of a
// mask: at most 32, each attending to every key of its sequence) against
// all L keys, forward (tensor cores) and backward (CUDA cores, fp32).
//
// Why kernels of their own: as torch ops (chunked bmm and softmax, ~15
// small ops, fp32 copies of K and V under autograd) they were most of a
// Longformer call: 0.6 ms of host time for a 65k-token forward whose fused
// kernel takes 0.043 ms, and ~3.7 of 6.1 ms of a 1M-token forward +
// backward on an H200 (README). torch's scaled_dot_product_attention gives
// the few queries one thread block for all keys (9.3 ms at 1M). Here the
// keys are split into chunks (as flash-decoding does): the forward's a warp
// each, which writes its partial softmax state (max, sum, weighted values),
// and a second kernel merges the chunks; the backward's a thread block
// each, which needs no merge for dK and dV (a block owns its keys) and adds
// dQ of the few queries with atomics.
//
// Layout: qg, dog [B, G, H, D] (contiguous), k, v [B, L, H, D] (last dim
// contiguous, rows and heads 16-byte aligned, any batch / row / head
// strides in elements); og fp32 [B, G, H, D]; lse fp32 [B, H, G] (natural
// log). No torch header: raw device pointers, a stream.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

constexpr int kDenseRowsMaxQueries = 32;

struct DenseRowsParams {
    // The queries: query i of batch b, head h at qg + b q_batch_stride +
    // r q_row_stride + h q_head_stride (16-bit elements), r = q_rows[i] where
    // q_rows is set (the forward gathers the rows of q [B, L, H, D]; r in
    // [0, q_len)), else r = i (qg [B, G, H, D] contiguous: the backward's).
    const void* qg;
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    const int64_t* q_rows;
    int64_t q_len;
    const void* k;
    const void* v;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int32_t batch, queries, heads, keys;   // B, G (<= 32), H, L
    int64_t chunk_keys;    // keys a chunk has: a forward warp's (dense_rows_fwd_chunk_keys), a backward block's
    float scale;
    // forward: the merged output and log-sum-exp; the chunks' partial states
    float* og;             // [B, G, H, D] fp32
    float* lse;            // [B, H, G] fp32
    float* partial;        // [chunks, B H, G, D + 2] fp32 workspace (dense_rows_workspace)
    // forward, where set: the output in qg's dtype too, query i of (b, h) at
    // out_rows + b out_batch_stride + r out_row_stride + h out_head_stride,
    // r = q_rows[i] where out_at_q_rows (over the kernel's rows of the whole
    // output), else i
    void* out_rows;
    int64_t out_batch_stride, out_row_stride, out_head_stride;
    bool out_at_q_rows;
    // backward (dog, delta = rowsum(dog og) [B, H, G], lse as the forward's)
    const void* dog;       // [B, G, H, D], the dtype of qg
    const float* delta;
    float* dqg;            // [B, G, H, D] fp32, added to (zeroed by the caller)
    void* dk;              // [B, L, H, D] contiguous, the dtype of qg: written,
    void* dv;              // or where dkv_add is set added to (one rounding of the sum)
    bool dkv_add;
};

// Keys per thread block of the backward (a chunk): as many as
// spread the rows' keys over about 2 blocks a streaming multiprocessor, at
// least 256, in steps of 64 keys. (H200, Longformer's 3 rows, forward's
// kernels: a fixed 1024 gave a 65k-key row 64 blocks walking 16 steps each,
// 46 us; 4 blocks an SM, 36 us there but 83 against 68 us at 262k keys,
// where the merge folds twice the chunks.)
constexpr int kDenseRowsStepKeys = 64;
inline int64_t dense_rows_chunk_keys(int64_t keys, int64_t batch_heads, int64_t sms) {
    const int64_t blocks = 2 * (sms > 0 ? sms : 1);
    const int64_t per = (keys * batch_heads + blocks - 1) / blocks;
    const int64_t steps = (per + kDenseRowsStepKeys - 1) / kDenseRowsStepKeys;
    return (steps > 4 ? steps : 4) * kDenseRowsStepKeys;
}
// The forward's chunks: a warp's keys (kDenseRowsFwdWarps warps a block, a
// block an SM by its shared memory): as many as spread the keys over every
// warp of `sms` SMs, at least 4 steps of 32 keys.
constexpr int kDenseRowsFwdWarps = 4;
inline int64_t dense_rows_fwd_chunk_keys(int64_t keys, int64_t batch_heads, int64_t sms) {
    const int64_t warps = kDenseRowsFwdWarps * (sms > 0 ? sms : 1);
    const int64_t per = (keys * batch_heads + warps - 1) / warps;
    const int64_t steps = (per + 31) / 32;
    return (steps > 4 ? steps : 4) * 32;
}
inline int64_t dense_rows_chunks(int64_t keys, int64_t chunk_keys) { return (keys + chunk_keys - 1) / chunk_keys; }
// Floats of the forward's workspace.
inline int64_t dense_rows_workspace(int64_t batch, int64_t heads, int64_t queries, int64_t head_dim,
                                    int64_t keys, int64_t chunk_keys) {
    return dense_rows_chunks(keys, chunk_keys) * batch * heads * queries * (head_dim + 2);
}

// T: __half or __nv_bfloat16; HeadDim in {32, 64, 128}.
template <typename T, int HeadDim>
cudaError_t run_dense_rows_fwd(const DenseRowsParams& p, cudaStream_t stream);
template <typename T, int HeadDim>
cudaError_t run_dense_rows_bwd(const DenseRowsParams& p, cudaStream_t stream);

}  // namespace gt_fused3s
