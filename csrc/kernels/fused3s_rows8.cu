// Explicit instantiations of the 8-row kernels (rows8_params.h): forward and
// backward, fp16 and bf16, head dims 16 to 128.
#include "fused3s_bwd8_kernel.cuh"

namespace gt_fused3s {
#define GT_ROWS8_INSTANCES(T, D)                                              \
    template cudaError_t run_fused3s_fwd8<T, D>(const Fwd8Params&, cudaStream_t); \
    template cudaError_t run_fused3s_bwd8<T, D>(const Bwd8Params&, cudaStream_t);
GT_ROWS8_INSTANCES(__half, 16)
GT_ROWS8_INSTANCES(__half, 32)
GT_ROWS8_INSTANCES(__half, 64)
GT_ROWS8_INSTANCES(__half, 128)
GT_ROWS8_INSTANCES(__nv_bfloat16, 16)
GT_ROWS8_INSTANCES(__nv_bfloat16, 32)
GT_ROWS8_INSTANCES(__nv_bfloat16, 64)
GT_ROWS8_INSTANCES(__nv_bfloat16, 128)
#undef GT_ROWS8_INSTANCES
}  // namespace gt_fused3s
