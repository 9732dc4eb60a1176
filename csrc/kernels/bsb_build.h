// GPU builder of the BSB format (gt_fused3s/graph.py documents the layout;
// the CPU builder there is the specification this one must equal exactly).
// No torch header: raw device pointers, sizes, a workspace, a stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

struct BsbBuildParams {
    // edge_index rows: sources and destinations, [E] each, int32 or int64,
    // element strides src_stride / dst_stride.
    const void* src_ptr;
    const void* dst_ptr;
    int64_t src_stride, dst_stride;
    bool index64;
    int64_t num_edges;    // E, duplicates included
    int32_t num_nodes;    // N
    int32_t num_windows;  // R = ceil(N / 16)
    // Capacity of cols / bitmap in TCBs. T <= E / 8 + R (each window's last
    // TCB is its only partial one), so max_tcbs = E / 8 + R + 1 always fits.
    int64_t max_tcbs;

    // Outputs (device). Only the first T TCBs of cols / bitmap and the first
    // E_u entries of edge_src / edge_dst are meaningful.
    int32_t* rw_offset_ptr;     // [R + 1]
    int32_t* cols_ptr;          // [max_tcbs * 8], -1 = padding
    uint64_t* bitmap_ptr;       // [max_tcbs * 2]
    int32_t* window_order_ptr;  // [R]
    int64_t* edge_src_ptr;      // [E] deduplicated edges, sorted by (window, source, row)
    int64_t* edge_dst_ptr;      // [E]
    // [5]: T, E_u, smallest and largest index seen in edge_index, largest
    // TCB count of a window (the kernel's schedule needs no split below it). The caller
    // copies them to the host once (the builder's only synchronisation) and
    // rejects the graph if an index was out of [0, N): then every other
    // output is unspecified (but nothing was written out of bounds).
    int64_t* counters_ptr;
};

// Scratch bytes run_bsb_build needs (radix sort, scans, per-window arrays).
size_t bsb_build_workspace_bytes(int64_t num_edges, int32_t num_nodes);

void run_bsb_build(const BsbBuildParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

}  // namespace gt_fused3s
