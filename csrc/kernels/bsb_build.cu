// GPU builder of the BSB format: one radix sort of 64-bit keys, three scans,
// a few element-wise kernels, a per-window scan and a sort of the windows by
// work. The same algorithm as BSBGraph._build in gt_fused3s/graph.py:
//
//   key = ((window * N + source) * 16 + row_in_window)     sorted, so that
//   equal keys are copies of one edge (copy c = rank among them) and equal
//   key >> 4 is one (window, source) pair. A pair has as many columns as its
//   most repeated edge: column (pair, c) holds copy c of each of its edges,
//   so every edge is its own term. A column's rank within its window is its
//   compacted column index, rank / 8 its TCB, rank % 8 its column in the TCB.
//
// Nothing here synchronises with the host: the outputs are sized from E and
// N (at capacity), the counts the caller may want are left in `counters`.
#include "bsb_build.h"

#include <algorithm>

#include <cub/cub.cuh>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
    int64_t b = (n + kThreads - 1) / kThreads;
    return static_cast<int>(b < 65535 * 32 ? (b > 0 ? b : 1) : 65535 * 32);
}

struct MaxOp {
    __device__ __forceinline__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

// Where each scratch array lives inside the caller's workspace.
struct Layout {
    size_t keys_a, keys_b, incl;                      // [E] uint64 each
    size_t run_first_in, run_first;                   // [E] int32: index of the first copy of each key
    size_t pair_cols, col_base;                       // [E + 1] int32: columns of each pair, their scan
    size_t first_pair, end_pair, tcb_count, iota, counts_sorted;  // per window
    size_t temp;
    size_t temp_bytes;
    size_t total;
};

Layout make_layout(int64_t E, int32_t N) {
    const int64_t R = (static_cast<int64_t>(N) + 15) / 16;
    const int bits = edge_key_bits(N);
    size_t sort_bytes = 0, scan_bytes = 0, max_bytes = 0, cscan_bytes = 0, wscan_bytes = 0, wsort_bytes = 0;
    cub::DeviceRadixSort::SortKeys(nullptr, sort_bytes, static_cast<const uint64_t*>(nullptr),
                                   static_cast<uint64_t*>(nullptr), E, 0, bits);
    cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, static_cast<const uint64_t*>(nullptr),
                                  static_cast<uint64_t*>(nullptr), E);
    cub::DeviceScan::InclusiveScan(nullptr, max_bytes, static_cast<const int32_t*>(nullptr),
                                   static_cast<int32_t*>(nullptr), MaxOp{}, E);
    cub::DeviceScan::ExclusiveSum(nullptr, cscan_bytes, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), E + 1);
    cub::DeviceScan::ExclusiveSum(nullptr, wscan_bytes, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), R + 1);
    cub::DeviceRadixSort::SortPairsDescending(nullptr, wsort_bytes, static_cast<const int32_t*>(nullptr),
                                              static_cast<int32_t*>(nullptr),
                                              static_cast<const int32_t*>(nullptr),
                                              static_cast<int32_t*>(nullptr), R);
    Layout l{};
    ScratchLayout c;
    l.keys_a = c.take(sizeof(uint64_t) * E);
    l.keys_b = c.take(sizeof(uint64_t) * E);
    l.incl = c.take(sizeof(uint64_t) * E);
    l.run_first_in = c.take(sizeof(int32_t) * E);
    l.run_first = c.take(sizeof(int32_t) * E);
    l.pair_cols = c.take(sizeof(int32_t) * (E + 1));
    l.col_base = c.take(sizeof(int32_t) * (E + 1));
    l.first_pair = c.take(sizeof(int32_t) * R);
    l.end_pair = c.take(sizeof(int32_t) * R);
    l.tcb_count = c.take(sizeof(int32_t) * (R + 1));
    l.iota = c.take(sizeof(int32_t) * R);
    l.counts_sorted = c.take(sizeof(int32_t) * R);
    l.temp_bytes = std::max({sort_bytes, scan_bytes, max_bytes, cscan_bytes, wscan_bytes, wsort_bytes});
    l.temp = c.take(l.temp_bytes);
    l.total = c.bytes;
    return l;
}

