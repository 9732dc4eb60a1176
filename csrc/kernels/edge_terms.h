// Products between node tensors and per-edge features: what TransformerConv's
// edge features (edge_dim) add to the fused attention. gt_fused3s/edge_terms.py
// holds their definition (its PyTorch code is the reference); these kernels
// compute them in one pass each, without the [E, H, F] product that the
// PyTorch form gathers.
//
// With a [E, F] the edges' features, idx [E] a node of each edge, X [N, H, F]
// and w [E, H]:
//   edge_dot      out[e, h]    = sum_f X[idx[e], h, f] a[e, f]            [E, H]
//   edge_rows     out[e, f]    = sum_h w[e, h] X[idx[e], h, f]            [E, F]
//                 (+ the same sum over a second pair w2, X2)
//   edge_scatter  out[n, h, f] = sum_{e: idx[e] = n} w[e, h] a[e, f]      [N, H, F]
// edge_scatter reads the edges grouped by node (rowptr [N + 1], order [E]:
// the edges of node n are order[rowptr[n] .. rowptr[n + 1])), so each output
// is the sum of a few threads' sums added in a fixed order: no atomics, the
// same result on every run.
//
// No torch header: fp32, contiguous, raw device pointers, a stream. An index
// outside [0, N) reads nothing and gives NaN (never an out-of-bounds read).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

struct EdgeTermsShape {
    int64_t num_edges;   // E
    int64_t num_nodes;   // N
    int32_t heads;       // H
    int32_t features;    // F
};

cudaError_t run_edge_dot(const float* x, const float* a, const int64_t* idx, float* out,
                         const EdgeTermsShape& s, cudaStream_t stream);
// w2, x2 (null: none): a second term of the same shapes added to the sum,
// out[e, f] += sum_h w2[e, h] x2[idx[e], h, f] (the edge features' gradient
// from the key and the value term in one pass)
cudaError_t run_edge_rows(const float* w, const float* x, const float* w2, const float* x2, const int64_t* idx,
                          float* out, const EdgeTermsShape& s, cudaStream_t stream);
// The attention weights from the forward's raw scores (fwd_scores):
// out[e, h] = exp(scale scores[e, h] + bias[e, h] - lse[idx[e], h]), [E, H]
// (bias may be null; lse [N, H], the features count F unused).
cudaError_t run_edge_probs(const float* scores, const float* bias, const float* lse, const int64_t* idx, float scale,
                           float* out, const EdgeTermsShape& s, cudaStream_t stream);
cudaError_t run_edge_scatter(const float* w, const float* a, const int64_t* rowptr,
                             const int64_t* order, float* out, const EdgeTermsShape& s,
                             cudaStream_t stream);

}  // namespace gt_fused3s
