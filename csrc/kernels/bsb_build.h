// GPU builder of the BSB format (gt_fused3s/graph.py documents the layout;
// the CPU builder there is the specification this one must equal exactly).
// No torch header: raw device pointers, sizes, a workspace, a stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

#include "build_scratch.h"

namespace gt_fused3s {

struct BsbBuildParams {
    EdgeIndexView edge_index;   // sources and destinations, [E] each
    int64_t num_edges;    // E, duplicates included
    int32_t num_nodes;    // N
    int32_t num_windows;  // R = ceil(N / 16)
    // Capacity of cols / bitmap in TCBs. A window of e edges has at most e
    // columns and its last TCB is its only partial one, so T <= E / 8 + R and
    // max_tcbs = E / 8 + R + 1 always fits.
    int64_t max_tcbs;

    // Outputs (device). cols / bitmap beyond the first T TCBs are padding
    // (-1 / 0). Every edge is kept (a duplicate is a column of its own).
    int32_t* rw_offset_ptr;     // [R + 1]
    int32_t* cols_ptr;          // [max_tcbs * 8], -1 = padding
    uint64_t* bitmap_ptr;       // [max_tcbs * 2]
    int32_t* window_order_ptr;  // [R]
    int64_t* edge_src_ptr;      // [E] the edges, sorted by (window, source, row)
    int64_t* edge_dst_ptr;      // [E]
    // [5]: T, number of distinct edges, smallest and largest index seen in
    // edge_index, largest TCB count of a window. If an index was outside
    // [0, N), every other output is unspecified (but nothing was written out
    // of bounds): the caller checks counters[2..3] (on the host, or with a
    // device-side assertion) before using the format.
    int64_t* counters_ptr;
};

// Scratch bytes run_bsb_build needs (radix sort, scans, per-window arrays).
size_t bsb_build_workspace_bytes(int64_t num_edges, int32_t num_nodes);

// Enqueues the build on `stream` (no synchronisation); returns the first
// launch error.
cudaError_t run_bsb_build(const BsbBuildParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace gt_fused3s
