// Plain parameter block of the fused SDDMM + online-softmax + SpMM forward pass.
// No torch header here: raw pointers, element strides, sizes, the scale.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

// One work item of the forward kernel: a chunk of consecutive TCBs of one row
// window. Items are listed heaviest first; block b runs work index w = b =
// item * (num_heads / head_group) + group (the heads head_group x group ..).
//   window     : row window r (rows 16r .. 16r+15); -1: an unused item of a
//                schedule built at capacity, which the kernels skip
//   tcb_begin  : first TCB of the chunk (global TCB index)
//   tcb_end    : one past the last TCB (tcb_begin == tcb_end: empty window,
//                the item writes zeros and lse = -inf)
//   slot       : -1 if the chunk is the whole window (output written directly);
//                else the partial-result slot this chunk writes; the team that
//                completes a window's last chunk merges its partials
struct Fused3SItem {
    int32_t window;
    int32_t tcb_begin;
    int32_t tcb_end;
    int32_t slot;
};

// Per partial slot: the split window it belongs to and that window's slots
// slot_begin .. slot_end-1 (one per chunk).
struct Fused3SSlot {
    int32_t window;
    int32_t slot_begin;
    int32_t slot_end;
    int32_t pad_;
};

// Per-edge terms of one pass over a BSB, read by the kernel instances with
// edge terms (kBias). Every per-edge array is fp32 [E, H], contiguous, in
// the caller's edge order, reached through slot_edge (edge_bias.cuh);
// null = absent.
struct EdgeBiasArgs {
    const float* bias;            // added to the scaled score before the softmax
    float* grad;                  // dS per edge (written by the backward's dQ pass)
    const float* dp_bias;         // backward: added to dP = dO.v (the gradient of the
                                  // returned probabilities, or of terms built on them)
    const int32_t* nnz_offset;    // [T + 1] first non-zero of each TCB of this pass's BSB
    const int32_t* slot_edge;     // [E] the caller's edge id of each non-zero of this BSB
    const uint8_t* slot_pos;      // [E] its place in its TCB pair's mma fragments (edge_bias.cuh)
    int32_t num_heads;            // H: the stride between edges
    // Attention dropout (edge_bias.cuh: dropout_hash, keyed by the edge id):
    // off if drop_threshold is 0.
    uint32_t drop_threshold;      // round(p * 2^32)
    float drop_scale;             // 1 / (1 - p); 1 without dropout
    uint32_t seed_lo, seed_hi;
    // The seed in device memory instead (an int64: words lo, hi), where the
    // caller drew it on the GPU: a captured CUDA graph or a compiled region
    // draws a new one each run, which a value fixed at launch could not.
    const uint32_t* seed_ptr;
};

struct Fused3SParams {
    // q, k, v: [N, H, D], fp16 or bf16, last dim contiguous. Strides are in
    // elements; every row/head start must be 16-byte aligned.
    const void* q_ptr;
    const void* k_ptr;
    const void* v_ptr;
    int64_t q_row_stride, q_head_stride;
    int64_t k_row_stride, k_head_stride;
    int64_t v_row_stride, v_head_stride;

    // out: [N, H, D] in the input dtype or fp32 (out_fp32), arbitrary 16-byte
    // aligned row/head strides, last dim contiguous.
    void* o_ptr;
    int64_t o_row_stride, o_head_stride;
    bool out_fp32;

    // lse: [N, H] fp32, natural-log log-sum-exp of the scaled scores (-inf for
    // rows without in-neighbours).
    float* lse_ptr;
    int64_t lse_row_stride, lse_head_stride;

    // BSB: cols int32 [T * 8] (-1 = padding), bitmap uint64 [T, 2].
    const int32_t* cols_ptr;
    const uint64_t* bitmap_ptr;

    // Schedule.
    const Fused3SItem* items_ptr;
    int32_t num_items;
    const Fused3SSlot* slots_ptr;   // [num_slots]
    int32_t num_slots;

    // Workspace, zeroed before the launch (the launcher does it on the stream):
    //   counters [num_slots * H] int32: [s0 * H + h] = chunks of (split window with
    //            first slot s0, head h) finished
    //   part_o   [num_slots, H, 16, D] fp32 unnormalised O of each chunk
    //   part_ml  [num_slots, H, 16, 2] fp32 (row max in log2 units, row sum)
    int32_t* counters_ptr;
    float* part_o_ptr;
    float* part_ml_ptr;

    int32_t num_nodes;   // N
    int32_t num_heads;   // H
    float scale_log2;    // scale * log2(e)
    // Heads one warp runs (fused3s_fwd_kernel.cuh: head groups): 1, or up to
    // max_head_group(D) dividing H (the host's head_group() picks it; 0 reads
    // as 1).
    int32_t head_group;

    // Edge terms (the kernel instance with edge terms reads them; the one
    // without ignores them).
    EdgeBiasArgs bias;

    // Forward instances with scores (kEdges 3, 4): each edge's raw q_i.k_j
    // written as [E, H] fp32 in the caller's edge order, so that
    // P = exp(scale q_i.k_j + bias - lse_i) needs no score pass.
    float* scores_ptr;
};

// The most heads one warp of the graph kernels runs at this head dim (head
// groups: as many as fill a head dim of 64).
__host__ __device__ constexpr int max_head_group(int head_dim) { return head_dim <= 32 ? 64 / head_dim : 1; }

// Zeroes the arrival counters and launches the forward kernel on `stream`.
// T is __half or __nv_bfloat16; HeadDim in {16, 32, 64, 128, 256}; kEdges:
// 0 none, 1 the edge terms of params.bias, 2 those and attention dropout,
// 3 and 4 as 1 and 2, writing each edge's q_i.k_j to params.scores_ptr.
template <typename T, int HeadDim, int kEdges>
void run_fused3s_fwd(const Fused3SParams& params, cudaStream_t stream);

}  // namespace gt_fused3s
