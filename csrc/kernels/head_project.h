// Per-head products of node rows with a small per-head weight w [H, C, F]
// (TransformerConv's lin_edge weight viewed per head, e = W_e a): the
// projections of the edge-feature attention (gt_fused3s/edge_terms.py:
// head_project, whose block-diagonal GEMM is the reference) and their
// weight gradient.
//
//   head_project             out[n, h, f] = scale sum_c x[n, h, c] w[h, c, f]   [N, H, F]
//   head_project transposed  out[n, h, c] = scale sum_f x[n, h, f] w[h, c, f]   [N, H, C]
//   head_outer_sum           partials[k, h, c, f] = sum over chunk k's rows n of
//                              s1 x1[n, h, c] y1[n, h, f] + s2 x2[n, h, c] y2[n, h, f]
//                            (the caller sums the chunks: dw = partials.sum(0))
//
// Why not cuBLAS: the block-diagonal GEMMs that computed these do H times
// the products (in fp32 SIMT where W_e is fp32), need the block matrices
// and casts built each call, and each GEMM call cost 35-90 us of host time
// on the H100 machines' hosts (profiler, README) where a kernel here costs
// a launch. The products are few (C, F are a head dim and edge_dim): plain
// CUDA cores with fp32 accumulation in a fixed order (no atomics) take
// about the GEMMs' GPU time (bench_edge on an H100: the edge-feature
// attention's kernels -9% to +10%, README).
//
// No torch header: contiguous rows, x in fp32 / fp16 / bf16, w, y and the
// outputs fp32, raw device pointers, a stream. C and F at most 768 (w[h]'s
// chunk of 16 columns in 48 KB of shared memory), C a multiple of 4.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

enum class RowDtype { kF32, kF16, kBF16 };

struct HeadShape {
    int64_t rows;   // N
    int32_t heads;  // H
    int32_t c;      // C: w's second dim (the head dim)
    int32_t f;      // F: w's third dim (edge_dim)
};

cudaError_t run_head_project(const void* x, RowDtype x_dtype, const float* w, float scale, bool transposed,
                             float* out, const HeadShape& s, cudaStream_t stream);

// How many chunks of rows head_outer_sum splits N into (partials holds
// chunks x H x C x F floats): enough blocks to fill the GPU, bounded memory.
int64_t head_outer_sum_chunks(const HeadShape& s);

// x2, y2 null: one term. x1, x2 of x_dtype; y1, y2 fp32.
cudaError_t run_head_outer_sum(const void* x1, const float* y1, float s1, const void* x2, const float* y2, float s2,
                               RowDtype x_dtype, float* partials, int64_t chunks, const HeadShape& s,
                               cudaStream_t stream);

}  // namespace gt_fused3s
