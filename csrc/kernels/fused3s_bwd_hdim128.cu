// Explicit instantiations of the fused 3S backward pass for head dim 128,
// without edge terms, with them, and with them and attention dropout, the
// last two also with a dP bias (one file per head dim so that the JIT build
// compiles them in parallel).
#include "fused3s_bwd_kernel.cuh"

namespace gt_fused3s {
using Pass = const Fused3SBwdParams&;
template cudaError_t run_fused3s_bwd<__half, 128, 0>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 128, 1>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 128, 2>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 128, 3>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__half, 128, 4>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 128, 0>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 128, 1>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 128, 2>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 128, 3>(Pass, Pass, cudaStream_t);
template cudaError_t run_fused3s_bwd<__nv_bfloat16, 128, 4>(Pass, Pass, cudaStream_t);
}  // namespace gt_fused3s
