// Explicit instantiations of the sequence attention backward for head dim 128
// (one file per head dim: the JIT build compiles them in parallel).
#include "seq_bwd_kernel.cuh"

namespace gt_fused3s {
template void run_seq_bwd<__half, 128>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd<__nv_bfloat16, 128>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd_prep<__half, 128>(const SeqBwdPrepParams&, cudaStream_t);
template void run_seq_bwd_prep<__nv_bfloat16, 128>(const SeqBwdPrepParams&, cudaStream_t);
}  // namespace gt_fused3s
