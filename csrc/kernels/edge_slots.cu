// The edges' places in a BSB (edge_slots.h): what graph.py's edge_slots
// computes in about 140 PyTorch ops a format (one kernel launch each, which
// made it half of an eager plan build's host time): the keys, their sort
// and two kernels.
#include "edge_slots.h"

#include <algorithm>

#include <cub/cub.cuh>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;

// Where each scratch array lives inside the caller's workspace.
struct Layout {
    size_t keys_in, keys_out, ids_in, ids_out, temp, temp_bytes, total;
};

Layout make_layout(int64_t E, int64_t N) {
    size_t sort_bytes = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint64_t*>(nullptr),
                                    static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                    static_cast<int32_t*>(nullptr), E, 0, edge_key_bits(N));
    Layout l{};
    ScratchLayout c;
    l.keys_in = c.take(sizeof(uint64_t) * E);
    l.keys_out = c.take(sizeof(uint64_t) * E);
    l.ids_in = c.take(sizeof(int32_t) * E);
    l.ids_out = c.take(sizeof(int32_t) * E);
    l.temp_bytes = std::max(sort_bytes, size_t(1));
    l.temp = c.take(l.temp_bytes);
    l.total = c.bytes;
    return l;
}

// The builder's key of edge i (graph.py: _edge_keys) and its id.
template <typename Idx>
__global__ void edge_keys_kernel(const EdgeSlotsParams p, uint64_t* __restrict__ keys, int32_t* __restrict__ ids) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
    if (i >= p.num_edges) return;
    int64_t s, d;
    load_edge<Idx>(p.edge_index, i, s, d);
    keys[i] = edge_key(s, d, p.num_nodes);
    ids[i] = static_cast<int32_t>(i);
}

__global__ void tcb_counts_kernel(const uint64_t* __restrict__ bitmap, int64_t num_tcbs, int32_t* __restrict__ counts) {
    const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
    if (t == 0) counts[0] = 0;
    if (t < num_tcbs) counts[t + 1] = __popcll(bitmap[2 * t]) + __popcll(bitmap[2 * t + 1]);
}

__global__ void edge_slots_kernel(const EdgeSlotsParams p, const uint64_t* __restrict__ keys,
                                  const int32_t* __restrict__ ids) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
    if (i >= p.num_edges) return;
    const uint64_t k = keys[i];
    if (k == kInvalidEdgeKey) return;
    // copies of one edge (equal keys) take the pair's columns in order:
    // this one's copy number is its distance to the first of its run
    int64_t lo = 0, hi = i;
    while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if (keys[mid] < k) lo = mid + 1;
        else hi = mid;
    }
    const int64_t copy = i - lo;
    const int64_t pair = static_cast<int64_t>(k >> 4);  // window * N + source
    const int row_in = static_cast<int>(k & 15);
    const int64_t win = p.num_nodes ? pair / p.num_nodes : pair;
    const int64_t src = pair - win * p.num_nodes;
    // the pair's first column among the window's (ascending sources, -1
    // padding at the end counted as past every source)
    const int64_t base = 8 * static_cast<int64_t>(p.rw_offset[win]);
    int64_t a = base, b = 8 * static_cast<int64_t>(p.rw_offset[win + 1]);
    while (a < b) {
        const int64_t m = (a + b) >> 1;
        const int32_t c = p.cols[m];
        if (c >= 0 && c < src) a = m + 1;
        else b = m;
    }
    const int64_t rank = a - base + copy;              // column within the window
    const int64_t tcb = p.rw_offset[win] + (rank >> 3);
    const int word = row_in >> 3;
    const int bit = ((row_in & 7) << 3) | static_cast<int>(rank & 7);
    const uint64_t below = p.bitmap[2 * tcb + word] & ((uint64_t(1) << bit) - 1);
    const int64_t nnz = p.nnz_offset[tcb] + __popcll(below) + (word ? __popcll(p.bitmap[2 * tcb]) : 0);
    p.slot_edge[nnz] = ids[i];
    // TCB x = (rank / 8) % 2 of the window's pairs, lane bit / 2, element 2 word + bit % 2
    p.slot_pos[nnz] = static_cast<uint8_t>((((rank >> 3) & 1) << 7) | ((bit >> 1) << 2) | (word << 1) | (bit & 1));
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t run_tcb_counts(const uint64_t* bitmap, int64_t num_tcbs, int32_t* counts, cudaStream_t stream) {
    tcb_counts_kernel<<<blocks(num_tcbs + 1), kThreads, 0, stream>>>(bitmap, num_tcbs, counts);
    return cudaGetLastError();
}

size_t edge_slots_workspace_bytes(int64_t num_edges, int64_t num_nodes) {
    return make_layout(num_edges, num_nodes).total;
}

cudaError_t run_edge_slots(const EdgeSlotsParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    const int64_t E = p.num_edges;
    if (E == 0) return cudaSuccess;
    const Layout l = make_layout(E, p.num_nodes);
    if (workspace_bytes < l.total) return cudaErrorInvalidValue;
    auto* base = static_cast<char*>(workspace);
    auto* keys_in = reinterpret_cast<uint64_t*>(base + l.keys_in);
    auto* keys_out = reinterpret_cast<uint64_t*>(base + l.keys_out);
    auto* ids_in = reinterpret_cast<int32_t*>(base + l.ids_in);
    auto* ids_out = reinterpret_cast<int32_t*>(base + l.ids_out);
    if (p.edge_index.index64) edge_keys_kernel<int64_t><<<blocks(E), kThreads, 0, stream>>>(p, keys_in, ids_in);
    else edge_keys_kernel<int32_t><<<blocks(E), kThreads, 0, stream>>>(p, keys_in, ids_in);
    GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    // stable: copies of one edge keep the caller's order (as torch.sort(stable=True))
    size_t temp_bytes = l.temp_bytes;
    GT_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(base + l.temp, temp_bytes, keys_in, keys_out, ids_in,
                                                            ids_out, E, 0, edge_key_bits(p.num_nodes), stream));
    edge_slots_kernel<<<blocks(E), kThreads, 0, stream>>>(p, keys_out, ids_out);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
