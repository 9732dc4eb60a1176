// Explicit instantiations of the sequence attention backward for head dim 32
// (one file per head dim: the JIT build compiles them in parallel).
#include "seq_bwd_kernel.cuh"

namespace gt_fused3s {
template void run_seq_bwd<__half, 32>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd<__nv_bfloat16, 32>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd_prep<__half, 32>(const SeqBwdPrepParams&, cudaStream_t);
template void run_seq_bwd_prep<__nv_bfloat16, 32>(const SeqBwdPrepParams&, cudaStream_t);
}  // namespace gt_fused3s
