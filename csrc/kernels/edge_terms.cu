// The edge-feature products of edge_terms.h: plain CUDA-core kernels, fp32
// accumulation in a fixed order.
#include "edge_terms.h"

#include <cmath>
#include <type_traits>

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
// and for 64-bit ones: the 64-bit divisions these light kernels did per
// element before cost more than their memory traffic (edge_rows_kernel).
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

// V consecutive floats of a row (V = 4: one 16-byte access; the caller
// checks F % 4 == 0 and 16-byte aligned rows).
template <int V>
__device__ __forceinline__ void load_vec(float (&dst)[V], const float* src) {
    if constexpr (V == 4) {
        const float4 x = *reinterpret_cast<const float4*>(src);
        dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) dst[j] = src[j];
    }
}

template <int V>
__device__ __forceinline__ void store_vec(float* dst, const float (&src)[V]) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(src[0], src[1], src[2], src[3]);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) dst[j] = src[j];
    }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls launch(index, vec, flag) with three run-time choices made
// compile-time ones, so that each kernel's instances are picked in one
// place: the index type (uint32_t{} where `total` flat indices are narrow,
// else int64_t{}), the rows' 16-byte vectors and one flag of the caller's
// (std::true_type or std::false_type each).
template <typename Launch>
void launch_instance(int64_t total, bool vec, bool flag, Launch&& launch) {
    auto by_flag = [&](auto index, auto v) {
        if (flag) launch(index, v, std::true_type{});
        else launch(index, v, std::false_type{});
    };
    auto by_vec = [&](auto index) {
        if (vec) by_flag(index, std::true_type{});
        else by_flag(index, std::false_type{});
    };
    if (narrow(total)) by_vec(uint32_t{});
    else by_vec(int64_t{});
}

// out[e, h] = <X[idx[e], h, :], a[e, :]>: a thread per edge and group of
// up to kHeads heads (1 or kDotHeads: run_edge_dot), reading a's row once
// for its heads. kVec: F is a multiple of 4 and the rows are 16-byte
// aligned (float4 loads). I: the flat index type.
constexpr int kDotHeads = 4;
constexpr int64_t kDotGroupEdges = int64_t(1) << 19;   // run_edge_dot
template <int kHeads, bool kVec, typename I>
__global__ void __launch_bounds__(kThreads)
edge_dot_kernel(const float* __restrict__ x, const float* __restrict__ a,
                const int64_t* __restrict__ idx, float* __restrict__ out, EdgeTermsShape s, FastDiv by_groups) {
    const int groups = static_cast<int>(by_groups.d);
    const I total = static_cast<I>(s.num_edges * groups);
    const int F = s.features, H = s.heads;
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const I e = by_groups.div(t);
        const int h0 = static_cast<int>(t - e * static_cast<I>(groups)) * kHeads;
        const int nh = H - h0 < kHeads ? H - h0 : kHeads;
        float* o = out + static_cast<int64_t>(e) * H + h0;
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) {
            for (int j = 0; j < nh; ++j) o[j] = NAN;
            continue;
        }
        const float* xr = x + (n * H + h0) * F;
        const float* ar = a + static_cast<int64_t>(e) * F;
        float acc[kHeads] = {};
        // (guards, no breaks, in the head loops: they unroll, acc stays in registers)
        if constexpr (kVec) {
            for (int f = 0; f < F; f += 4) {
                const float4 av = *reinterpret_cast<const float4*>(ar + f);
#pragma unroll
                for (int j = 0; j < kHeads; ++j) {
                    if (j < nh) {
                        const float4 xv = *reinterpret_cast<const float4*>(xr + j * F + f);
                        acc[j] = fmaf(xv.x, av.x, acc[j]);
                        acc[j] = fmaf(xv.y, av.y, acc[j]);
                        acc[j] = fmaf(xv.z, av.z, acc[j]);
                        acc[j] = fmaf(xv.w, av.w, acc[j]);
                    }
                }
            }
        } else {
            for (int f = 0; f < F; ++f) {
                const float av = ar[f];
#pragma unroll
                for (int j = 0; j < kHeads; ++j)
                    if (j < nh) acc[j] = fmaf(xr[j * F + f], av, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < kHeads; ++j)
            if (j < nh) o[j] = acc[j];
    }
}

