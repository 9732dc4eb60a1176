// Explicit instantiations of the fused 3S forward pass for head dim 16,
// without edge terms, with them, with them and attention dropout, and both
// of those writing each edge's score (one file per head dim so that the JIT
// build compiles them in parallel).
#include "fused3s_fwd_kernel.cuh"

namespace gt_fused3s {
template void run_fused3s_fwd<__half, 16, 0>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__half, 16, 1>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__half, 16, 2>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__half, 16, 3>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__half, 16, 4>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 16, 0>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 16, 1>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 16, 2>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 16, 3>(const Fused3SParams&, cudaStream_t);
template void run_fused3s_fwd<__nv_bfloat16, 16, 4>(const Fused3SParams&, cudaStream_t);
}  // namespace gt_fused3s
