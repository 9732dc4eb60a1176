// Explicit instantiations of the fused 3S backward pass for head dim 256,
// without and with an edge bias (one file per head dim so that the JIT build
// compiles them in parallel).
#include "fused3s_bwd_kernel.cuh"

namespace gt_fused3s {
using Pass = const Fused3SBwdParams&;
template cudaError_t run_fused3s_bwd<__half, 256, false>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 256, true>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 256, false>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 256, true>(Pass, Pass, cudaStream_t);
}  // namespace gt_fused3s