// out[e, f] = sum_h w[e, h] X[idx[e], h, f]: a thread takes V consecutive f
// of one edge, consecutive threads the next ones (coalesced rows of X and of
// out, w[e, h] broadcast). Measured on an H100 (200k power-law graph, E =
// 6.9M, H = 4, F = 16, two calls per layer step): 1.84 ms with 64-bit
// divisions and one f per thread, 1.27 ms with 32-bit ones, 0.63 ms with
// V = 4; edge_scatter (V = 4 too) 1.44 -> 0.85 ms.
template <typename I, int V>
__global__ void __launch_bounds__(kThreads)
edge_rows_kernel(const float* __restrict__ w, const float* __restrict__ x, const float* __restrict__ w2,
                 const float* __restrict__ x2, const int64_t* __restrict__ idx, float* __restrict__ out,
                 EdgeTermsShape s, FastDiv by_chunks) {
    const int F = s.features, H = s.heads, C = F / V;
    const I total = static_cast<I>(s.num_edges * C);
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const I e = by_chunks.div(t);
        const int f = static_cast<int>(t - e * static_cast<I>(C)) * V;
        const int64_t n = idx[e];
        float acc[V] = {};
        if (!node_ok(n, s.num_nodes)) {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = NAN;
        } else {
            // the second term (w2, x2), if given, continues the same sum
            for (int term = 0; term < (w2 != nullptr ? 2 : 1); ++term) {
                const float* xr = (term ? x2 : x) + n * H * F + f;
                const float* wr = (term ? w2 : w) + static_cast<int64_t>(e) * H;
                for (int h = 0; h < H; ++h) {
                    const float wv = wr[h];
                    float xv[V];
                    load_vec<V>(xv, xr + h * F);
#pragma unroll
                    for (int j = 0; j < V; ++j) acc[j] = fmaf(wv, xv[j], acc[j]);
                }
            }
        }
        store_vec<V>(out + static_cast<int64_t>(e) * F + f, acc);
    }
}

// out[n, h, f] = sum over the edges e of node n of w[e, h] a[e, f].
// kLanes threads (adjacent lanes) share one output group, (node, up to
// kHeadsPerThread heads, V consecutive f): lane s takes the node's edges s,
// s + kLanes, ..., and the lanes' sums are added by shuffles in a fixed
// tree, so the result is the same every run. One thread per output walked a
// high-degree node's edges alone (4,204 edges on the 200k power-law graph:
// that tail set the kernel's time). a[e, f..f+V) is read once for the heads
// of a thread, w[e, h] once for its V features. kLanes is kSplit, or
// kSparseSplit where the nodes average fewer than kSparseDegree edges (a
// molecule batch's 2: six of eight lanes had no edge; ZINC x1024 on an
// H100, a layer step's two calls 0.0308 -> 0.0141 ms).
//
// Nodes of more than kHubDegree edges are left to the first hub_blocks
// blocks of the same grid, a whole block per node (scatter_hubs): eight lanes
// still walked a hub alone (github: 9,458 edges into one node, 1,182 steps
// per lane, 0.65 of the 1.49 ms of a layer step's kernels on an H100). The
// hub blocks come first in the grid, so they start first and run beside
// the rest.
constexpr int kHeadsPerThread = 4;
constexpr int kSplit = 8;
constexpr int kSparseSplit = 2;
constexpr int64_t kSparseDegree = 4;
constexpr int kUnroll = 4;
constexpr int64_t kHubDegree = 256;
// Hub blocks: enough that each scans at most one node per thread (the scan
// is cheap; a block's hubs run one after another, and 128 blocks for the
// thousands of hubs of the 200k power-law graph made the kernel slower
// than eight lanes per hub: 1.02 vs 0.85 ms on an H100), at most 4096.
constexpr int64_t kMaxHubBlocks = 4096;

