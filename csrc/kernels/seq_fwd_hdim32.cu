// Explicit instantiations of the sequence attention forward for head dim 32
// (one file per head dim: the JIT build compiles them in parallel).
#include "seq_fwd_kernel.cuh"

namespace gt_fused3s {
template void run_seq_fwd<__half, 32>(const SeqFwdParams&, cudaStream_t);
template void run_seq_fwd<__nv_bfloat16, 32>(const SeqFwdParams&, cudaStream_t);
}  // namespace gt_fused3s
