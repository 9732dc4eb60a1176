// Explicit instantiations of the fused 3S backward pass for head dim 32,
// without edge terms, with them, and with them and attention dropout, the
// last two also with a dP bias (one file per head dim so that the JIT build
// compiles them in parallel).
#include "fused3s_bwd_kernel.cuh"

namespace gt_fused3s {
using Pass = const Fused3SBwdParams&;
template cudaError_t run_fused3s_bwd<__half, 32, 0>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 32, 1>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 32, 2>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 32, 3>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 32, 4>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 32, 0>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 32, 1>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 32, 2>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 32, 3>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 32, 4>(Pass, Pass, cudaStream_t);
}  // namespace gt_fused3s