// The output group (heads h0.., features f..f+V) of a thread: its running sum
// over edges order[k], k = first, first + step, ... < end, kUnroll edges per
// step (their indices, then their values, loaded independently: a step waits
// about two memory latencies, not 2 kUnroll). False at an edge id outside
// [0, E).
template <int V>
__device__ __forceinline__ bool sum_edges(float (&acc)[kHeadsPerThread][V], const float* __restrict__ w,
                                          const float* __restrict__ a, const int64_t* __restrict__ order,
                                          int64_t first, int64_t end, int64_t step, int f, int h0, int nh,
                                          const EdgeTermsShape& s) {
    const int F = s.features, H = s.heads;
    int64_t k = first;
    for (; k + (kUnroll - 1) * step < end; k += kUnroll * step) {
        int64_t e[kUnroll];
        bool ok = true;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            e[u] = order[k + u * step];
            ok &= node_ok(e[u], s.num_edges);
        }
        if (!ok) return false;
        float av[kUnroll][V], wv[kUnroll][kHeadsPerThread];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            load_vec<V>(av[u], a + e[u] * F + f);
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j) wv[u][j] = j < nh ? w[e[u] * H + h0 + j] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j)
#pragma unroll
                for (int c = 0; c < V; ++c) acc[j][c] = fmaf(wv[u][j], av[u][c], acc[j][c]);
    }
    for (; k < end; k += step) {
        const int64_t e = order[k];
        if (!node_ok(e, s.num_edges)) return false;
        float av[V];
        load_vec<V>(av, a + e * F + f);
#pragma unroll
        for (int j = 0; j < kHeadsPerThread; ++j) {
            const float wv = j < nh ? w[e * H + h0 + j] : 0.f;
#pragma unroll
            for (int c = 0; c < V; ++c) acc[j][c] = fmaf(wv, av[c], acc[j][c]);
        }
    }
    return true;
}

template <int V>
__device__ __forceinline__ void store_group(float* o, float (&acc)[kHeadsPerThread][V], int nh, int F, bool bad) {
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
        if (j >= nh) continue;
        if (bad) {
#pragma unroll
            for (int c = 0; c < V; ++c) acc[j][c] = NAN;
        }
        store_vec<V>(o + j * F, acc[j]);
    }
}

// A block's share of the hubs: nodes b, b + hub_blocks, ... of more than
// kHubDegree edges, one at a time, all threads on it. Thread t takes
// feature chunk t % C of the edges t / C, t / C + slots, ... (C threads read
// one edge's row of a, coalesced); the slots' sums are added in shared memory
// by a fixed tree.
template <int V>
__device__ void scatter_hubs(const float* __restrict__ w, const float* __restrict__ a,
                             const int64_t* __restrict__ rowptr, const int64_t* __restrict__ order,
                             float* __restrict__ out, const EdgeTermsShape& s, int hub_blocks) {
    __shared__ float red[kThreads][kHeadsPerThread][V];
    __shared__ int64_t hubs[kThreads];
    __shared__ int count;
    const int F = s.features, H = s.heads, C = F / V;     // C <= kThreads (run_edge_scatter)
    const int slots = kThreads / C, slot = threadIdx.x / C, f = (threadIdx.x % C) * V;
    const int64_t stride = static_cast<int64_t>(hub_blocks);
    for (int64_t first = blockIdx.x; first < s.num_nodes; first += stride * kThreads) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        const int64_t n = first + stride * threadIdx.x;
        if (n < s.num_nodes && rowptr[n + 1] - rowptr[n] > kHubDegree) hubs[atomicAdd(&count, 1)] = n;
        __syncthreads();
        const int found = count;     // the list's order varies; each hub's sum does not
        for (int i = 0; i < found; ++i) {
            const int64_t hub = hubs[i], begin = rowptr[hub], end = rowptr[hub + 1];
            for (int h0 = 0; h0 < H; h0 += kHeadsPerThread) {
                const int nh = H - h0 < kHeadsPerThread ? H - h0 : kHeadsPerThread;
                float acc[kHeadsPerThread][V] = {};
                bool ok = slot >= slots || sum_edges<V>(acc, w, a, order, begin + slot, end, slots, f, h0, nh, s);
#pragma unroll
                for (int j = 0; j < kHeadsPerThread; ++j)
#pragma unroll
                    for (int c = 0; c < V; ++c) red[threadIdx.x][j][c] = acc[j][c];
                const bool bad = __syncthreads_or(!ok);
                int span = 1;
                while (span < slots) span <<= 1;
                for (span >>= 1; span > 0; span >>= 1) {      // red[slot] += red[slot + span], a fixed tree
                    if (slot < span && slot + span < slots) {
#pragma unroll
                        for (int j = 0; j < kHeadsPerThread; ++j)
#pragma unroll
                            for (int c = 0; c < V; ++c) red[threadIdx.x][j][c] += red[threadIdx.x + span * C][j][c];
                    }
                    __syncthreads();
                }
                if (slot == 0) {
#pragma unroll
                    for (int j = 0; j < kHeadsPerThread; ++j)
#pragma unroll
                        for (int c = 0; c < V; ++c) acc[j][c] = red[threadIdx.x][j][c];
                    store_group<V>(out + (hub * H + h0) * F + f, acc, nh, F, bad);
                }
                __syncthreads();          // red is refilled next
            }
        }
        __syncthreads();                  // count and hubs are refilled next
    }
}

