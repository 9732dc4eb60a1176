// What the plan's GPU builders (bsb_build.cu, edge_slots.cu, work_schedule.cu)
// share: the edges as they read them and their keys' values and sort width,
// scratch arrays carved out of one workspace, and an early return on a CUDA
// error. No torch header here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

// An edge_index [2, E] as the builders read it: its two rows, int32 or int64,
// with element strides (any layout of the caller's tensor).
struct EdgeIndexView {
    const void* src;
    const void* dst;
    int64_t src_stride, dst_stride;
    bool index64;
};

// The key of an edge with an index outside [0, N): all ones, above every
// valid key in the sort's bits (below), so it sorts last.
constexpr uint64_t kInvalidEdgeKey = ~0ull;

// Significant bits of the largest edge key ((window * N + source) * 16 + row
// in window: graph.py _edge_keys) of an N-node graph, so that a radix sort
// skips the zero ones.
inline int edge_key_bits(int64_t num_nodes) {
    const uint64_t windows = static_cast<uint64_t>((num_nodes + 15) / 16);
    const uint64_t max_key = windows * static_cast<uint64_t>(num_nodes) * 16;
    int bits = 1;
    while (bits < 64 && (max_key >> bits) != 0) ++bits;
    return bits;
}

#ifdef __CUDACC__
// The builders' key of edge (s, d) of an N-node graph: ((window * N + source)
// * 16 + row in window) (graph.py: _edge_keys), kInvalidEdgeKey for an index
// outside [0, N). Equal keys are copies of one edge.
__device__ __forceinline__ uint64_t edge_key(int64_t s, int64_t d, int64_t num_nodes) {
    const bool ok = s >= 0 && s < num_nodes && d >= 0 && d < num_nodes;
    return ok ? ((static_cast<uint64_t>(d >> 4) * static_cast<uint64_t>(num_nodes) + static_cast<uint64_t>(s)) << 4) |
                    static_cast<uint64_t>(d & 15)
              : kInvalidEdgeKey;
}

// Edge i's (source, destination) from the view (Idx: its rows' type).
template <typename Idx>
__device__ __forceinline__ void load_edge(const EdgeIndexView& e, int64_t i, int64_t& s, int64_t& d) {
    s = static_cast<int64_t>(static_cast<const Idx*>(e.src)[i * e.src_stride]);
    d = static_cast<int64_t>(static_cast<const Idx*>(e.dst)[i * e.dst_stride]);
}
#endif

// Offsets of scratch arrays in one workspace, each 256-byte aligned:
// `take(bytes)` returns the next one's offset, `bytes` is the total so far.
struct ScratchLayout {
    size_t bytes = 0;
    size_t take(size_t n) {
        const size_t at = bytes;
        bytes += (n + 255) & ~size_t(255);
        return at;
    }
};

}  // namespace gt_fused3s

#define GT_CUDA_RETURN_IF_ERROR(expr)              \
    do {                                           \
        const cudaError_t err_ = (expr);           \
        if (err_ != cudaSuccess) return err_;      \
    } while (0)
