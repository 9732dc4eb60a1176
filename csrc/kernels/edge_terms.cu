// The edge-feature products of edge_terms.h: plain CUDA-core kernels, one
// thread per output element, fp32 accumulation in a fixed order.
#include "edge_terms.h"

#include <cmath>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;   // grid-stride beyond

int64_t blocks_for(int64_t total) {
    const int64_t b = (total + kThreads - 1) / kThreads;
    return b < kMaxBlocks ? b : kMaxBlocks;
}

__device__ __forceinline__ bool node_ok(int64_t n, int64_t num_nodes) {
    return static_cast<uint64_t>(n) < static_cast<uint64_t>(num_nodes);
}

// out[e, h] = <X[idx[e], h, :], a[e, :]>. kVec: F is a multiple of 4 and
// both rows are 16-byte aligned (float4 loads).
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
edge_dot_kernel(const float* __restrict__ x, const float* __restrict__ a,
                const int64_t* __restrict__ idx, float* __restrict__ out, EdgeTermsShape s) {
    const int64_t total = s.num_edges * s.heads;
    const int F = s.features;
    for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total;
         t += int64_t(gridDim.x) * kThreads) {
        const int64_t e = t / s.heads;
        const int h = static_cast<int>(t - e * s.heads);
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) { out[t] = NAN; continue; }
        const float* xr = x + (n * s.heads + h) * F;
        const float* ar = a + e * F;
        float acc = 0.f;
        if constexpr (kVec) {
            for (int f = 0; f < F; f += 4) {
                const float4 xv = *reinterpret_cast<const float4*>(xr + f);
                const float4 av = *reinterpret_cast<const float4*>(ar + f);
                acc = fmaf(xv.x, av.x, acc);
                acc = fmaf(xv.y, av.y, acc);
                acc = fmaf(xv.z, av.z, acc);
                acc = fmaf(xv.w, av.w, acc);
            }
        } else {
            for (int f = 0; f < F; ++f) acc = fmaf(xr[f], ar[f], acc);
        }
        out[t] = acc;
    }
}

// out[e, f] = sum_h w[e, h] X[idx[e], h, f]: consecutive threads take
// consecutive f of one edge (coalesced rows of X, w[e, h] broadcast).
__global__ void __launch_bounds__(kThreads)
edge_rows_kernel(const float* __restrict__ w, const float* __restrict__ x,
                 const int64_t* __restrict__ idx, float* __restrict__ out, EdgeTermsShape s) {
    const int64_t total = s.num_edges * s.features;
    const int F = s.features, H = s.heads;
    for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total;
         t += int64_t(gridDim.x) * kThreads) {
        const int64_t e = t / F;
        const int f = static_cast<int>(t - e * F);
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) { out[t] = NAN; continue; }
        const float* xr = x + n * H * F + f;
        const float* wr = w + e * H;
        float acc = 0.f;
        for (int h = 0; h < H; ++h) acc = fmaf(wr[h], xr[h * F], acc);
        out[t] = acc;
    }
}

// out[n, h, f] = sum over the edges e of node n of w[e, h] a[e, f]. Threads
// run over (n, h, f) with f fastest (coalesced rows of a, w[e, h]
// broadcast); a node's edges are read four at a time with independent
// loads, so the thread of a high-degree node is not one long chain of
// dependent loads. The sum's order is fixed: the same result every run.
__global__ void __launch_bounds__(kThreads)
edge_scatter_kernel(const float* __restrict__ w, const float* __restrict__ a,
                    const int64_t* __restrict__ rowptr, const int64_t* __restrict__ order,
                    float* __restrict__ out, EdgeTermsShape s) {
    const int F = s.features, H = s.heads;
    const int64_t total = s.num_nodes * H * F;
    for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total;
         t += int64_t(gridDim.x) * kThreads) {
        const int64_t nh = t / F;
        const int f = static_cast<int>(t - nh * F);
        const int64_t n = nh / H;
        const int h = static_cast<int>(nh - n * H);
        const int64_t begin = rowptr[n], end = rowptr[n + 1];
        float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
        int64_t k = begin;
        bool bad = false;
        for (; k + 4 <= end; k += 4) {
            const int64_t e0 = order[k], e1 = order[k + 1], e2 = order[k + 2], e3 = order[k + 3];
            bad |= !node_ok(e0, s.num_edges) | !node_ok(e1, s.num_edges) |
                   !node_ok(e2, s.num_edges) | !node_ok(e3, s.num_edges);
            if (bad) break;
            acc0 = fmaf(w[e0 * H + h], a[e0 * F + f], acc0);
            acc1 = fmaf(w[e1 * H + h], a[e1 * F + f], acc1);
            acc2 = fmaf(w[e2 * H + h], a[e2 * F + f], acc2);
            acc3 = fmaf(w[e3 * H + h], a[e3 * F + f], acc3);
        }
        for (; k < end && !bad; ++k) {
            const int64_t e = order[k];
            bad = !node_ok(e, s.num_edges);
            if (!bad) acc0 = fmaf(w[e * H + h], a[e * F + f], acc0);
        }
        out[t] = bad ? NAN : (acc0 + acc1) + (acc2 + acc3);
    }
}

}  // namespace

cudaError_t run_edge_dot(const float* x, const float* a, const int64_t* idx, float* out,
                         const EdgeTermsShape& s, cudaStream_t stream) {
    const int64_t total = s.num_edges * s.heads;
    if (total == 0) return cudaSuccess;
    const bool vec = s.features % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(a) % 16 == 0;
    const dim3 grid(static_cast<unsigned>(blocks_for(total)));
    if (vec) edge_dot_kernel<true><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s);
    else edge_dot_kernel<false><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s);
    return cudaGetLastError();
}

cudaError_t run_edge_rows(const float* w, const float* x, const int64_t* idx, float* out,
                          const EdgeTermsShape& s, cudaStream_t stream) {
    const int64_t total = s.num_edges * s.features;
    if (total == 0) return cudaSuccess;
    edge_rows_kernel<<<static_cast<unsigned>(blocks_for(total)), kThreads, 0, stream>>>(w, x, idx, out, s);
    return cudaGetLastError();
}

cudaError_t run_edge_scatter(const float* w, const float* a, const int64_t* rowptr,
                             const int64_t* order, float* out, const EdgeTermsShape& s,
                             cudaStream_t stream) {
    const int64_t total = s.num_nodes * s.heads * s.features;
    if (total == 0) return cudaSuccess;
    edge_scatter_kernel<<<static_cast<unsigned>(blocks_for(total)), kThreads, 0, stream>>>(
        w, a, rowptr, order, out, s);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
