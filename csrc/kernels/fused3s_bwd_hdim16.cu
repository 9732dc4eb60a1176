// Explicit instantiations of the fused 3S backward pass for head dim 16
// (one file per head dim so that the JIT build compiles them in parallel).
#include "fused3s_bwd_kernel.cuh"

namespace gt_fused3s {
template cudaError_t run_fused3s_bwd<__half, 16>(const Fused3SBwdParams&, const Fused3SBwdParams&, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 16>(const Fused3SBwdParams&, const Fused3SBwdParams&, cudaStream_t);
}  // namespace gt_fused3s
