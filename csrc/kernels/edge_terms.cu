// The edge-feature products of edge_terms.h: plain CUDA-core kernels, fp32
// accumulation in a fixed order.
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

// out[n, h, f] = sum over the edges e of node n of w[e, h] a[e, f].
// kSplit threads (adjacent lanes) share one output group, (node, up to
// kHeadsPerThread heads, f): lane s takes the node's edges s, s + kSplit,
// ..., and the lanes' sums are added by shuffles in a fixed tree, so the
// result is the same every run. One thread per output walked a high-degree
// node's edges alone (4,204 edges on the 200k power-law graph: that tail set
// the kernel's time). a[e, f] is read once for the heads of a thread.
constexpr int kHeadsPerThread = 4;
constexpr int kSplit = 8;
constexpr int kUnroll = 4;

__global__ void __launch_bounds__(kThreads)
edge_scatter_kernel(const float* __restrict__ w, const float* __restrict__ a,
                    const int64_t* __restrict__ rowptr, const int64_t* __restrict__ order,
                    float* __restrict__ out, EdgeTermsShape s) {
    const int F = s.features, H = s.heads;
    const int groups = (H + kHeadsPerThread - 1) / kHeadsPerThread;
    const int64_t total = s.num_nodes * groups * F * kSplit;       // a multiple of kSplit
    const int lane = threadIdx.x & 31;
    const unsigned mask = 0xFFu << (lane & ~(kSplit - 1));         // this output's kSplit lanes
    for (int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x; t < total;
         t += int64_t(gridDim.x) * kThreads) {
        const int split = static_cast<int>(t % kSplit);
        const int64_t ngf = t / kSplit;
        const int64_t ng = ngf / F;
        const int f = static_cast<int>(ngf - ng * F);
        const int64_t n = ng / groups;
        const int h0 = static_cast<int>(ng - n * groups) * kHeadsPerThread;
        const int nh = H - h0 < kHeadsPerThread ? H - h0 : kHeadsPerThread;
        const int64_t end = rowptr[n + 1];
        float acc[kHeadsPerThread] = {};
        bool bad = false;
        // kUnroll edges per step: their indices, then their values, loaded
        // independently (a step waits about two memory latencies, not 2 kUnroll)
        int64_t k = rowptr[n] + split;
        for (; k + (kUnroll - 1) * kSplit < end && !bad; k += kUnroll * kSplit) {
            int64_t e[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                e[u] = order[k + u * kSplit];
                bad |= !node_ok(e[u], s.num_edges);
            }
            if (bad) break;
            float av[kUnroll], wv[kUnroll][kHeadsPerThread];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                av[u] = a[e[u] * F + f];
#pragma unroll
                for (int j = 0; j < kHeadsPerThread; ++j) wv[u][j] = j < nh ? w[e[u] * H + h0 + j] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int j = 0; j < kHeadsPerThread; ++j) acc[j] = fmaf(wv[u][j], av[u], acc[j]);
        }
        for (; k < end && !bad; k += kSplit) {
            const int64_t e = order[k];
            if (!node_ok(e, s.num_edges)) { bad = true; break; }
            const float av = a[e * F + f];
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j)
                if (j < nh) acc[j] = fmaf(w[e * H + h0 + j], av, acc[j]);
        }
#pragma unroll
        for (int off = 1; off < kSplit; off <<= 1) {
            bad |= __shfl_xor_sync(mask, static_cast<int>(bad), off, kSplit) != 0;
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j) acc[j] += __shfl_xor_sync(mask, acc[j], off, kSplit);
        }
        if (split == 0) {
            float* o = out + (n * H + h0) * F + f;
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j)
                if (j < nh) o[j * F] = bad ? NAN : acc[j];
        }
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
    const int64_t groups = (s.heads + kHeadsPerThread - 1) / kHeadsPerThread;
    const int64_t total = s.num_nodes * groups * s.features * kSplit;
    if (total == 0) return cudaSuccess;
    edge_scatter_kernel<<<static_cast<unsigned>(blocks_for(total)), kThreads, 0, stream>>>(
        w, a, rowptr, order, out, s);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