template <typename I, int V, int kLanes>
__global__ void __launch_bounds__(kThreads)
edge_scatter_kernel(const float* __restrict__ w, const float* __restrict__ a,
                    const int64_t* __restrict__ rowptr, const int64_t* __restrict__ order,
                    float* __restrict__ out, EdgeTermsShape s, FastDiv by_chunks, FastDiv by_groups,
                    int hub_blocks) {
    static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes: a power of 2 in a warp");
    if (static_cast<int>(blockIdx.x) < hub_blocks) {
        scatter_hubs<V>(w, a, rowptr, order, out, s, hub_blocks);
        return;
    }
    const int64_t hub_degree = hub_blocks > 0 ? kHubDegree : INT64_MAX;
    const int F = s.features, H = s.heads, C = F / V;
    const int groups = static_cast<int>(by_groups.d);
    const I total = static_cast<I>(s.num_nodes * groups * C * kLanes);   // a multiple of kLanes
    const int lane = threadIdx.x & 31;
    // this output's kLanes lanes
    const unsigned mask = static_cast<unsigned>((uint64_t(1) << kLanes) - 1) << (lane & ~(kLanes - 1));
    const I blocks = static_cast<I>(gridDim.x - hub_blocks);
    for (I t = (blockIdx.x - hub_blocks) * I(kThreads) + threadIdx.x; t < total; t += blocks * kThreads) {
        const int split = static_cast<int>(t % kLanes);
        const I ngc = t / kLanes;
        const I ng = by_chunks.div(ngc);
        const int f = static_cast<int>(ngc - ng * static_cast<I>(C)) * V;
        const int64_t n = by_groups.div(ng);
        const int h0 = static_cast<int>(ng - static_cast<I>(n) * static_cast<I>(groups)) * kHeadsPerThread;
        const int nh = H - h0 < kHeadsPerThread ? H - h0 : kHeadsPerThread;
        const int64_t begin = rowptr[n], end = rowptr[n + 1];
        if (end - begin > hub_degree) continue;       // a hub block's node (the kLanes lanes agree)
        float acc[kHeadsPerThread][V] = {};
        bool bad = !sum_edges<V>(acc, w, a, order, begin + split, end, kLanes, f, h0, nh, s);
#pragma unroll
        for (int off = 1; off < kLanes; off <<= 1) {
            bad |= __shfl_xor_sync(mask, static_cast<int>(bad), off, kLanes) != 0;
#pragma unroll
            for (int j = 0; j < kHeadsPerThread; ++j)
#pragma unroll
                for (int c = 0; c < V; ++c) acc[j][c] += __shfl_xor_sync(mask, acc[j][c], off, kLanes);
        }
        if (split == 0) store_group<V>(out + (n * H + h0) * F + f, acc, nh, F, bad);
    }
}

// P[e, h] = exp(scale s[e, h] + bias[e, h] - lse[idx[e], h]) (bias optional)
template <typename I>
__global__ void __launch_bounds__(kThreads)
edge_probs_kernel(const float* __restrict__ scores, const float* __restrict__ bias, const float* __restrict__ lse,
                  const int64_t* __restrict__ idx, float scale, float* __restrict__ out, EdgeTermsShape s,
                  FastDiv by_heads) {
    const I total = static_cast<I>(s.num_edges * s.heads);
    for (I t = blockIdx.x * I(kThreads) + threadIdx.x; t < total; t += I(gridDim.x) * kThreads) {
        const I e = by_heads.div(t);
        const int h = static_cast<int>(t - e * static_cast<I>(s.heads));
        const int64_t n = idx[e];
        if (!node_ok(n, s.num_nodes)) { out[t] = NAN; continue; }
        const float x = fmaf(scale, scores[t], bias != nullptr ? bias[t] : 0.f) - lse[n * s.heads + h];
        out[t] = expf(x);
    }
}

}  // namespace

