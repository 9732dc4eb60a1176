// Explicit instantiations of the fused 3S forward pass for head dim 32,
// without and with an edge bias (one file per head dim so that the JIT build
// compiles them in parallel).
#include "fused3s_fwd_kernel.cuh"

namespace gt_fused3s {
template void run_fused3s_fwd<__half, 32, false>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__half, 32, true>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 32, false>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 32, true>(const Fused3SParams&, cudaStream_t);
}  // namespace gt_fused3s