__global__ void init_counters(int64_t* counters) {
    counters[0] = 0;
    counters[1] = 0;
    counters[2] = INT64_MAX;   // smallest index seen
    counters[3] = INT64_MIN;   // largest index seen
    counters[4] = 0;
}

// keys[i] of edge i, and the range of all indices (for the caller's check).
template <typename Idx>
__global__ void make_keys(const EdgeIndexView e, int64_t E, int32_t N, uint64_t* __restrict__ keys,
                          int64_t* __restrict__ counters) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
        int64_t s, d;
        load_edge<Idx>(e, i, s, d);
        lo = min(lo, min(s, d));
        hi = max(hi, max(s, d));
        keys[i] = edge_key(s, d, N);
    }
    // warp reduction, then one atomic per warp
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMin(reinterpret_cast<long long*>(counters + 2), static_cast<long long>(lo));
        atomicMax(reinterpret_cast<long long*>(counters + 3), static_cast<long long>(hi));
    }
}

// flags[i] = (is first copy of its key) << 32 | (is first key of its pair);
// an inclusive scan of these packs two running counts in one 64-bit word.
// run_first[i] = i at the first copy of a key, else 0 (a max-scan of it gives
// the index of each key's first copy).
__global__ void mark_firsts(const uint64_t* __restrict__ keys, int64_t E, uint64_t* __restrict__ flags,
                            int32_t* __restrict__ run_first) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
        const uint64_t k = keys[i];
        const bool uniq = i == 0 || k != keys[i - 1];
        const bool new_pair = uniq && (i == 0 || (k >> 4) != (keys[i - 1] >> 4));
        flags[i] = (static_cast<uint64_t>(uniq) << 32) | static_cast<uint64_t>(new_pair);
        run_first[i] = uniq ? static_cast<int32_t>(i) : 0;
    }
}

__device__ __forceinline__ int32_t pair_count(uint64_t incl) { return static_cast<int32_t>(incl & 0xffffffffu); }
__device__ __forceinline__ int64_t edge_count(uint64_t incl) { return static_cast<int64_t>(incl >> 32); }

// pair_cols[pair] = 1 + the largest copy number among its keys.
__global__ void pair_columns(const uint64_t* __restrict__ keys, const uint64_t* __restrict__ incl,
                             const int32_t* __restrict__ run_first, int64_t E, uint64_t num_pairs_total,
                             int32_t* __restrict__ pair_cols) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
        if ((keys[i] >> 4) >= num_pairs_total) continue;   // invalid edge (sorted last)
        const int32_t copy = static_cast<int32_t>(i) - run_first[i];
        atomicMax(pair_cols + pair_count(incl[i]) - 1, copy + 1);
    }
}

// For each window: the id of its first pair and one past its last pair, read
// at the window's first and last key (keys of one window are contiguous).
__global__ void window_bounds(const uint64_t* __restrict__ keys, const uint64_t* __restrict__ incl, int64_t E,
                              int32_t N, uint64_t num_pairs_total, int32_t* __restrict__ first_pair,
                              int32_t* __restrict__ end_pair) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
        const uint64_t pair = keys[i] >> 4;
        if (pair >= num_pairs_total) continue;             // invalid edge (sorted last)
        const uint64_t w = pair / N;
        if (i == 0 || (keys[i - 1] >> 4) / N != w) first_pair[w] = pair_count(incl[i]) - 1;
        if (i == E - 1 || (keys[i + 1] >> 4) / N != w) end_pair[w] = pair_count(incl[i]);
    }
}

