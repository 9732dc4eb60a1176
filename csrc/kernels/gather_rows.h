// Rows of a tensor gathered by an index: out[i, :] = x[idx[i], :], any dtype
// (a row is `row_bytes` bytes, copied in the widest of 16/8/4/2/1-byte words
// that divides it and the pointers' alignment).
//
// Why a kernel of our own: torch 2.11's index_select (and gather, advanced
// indexing, embedding: one vectorized gather kernel) on CUDA takes a fixed
// ~0.6 ns per index for rows of 16 to 512 bytes on an H100 (0.6 ms per
// million rows, 4.1 ms for 6.9M), where this one runs at 2-3.5 TB/s
// (README: 13-55x on rows of 16-64 bytes, 3.3x on 256): the q, k, v of a
// reordered plan, the halo blocks of the partitioned attention. An index outside [0, num_rows) reads nothing and fills its
// row with 0xff bytes (NaN in a float type), as the edge kernels give NaN.
//
// No torch header: raw device pointers, a stream.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

cudaError_t run_gather_rows(const void* x, int64_t num_rows, int64_t row_bytes, const int64_t* idx, int64_t n,
                            void* out, cudaStream_t stream);

}  // namespace gt_fused3s
