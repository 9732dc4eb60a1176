// Parameter block of the fused backward pass (FlashAttention-2 style: scores
// are recomputed from q, k and the forward's log-sum-exp, nothing of size
// [E, H] is stored). No torch header here.
//
// The backward runs as two passes of one kernel over a BSB:
//   dQ pass,  over the graph's BSB (row windows = destinations i):
//       dQ_i  = scale * sum_j dS_ij K_j,   delta_i = rowsum(dO_i * O_i) (written)
//   dKV pass, over the transposed BSB (row windows = sources j):
//       dK_j  = scale * sum_i dS_ij Q_i,   dV_j = sum_i P_ij dO_i
// with P_ij = exp(scale q_i.k_j - lse_i), dS_ij = P_ij (dO_i.v_j - delta_i).
// In both passes the window rows give the A operands (a1, a2) and the TCB
// columns the gathered B operands (g1, g2):
//   dQ pass : a1 = Q, a2 = dO, g1 = K, g2 = V;  out1 = dQ
//   dKV pass: a1 = K, a2 = V,  g1 = Q, g2 = dO; out1 = dK, out2 = dV
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>
#include <vector_types.h>

#include "fused3s_params.h"

namespace gt_fused3s {

// One [N, H, D] operand, fp16 or bf16 (fp32 where a flag says so), strides in
// elements; every row/head start 16-byte aligned, last dim contiguous.
struct Fused3SOperand {
    const void* ptr;
    int64_t row_stride, head_stride;
};

struct Fused3SBwdParams {
    Fused3SOperand a1, a2, g1, g2;

    // dQ pass: dO and the forward output O (O in fp32 if o_fp32), for delta.
    Fused3SOperand d_out, out;
    bool o_fp32;

    // lse [N, H] fp32, contiguous: from the forward (natural log, -inf for rows
    // without in-neighbours). stats [N, H] float2: (lse * log2(e), delta) per
    // row, written by the dQ pass and gathered per column by the dKV pass (one
    // 8-byte load for both).
    const float* lse_ptr;
    float2* stats_ptr;
    // dQ pass, optional [N, H] fp32: added to delta (the dp_bias terms'
    // share, sum_j P_ij dp_bias_ij, computed by the caller).
    const float* delta_extra_ptr;

    // Gradients [N, H, D], contiguous, in the input dtype or fp32 (grad_fp32):
    // out1 = dQ or dK, out2 = dV (dKV pass only).
    void* out1_ptr;
    void* out2_ptr;
    bool grad_fp32;

    // This pass's BSB and work schedule (as for the forward).
    const int32_t* cols_ptr;
    const uint64_t* bitmap_ptr;
    const Fused3SItem* items_ptr;
    int32_t num_items;
    const Fused3SSlot* slots_ptr;
    int32_t num_slots;

    // Workspace of split windows (zeroed counters, as for the forward):
    //   counters [num_slots * H] int32, part1 / part2 [num_slots, H, 16, D] fp32
    //   (unscaled partial sums of out1 / out2; the last chunk's team adds them up).
    int32_t* counters_ptr;
    float* part1_ptr;
    float* part2_ptr;

    int32_t num_nodes;
    int32_t num_heads;
    // Heads one warp runs (fused3s_bwd_kernel.cuh: head groups): 1, or up to
    // max_head_group(D) dividing H, with the heads of a1, a2, g1 and g2
    // adjacent (head stride = D); 0 reads as 1.
    int32_t head_group;
    float scale;        // s
    float scale_log2;   // s * log2(e)

    // Edge bias of this pass's BSB (grad: dQ pass only); read by the
    // instances with a bias.
    EdgeBiasArgs bias;
};

// Zeroes the arrival counters and launches the dQ pass, then the dKV pass, on
// `stream`. T is __half or __nv_bfloat16; HeadDim in {16, 32, 64, 128, 256};
// kEdges: 0 none, 1 each pass's edge terms, 2 those and attention dropout. Returns the first CUDA error of the
// launches.
template <typename T, int HeadDim, int kEdges>
cudaError_t run_fused3s_bwd(const Fused3SBwdParams& dq_pass, const Fused3SBwdParams& dkv_pass, cudaStream_t stream);

}  // namespace gt_fused3s