// tcb_count[w] = ceil(columns / 8) (tcb_count[R] = 0, so that an exclusive
// scan of R + 1 entries ends with T), iota for the sort of windows by work.
__global__ void window_tcbs(const int32_t* __restrict__ first_pair, const int32_t* __restrict__ end_pair,
                            const int32_t* __restrict__ col_base, int32_t R, int32_t* __restrict__ tcb_count,
                            int32_t* __restrict__ iota) {
    const int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (w < R) {
        tcb_count[w] = (col_base[end_pair[w]] - col_base[first_pair[w]] + 7) / 8;
        iota[w] = static_cast<int32_t>(w);
    } else if (w == R) {
        tcb_count[R] = 0;
    }
}

// One thread per key: each copy of an edge sets its bit in its column, the
// column's source id is written (the same value by every key of the
// column), and the edge is listed.
__global__ void fill_blocks(const uint64_t* __restrict__ keys, const uint64_t* __restrict__ incl,
                            const int32_t* __restrict__ run_first, const int32_t* __restrict__ col_base,
                            int64_t E, int32_t N, uint64_t num_pairs_total, const int32_t* __restrict__ first_pair,
                            const int32_t* __restrict__ rw_offset, int32_t* __restrict__ cols,
                            unsigned long long* __restrict__ bitmap, int64_t* __restrict__ edge_src,
                            int64_t* __restrict__ edge_dst) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
        const uint64_t k = keys[i];
        const uint64_t pair = k >> 4;
        if (pair >= num_pairs_total) continue;
        const int64_t w = static_cast<int64_t>(pair / N);
        const int64_t s = static_cast<int64_t>(pair - static_cast<uint64_t>(w) * N);
        const int32_t row_in = static_cast<int32_t>(k & 15);
        const int32_t copy = static_cast<int32_t>(i) - run_first[i];
        const int32_t rank = col_base[pair_count(incl[i]) - 1] + copy - col_base[first_pair[w]];
        const int64_t tcb = rw_offset[w] + (rank >> 3);
        const int32_t col = rank & 7;
        cols[tcb * 8 + col] = static_cast<int32_t>(s);
        atomicOr(bitmap + tcb * 2 + (row_in >> 3), 1ull << (((row_in & 7) << 3) | col));
        edge_src[i] = s;
        edge_dst[i] = w * 16 + row_in;
    }
}

__global__ void finish_counters(const int32_t* __restrict__ rw_offset, int32_t R,
                                const uint64_t* __restrict__ incl, int64_t E,
                                const int32_t* __restrict__ counts_sorted, int64_t* __restrict__ counters) {
    counters[0] = rw_offset[R];
    counters[1] = E > 0 ? edge_count(incl[E - 1]) : 0;
    if (E == 0) counters[2] = counters[3] = 0;    // no index seen: an empty range, as the CPU builder says
    counters[4] = R > 0 ? counts_sorted[0] : 0;   // windows sorted by decreasing TCB count
}

}  // namespace

size_t bsb_build_workspace_bytes(int64_t num_edges, int32_t num_nodes) {
    return make_layout(num_edges, num_nodes).total;
}

