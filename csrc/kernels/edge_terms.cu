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

// Division of a thread's flat index by a runtime divisor. The kernels are
// instantiated for 32-bit indices (work below 2^31 elements: every graph
// we have) where a multiply-high and a shift divide (CUTLASS's FastDivmod),
// and for 64-bit ones. Measured on an H100 (200k power-law graph, E = 6.9M,
// H = 4, F = 16): the 64-bit divisions these light kernels did per element
// before cost more than their memory traffic (edge_rows 0.92 ms per call).
struct FastDiv {
    int64_t d;
    uint32_t mul = 0, shift = 0;
    explicit FastDiv(int64_t divisor) : d(divisor) {
        if (d > 1 && d < (int64_t(1) << 31)) {
            uint32_t log2 = 0;   // ceil(log2(d))
            while ((int64_t(1) << log2) < d) ++log2;
            const uint32_t p = 31 + log2;
            mul = static_cast<uint32_t>(((uint64_t(1) << p) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
            shift = p - 32;
        }
    }
    // exact for n < 2^31 (the 32-bit instances' bound)
    __device__ __forceinline__ uint32_t div(uint32_t n) const { return d == 1 ? n : __umulhi(n, mul) >> shift; }
    __device__ __forceinline__ int64_t div(int64_t n) const { return n / d; }
};

// Whether `total` flat indices take the 32-bit instances (with the
// grid-stride step added, still below 2^32).
bool narrow(int64_t total) { return total < (int64_t(1) << 31); }

// out[e, h] = <X[idx[e], h, :], a[e, :]>. kVec: F is a multiple of 4 and
// both rows are 16-byte aligned (float4 loads). I: the flat index type.
template <bool kVec, typename I>
__global__ void __launch_bounds__(kThreads)
edge_dot_kernel(const float* __restrict__ x, const float* __restrict__ a,
                const int64_t* __restrict__ idx, float* __restrict__ out, EdgeTermsShape s, FastDiv by_heads) {
    const I total = static_cast<I>(s.num_edges * s.heads);
    const int F = s.features;
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const I e = by_heads.div(t);
        const int h = static_cast<int>(t - e * static_cast<I>(s.heads));
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) { out[t] = NAN; continue; }
        const float* xr = x + (n * s.heads + h) * F;
        const float* ar = a + static_cast<int64_t>(e) * F;
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
template <typename I>
__global__ void __launch_bounds__(kThreads)
edge_rows_kernel(const float* __restrict__ w, const float* __restrict__ x,
                 const int64_t* __restrict__ idx, float* __restrict__ out, EdgeTermsShape s, FastDiv by_features) {
    const I total = static_cast<I>(s.num_edges * s.features);
    const int F = s.features, H = s.heads;
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const I e = by_features.div(t);
        const int f = static_cast<int>(t - e * static_cast<I>(F));
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) { out[t] = NAN; continue; }
        const float* xr = x + n * H * F + f;
        const float* wr = w + static_cast<int64_t>(e) * H;
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

template <typename I>
__global__ void __launch_bounds__(kThreads)
edge_scatter_kernel(const float* __restrict__ w, const float* __restrict__ a,
                    const int64_t* __restrict__ rowptr, const int64_t* __restrict__ order,
                    float* __restrict__ out, EdgeTermsShape s, FastDiv by_features, FastDiv by_groups) {
    const int F = s.features, H = s.heads;
    const int groups = static_cast<int>(by_groups.d);
    const I total = static_cast<I>(s.num_nodes * groups * F * kSplit);   // a multiple of kSplit
    const int lane = threadIdx.x & 31;
    const unsigned mask = 0xFFu << (lane & ~(kSplit - 1));         // this output's kSplit lanes
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const int split = static_cast<int>(t % kSplit);
        const I ngf = t / kSplit;
        const I ng = by_features.div(ngf);
        const int f = static_cast<int>(ngf - ng * static_cast<I>(F));
        const int64_t n = by_groups.div(ng);
        const int h0 = static_cast<int>(ng - static_cast<I>(n) * static_cast<I>(groups)) * kHeadsPerThread;
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
    const FastDiv by_heads(s.heads);
    if (narrow(total)) {
        if (vec) edge_dot_kernel<true, uint32_t><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s, by_heads);
        else edge_dot_kernel<false, uint32_t><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s, by_heads);
    } else {
        if (vec) edge_dot_kernel<true, int64_t><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s, by_heads);
        else edge_dot_kernel<false, int64_t><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s, by_heads);
    }
    return cudaGetLastError();
}

cudaError_t run_edge_rows(const float* w, const float* x, const int64_t* idx, float* out,
                          const EdgeTermsShape& s, cudaStream_t stream) {
    const int64_t total = s.num_edges * s.features;
    if (total == 0) return cudaSuccess;
    const dim3 grid(static_cast<unsigned>(blocks_for(total)));
    const FastDiv by_features(s.features);
    if (narrow(total)) edge_rows_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(w, x, idx, out, s, by_features);
    else edge_rows_kernel<int64_t><<<grid, kThreads, 0, stream>>>(w, x, idx, out, s, by_features);
    return cudaGetLastError();
}

cudaError_t run_edge_scatter(const float* w, const float* a, const int64_t* rowptr,
                             const int64_t* order, float* out, const EdgeTermsShape& s,
                             cudaStream_t stream) {
    const int64_t groups = (s.heads + kHeadsPerThread - 1) / kHeadsPerThread;
    const int64_t total = s.num_nodes * groups * s.features * kSplit;
    if (total == 0) return cudaSuccess;
    const dim3 grid(static_cast<unsigned>(blocks_for(total)));
    const FastDiv by_features(s.features), by_groups(groups);
    if (narrow(total)) {
        edge_scatter_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(w, a, rowptr, order, out, s, by_features, by_groups);
    } else {
        edge_scatter_kernel<int64_t><<<grid, kThreads, 0, stream>>>(w, a, rowptr, order, out, s, by_features, by_groups);
    }
    return cudaGetLastError();
}

}  // namespace gt_fused3s
