// Explicit instantiations of the sequence attention backward for head dim 64
// (one file per head dim: the JIT build compiles them in parallel).
#include "seq_bwd_kernel.cuh"
#include "seq_bwd_keys_kernel.cuh"
#include "seq_band_bwd.cuh"

namespace gt_fused3s {
template void run_seq_bwd<__half, 64>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd<__nv_bfloat16, 64>(const SeqBwdParams&, cudaStream_t);
template void run_seq_bwd_prep<__half, 64>(const SeqBwdPrepParams&, cudaStream_t);
template void run_seq_bwd_prep<__nv_bfloat16, 64>(const SeqBwdPrepParams&, cudaStream_t);
template void run_seq_bwd_keys<__half>(const SeqBwdKeysParams&, cudaStream_t);
template void run_seq_bwd_keys<__nv_bfloat16>(const SeqBwdKeysParams&, cudaStream_t);
template bool seq_bwd_keys_ready<__half>();
template bool seq_bwd_keys_ready<__nv_bfloat16>();
}  // namespace gt_fused3s
