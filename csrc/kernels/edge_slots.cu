// The edges' places in a BSB (edge_slots.h): what graph.py's edge_slots
// computes in about 130 PyTorch ops a format (one kernel launch each, which
// made it half of an eager plan build's host time), in two kernels.
#include "edge_slots.h"

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;

__global__ void tcb_counts_kernel(const uint64_t* __restrict__ bitmap, int64_t num_tcbs, int32_t* __restrict__ counts) {
    const int64_t t = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
    if (t == 0) counts[0] = 0;
    if (t < num_tcbs) counts[t + 1] = __popcll(bitmap[2 * t]) + __popcll(bitmap[2 * t + 1]);
}

__global__ void edge_slots_kernel(const EdgeSlotsParams p) {
    const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
    if (i >= p.num_edges) return;
    const int64_t k = p.key[i];
    // copies of one edge (equal keys) take the pair's columns in order:
    // this one's copy number is its distance to the first of its run
    int64_t lo = 0, hi = i;
    while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if (p.key[mid] < k) lo = mid + 1;
        else hi = mid;
    }
    const int64_t copy = i - lo;
    const int64_t pair = k >> 4;                       // window * N + source
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
    p.slot_edge[nnz] = static_cast<int32_t>(p.order[i]);
    // TCB x = (rank / 8) % 2 of the window's pairs, lane bit / 2, element 2 word + bit % 2
    p.slot_pos[nnz] = static_cast<uint8_t>((((rank >> 3) & 1) << 7) | ((bit >> 1) << 2) | (word << 1) | (bit & 1));
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t run_tcb_counts(const uint64_t* bitmap, int64_t num_tcbs, int32_t* counts, cudaStream_t stream) {
    tcb_counts_kernel<<<blocks(num_tcbs + 1), kThreads, 0, stream>>>(bitmap, num_tcbs, counts);
    return cudaGetLastError();
}

cudaError_t run_edge_slots(const EdgeSlotsParams& p, cudaStream_t stream) {
    if (p.num_edges == 0) return cudaSuccess;
    edge_slots_kernel<<<blocks(p.num_edges), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
