// Where each edge sits in a BSB's non-zero order (gt_fused3s/graph.py:
// edge_slots, whose PyTorch version is the reference and the CPU path): the
// first non-zero of each TCB, the caller's edge id of each non-zero and its
// place among the mma fragments of its TCB pair. No torch header here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "build_scratch.h"

namespace gt_fused3s {

struct EdgeSlotsParams {
    EdgeIndexView edge_index;   // the graph the BSB was built from, in the caller's edge order
    const int32_t* rw_offset;   // [R + 1] first TCB of each window
    const int32_t* cols;        // [T * 8] column of each TCB slot, a window's ascending (-1: padding)
    const uint64_t* bitmap;     // [T, 2]
    const int32_t* nnz_offset;  // [T + 1] first non-zero of each TCB (run_tcb_counts, then a scan)
    int32_t* slot_edge;         // [E] out: the caller's edge id of each non-zero
    uint8_t* slot_pos;          // [E] out: 128 x + 4 lane + i (edge_bias.cuh)
    int64_t num_edges;
    int64_t num_nodes;
};

// counts[0] = 0, counts[t + 1] = set bits of TCB t: its inclusive scan is
// nnz_offset.
cudaError_t run_tcb_counts(const uint64_t* bitmap, int64_t num_tcbs, int32_t* counts, cudaStream_t stream);

// Scratch bytes run_edge_slots needs for E edges of an N-node graph.
size_t edge_slots_workspace_bytes(int64_t num_edges, int64_t num_nodes);

// slot_edge and slot_pos of every edge: the builder's key of each edge
// ((window, source), row in window; graph.py: _edge_keys), a stable radix
// sort of the keys with the edge ids, then one thread an edge: two binary
// searches, the copy's run start in the sorted keys and its column in the
// window's, then its bit's rank. An edge with an index outside [0, N) is
// skipped (its key sorts last; the BSB's build reports such an index).
cudaError_t run_edge_slots(const EdgeSlotsParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace gt_fused3s