cudaError_t run_bsb_build(const BsbBuildParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    const int64_t E = p.num_edges;
    const int32_t N = p.num_nodes, R = p.num_windows;
    const Layout l = make_layout(E, N);
    if (workspace_bytes < l.total) return cudaErrorInvalidValue;
    auto* base = static_cast<char*>(workspace);
    auto* keys_a = reinterpret_cast<uint64_t*>(base + l.keys_a);
    auto* keys_b = reinterpret_cast<uint64_t*>(base + l.keys_b);
    auto* incl = reinterpret_cast<uint64_t*>(base + l.incl);
    auto* run_first_in = reinterpret_cast<int32_t*>(base + l.run_first_in);
    auto* run_first = reinterpret_cast<int32_t*>(base + l.run_first);
    auto* pair_cols = reinterpret_cast<int32_t*>(base + l.pair_cols);
    auto* col_base = reinterpret_cast<int32_t*>(base + l.col_base);
    auto* first_pair = reinterpret_cast<int32_t*>(base + l.first_pair);
    auto* end_pair = reinterpret_cast<int32_t*>(base + l.end_pair);
    auto* tcb_count = reinterpret_cast<int32_t*>(base + l.tcb_count);
    auto* iota = reinterpret_cast<int32_t*>(base + l.iota);
    auto* counts_sorted = reinterpret_cast<int32_t*>(base + l.counts_sorted);
    void* temp = base + l.temp;
    size_t temp_bytes = l.temp_bytes;
    const uint64_t num_pairs_total = static_cast<uint64_t>(R) * static_cast<uint64_t>(N);

    init_counters<<<1, 1, 0, stream>>>(p.counters_ptr);
    GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.cols_ptr, 0xff, sizeof(int32_t) * 8 * p.max_tcbs, stream));  // -1
    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.bitmap_ptr, 0, sizeof(uint64_t) * 2 * p.max_tcbs, stream));
    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(first_pair, 0, sizeof(int32_t) * R, stream));  // empty windows
    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(end_pair, 0, sizeof(int32_t) * R, stream));
    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(pair_cols, 0, sizeof(int32_t) * (E + 1), stream));
    if (E > 0) {
        if (p.edge_index.index64)
            make_keys<int64_t><<<blocks_for(E), kThreads, 0, stream>>>(p.edge_index, E, N, keys_a, p.counters_ptr);
        else
            make_keys<int32_t><<<blocks_for(E), kThreads, 0, stream>>>(p.edge_index, E, N, keys_a, p.counters_ptr);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        // Invalid keys have all their low bits set: they sort last.
        GT_CUDA_RETURN_IF_ERROR(
            cub::DeviceRadixSort::SortKeys(temp, temp_bytes, keys_a, keys_b, E, 0, edge_key_bits(N), stream));
        mark_firsts<<<blocks_for(E), kThreads, 0, stream>>>(keys_b, E, keys_a, run_first_in);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        temp_bytes = l.temp_bytes;
        GT_CUDA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveSum(temp, temp_bytes, keys_a, incl, E, stream));
        temp_bytes = l.temp_bytes;
        GT_CUDA_RETURN_IF_ERROR(
            cub::DeviceScan::InclusiveScan(temp, temp_bytes, run_first_in, run_first, MaxOp{}, E, stream));
        pair_columns<<<blocks_for(E), kThreads, 0, stream>>>(keys_b, incl, run_first, E, num_pairs_total,
                                                             pair_cols);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        window_bounds<<<blocks_for(E), kThreads, 0, stream>>>(keys_b, incl, E, N, num_pairs_total, first_pair,
                                                              end_pair);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    // col_base[p] = first column of pair p (E + 1 entries: pairs past the last have 0 columns)
    temp_bytes = l.temp_bytes;
    GT_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, pair_cols, col_base, E + 1, stream));
    if (R > 0) {
        window_tcbs<<<blocks_for(R + 1), kThreads, 0, stream>>>(first_pair, end_pair, col_base, R, tcb_count, iota);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
        temp_bytes = l.temp_bytes;
        GT_CUDA_RETURN_IF_ERROR(
            cub::DeviceScan::ExclusiveSum(temp, temp_bytes, tcb_count, p.rw_offset_ptr, R + 1, stream));
        // Stable: windows with equal work keep ascending order (as torch.sort(stable=True)).
        temp_bytes = l.temp_bytes;
        GT_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(
            temp, temp_bytes, tcb_count, counts_sorted, iota, p.window_order_ptr, R, 0, 32, stream));
    } else {
        GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.rw_offset_ptr, 0, sizeof(int32_t), stream));
    }
    if (E > 0) {
        fill_blocks<<<blocks_for(E), kThreads, 0, stream>>>(
            keys_b, incl, run_first, col_base, E, N, num_pairs_total, first_pair, p.rw_offset_ptr, p.cols_ptr,
            reinterpret_cast<unsigned long long*>(p.bitmap_ptr), p.edge_src_ptr, p.edge_dst_ptr);
        GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    finish_counters<<<1, 1, 0, stream>>>(p.rw_offset_ptr, R, incl, E, counts_sorted, p.counters_ptr);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
