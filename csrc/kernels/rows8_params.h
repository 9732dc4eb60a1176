// Parameter blocks of the kernels over 8-row windows (issue 13: FlashSparse's
// swap-and-transpose; the format is gt_fused3s/graph8.py's BSBGraph8). No
// torch header here.
//
// The forward computes, per block of 16 columns x 8 rows of a window,
//   S^T [16 cols, 8 rows] = K_cols Q_win^T, the online softmax per row,
//   O^T [D, 8 rows]      += V_cols^T P^T,
// so the window's rows are the mma's n = 8 side and its 16 columns the
// m = 16 side: half the 16 x 8 format's mma invocations where a window's
// rows share few sources (molecule batches, citation graphs).
// The backward runs two passes, as the 16-row one (fused3s_bwd_params.h):
//   dQ pass over the graph's 8-row format:     dQ, and (lse log2 e, delta) per row
//   dKV pass over the transposed 8-row format: dK, dV (rows = sources j,
//                                              columns = the queries i that see them)
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>
#include <vector_types.h>

namespace gt_fused3s {

// One 8-row format (BSBGraph8): cols int32 [T * 16] (-1 = padding), bitmap
// uint64 [T, 2] (column c, row rr: bit (c % 8) * 8 + rr of word c / 8), and
// its windows heaviest first, int32 [R, 4] = (window r, its first block,
// one past its last, 0) (BSBGraph8.window_items: one 16-byte load where
// window_order then rw_offset were two dependent ones).
struct Rows8Format {
    const int32_t* cols;
    const uint4* bitmap;
    const int4* windows;
    int32_t num_windows;
};

// An input [N, H, D]: head h of row n at n * row_stride + h * head_stride
// (elements; both multiples of 8, the start 16-byte aligned, the last dim
// contiguous: a column slice of a wider projection is read in place).
struct Rows8Operand {
    const void* ptr;
    int64_t row_stride, head_stride;
};

// q, k, v (and the backward's dO, O): Rows8Operand, fp16 or bf16 (O in fp32
// where a flag says so); the outputs (out, dQ, dK, dV) [N, H, D] contiguous,
// in the input dtype or fp32. lse [N, H] fp32, natural log, -inf for a row
// without in-neighbours.
struct Fwd8Params {
    Rows8Operand q, k, v;
    void* out;
    bool out_fp32;
    float* lse;
    Rows8Format fmt;
    int32_t num_nodes, num_heads;
    float scale_log2;   // scale * log2(e)
};

struct Bwd8Params {
    Rows8Operand q, k, v;
    Rows8Operand out;   // O, for delta = rowsum(dO * O) (dQ pass)
    bool o_fp32;
    Rows8Operand dout;
    const float* lse;
    float2* stats;      // [N, H] (lse log2 e, delta): written by the dQ pass, read by the dKV pass
    void* dq;
    void* dk;
    void* dv;
    bool grad_fp32;
    Rows8Format fmt;    // the dQ pass's (the graph's)
    Rows8Format t_fmt;  // the dKV pass's (the transposed graph's)
    int32_t num_nodes, num_heads;
    float scale, scale_log2;
};

// T: __half or __nv_bfloat16; HeadDim in {16, 32, 64, 128}. The backward
// launches the dQ pass, then the dKV pass, on `stream`. Return the launch error.
template <typename T, int HeadDim>
cudaError_t run_fused3s_fwd8(const Fwd8Params& params, cudaStream_t stream);
template <typename T, int HeadDim>
cudaError_t run_fused3s_bwd8(const Bwd8Params& params, cudaStream_t stream);

}  // namespace gt_fused3s
