// Where each edge sits in a BSB's non-zero order (gt_fused3s/graph.py:
// edge_slots, whose PyTorch version is the reference and the CPU path): the
// first non-zero of each TCB, the caller's edge id of each non-zero and its
// place among the mma fragments of its TCB pair. No torch header here.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace gt_fused3s {

struct EdgeSlotsParams {
    const int64_t* key;         // [E] the builder's keys ((window, source), row), sorted (graph.py: _edge_keys)
    const int64_t* order;       // [E] the caller's edge id of each sorted key
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
// slot_edge and slot_pos of every edge (one thread an edge: two binary
// searches, the copy's run start in the sorted keys and its column in the
// window's, then its bit's rank).
cudaError_t run_edge_slots(const EdgeSlotsParams& p, cudaStream_t stream);

}  // namespace gt_fused3s
