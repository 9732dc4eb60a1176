// The fused kernels' work schedule on the GPU (gt_fused3s/schedule.py: the
// PyTorch version there is the specification and the CPU path): chunks of
// consecutive TCBs of one window, heaviest first, and the slots of the
// windows split into several chunks. No torch header here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

struct WorkScheduleParams {
    const int32_t* rw_offset;     // [R + 1] first TCB of each window
    const int32_t* window_order;  // [R] windows by decreasing TCB count
    int32_t num_windows;          // R
    int32_t chunk;                // C: a split window's chunks hold at most C TCBs (even)
    int32_t threshold;            // windows of more TCBs than this are split (>= C)
    int32_t num_items;            // I: rows of items (the capacity; unused rows: window -1)
    int32_t num_slots;            // S: rows of slots
    int32_t* items;               // [I, 4] out: (window, tcb_begin, tcb_end, slot or -1), heaviest first
    int32_t* slots;               // [S, 4] out: (window, first slot, end slot, 0) per slot, 0 past the used
    int64_t* counts;              // [2] out: items and slots used
};

// Scratch bytes run_work_schedule needs for R windows and I items.
size_t work_schedule_workspace_bytes(int32_t num_windows, int32_t num_items);

// Enqueues the schedule on `stream` (no synchronisation); returns the first
// launch error.
cudaError_t run_work_schedule(const WorkScheduleParams& p, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

}  // namespace gt_fused3s