cudaError_t run_edge_probs(const float* scores, const float* bias, const float* lse, const int64_t* idx, float scale,
                           float* out, const EdgeTermsShape& s, cudaStream_t stream) {
    const int64_t total = s.num_edges * s.heads;
    if (total == 0) return cudaSuccess;
    const dim3 grid(static_cast<unsigned>(blocks_for(total)));
    const FastDiv by_heads(s.heads);
    launch_instance(total, false, false, [&](auto index, auto, auto) {
        edge_probs_kernel<decltype(index)><<<grid, kThreads, 0, stream>>>(scores, bias, lse, idx, scale, out, s, by_heads);
    });
    return cudaGetLastError();
}

cudaError_t run_edge_dot(const float* x, const float* a, const int64_t* idx, float* out,
                         const EdgeTermsShape& s, cudaStream_t stream) {
    const int64_t total = s.num_edges * s.heads;
    if (total == 0) return cudaSuccess;
    const bool vec = s.features % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(a) % 16 == 0;
    // kDotHeads heads a thread where the edges alone fill the GPU a few
    // times over (H100: the 200k power-law graph's two calls of a layer step
    // 0.62 -> 0.47 ms, github's 0.062 -> 0.056), one where they do not (ZINC
    // x1024, 51k edges: 0.0105 ms with a head a thread, 0.0148 with four)
    const bool grouped = s.num_edges >= kDotGroupEdges;
    const FastDiv by_groups(grouped ? (s.heads + kDotHeads - 1) / kDotHeads : s.heads);
    const int64_t threads = s.num_edges * by_groups.d;
    const dim3 grid(static_cast<unsigned>(blocks_for(threads)));
    launch_instance(threads, vec, grouped, [&](auto index, auto v, auto head_groups) {
        constexpr int kHeads = decltype(head_groups)::value ? kDotHeads : 1;
        edge_dot_kernel<kHeads, decltype(v)::value, decltype(index)><<<grid, kThreads, 0, stream>>>(x, a, idx, out, s,
                                                                                                  by_groups);
    });
    return cudaGetLastError();
}

cudaError_t run_edge_rows(const float* w, const float* x, const float* w2, const float* x2, const int64_t* idx,
                          float* out, const EdgeTermsShape& s, cudaStream_t stream) {
    const bool vec = s.features % 4 == 0 && aligned16(x) && aligned16(out) && (x2 == nullptr || aligned16(x2));
    const int64_t total = s.num_edges * (vec ? s.features / 4 : s.features);
    if (total == 0) return cudaSuccess;
    const FastDiv by_chunks(vec ? s.features / 4 : s.features);
    const dim3 grid(static_cast<unsigned>(blocks_for(total)));
    launch_instance(total, vec, false, [&](auto index, auto v, auto) {
        edge_rows_kernel<decltype(index), decltype(v)::value ? 4 : 1><<<grid, kThreads, 0, stream>>>(
            w, x, w2, x2, idx, out, s, by_chunks);
    });
    return cudaGetLastError();
}

cudaError_t run_edge_scatter(const float* w, const float* a, const int64_t* rowptr,
                             const int64_t* order, float* out, const EdgeTermsShape& s,
                             cudaStream_t stream) {
    const bool vec = s.features % 4 == 0 && aligned16(a) && aligned16(out);
    const int64_t chunks = vec ? s.features / 4 : s.features;
    const int64_t groups = (s.heads + kHeadsPerThread - 1) / kHeadsPerThread;
    const bool sparse = s.num_edges < kSparseDegree * s.num_nodes;
    const int64_t total = s.num_nodes * groups * chunks * (sparse ? kSparseSplit : kSplit);
    if (total == 0) return cudaSuccess;
    const FastDiv by_chunks(chunks), by_groups(groups);
    // hub blocks (scatter_hubs) where a block's threads cover a row's chunks
    const int64_t want = (s.num_nodes + kThreads - 1) / kThreads;
    const int hub_blocks = chunks <= kThreads ? static_cast<int>(want < kMaxHubBlocks ? want : kMaxHubBlocks) : 0;
    const dim3 grid(static_cast<unsigned>(blocks_for(total) + hub_blocks));
    launch_instance(total, vec, sparse, [&](auto index, auto v, auto sparse_rows) {
        constexpr int kLanes = decltype(sparse_rows)::value ? kSparseSplit : kSplit;
        edge_scatter_kernel<decltype(index), decltype(v)::value ? 4 : 1, kLanes><<<grid, kThreads, 0, stream>>>(
            w, a, rowptr, order, out, s, by_chunks, by_groups, hub_blocks);
    });
    return cudaGetLastError();
}

}  // namespace gt_fused3s
