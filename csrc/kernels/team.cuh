// The team of warps that runs one work item of the graph kernels
// (fused3s_fwd_kernel.cuh, fused3s_bwd_kernel.cuh): one warp, or kSplit
// warps each owning a slice of the head dim (D = 256); one team a block.
#pragma once

#include <cuda_runtime.h>

namespace gt_fused3s {

// Synchronise the team's warps (a warp alone: __syncwarp).
template <int kSplit>
__device__ __forceinline__ void team_sync() {
    if constexpr (kSplit > 1) __syncthreads();
    else __syncwarp();
}

// The leader's x to every thread of the team, through the block's shared
// `bcast` where the team has several warps.
template <int kSplit>
__device__ __forceinline__ int team_broadcast(int x, bool leader, int& bcast) {
    if constexpr (kSplit == 1) {
        return __shfl_sync(0xffffffffu, x, 0);
    } else {
        if (leader) bcast = x;
        __syncthreads();
        return bcast;
    }
}

}  // namespace gt_fused3s
