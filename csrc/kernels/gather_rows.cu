// out[i, :] = x[idx[i], :] (gather_rows.h): one thread per word of the
// output, consecutive threads on consecutive words of a row, so a warp reads
// whole rows (or several short ones) and writes contiguous memory.
#include "gather_rows.h"

#include <algorithm>
#include <cstring>

namespace gt_fused3s {
namespace {

template <typename W, bool kPow2>
__global__ void __launch_bounds__(256) gather_rows_kernel(const W* __restrict__ x, int64_t num_rows,
                                                          const int64_t* __restrict__ idx, int64_t n,
                                                          int64_t words, int shift, W* __restrict__ out) {
    const int64_t total = n * words;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
        const int64_t i = kPow2 ? (t >> shift) : t / words;   // a power-of-two row: no 64-bit division
        const int64_t c = t - i * words;
        const int64_t r = __ldg(idx + i);
        W w;
        if (r >= 0 && r < num_rows) {
            w = __ldg(x + r * words + c);
        } else {
            memset(&w, 0xff, sizeof(W));
        }
        out[t] = w;
    }
}

template <typename W>
cudaError_t launch(const void* x, int64_t num_rows, int64_t row_bytes, const int64_t* idx, int64_t n, void* out,
                   cudaStream_t stream) {
    const int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
    const int64_t total = n * words;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 132 * 64);
    const bool pow2 = (words & (words - 1)) == 0;
    int shift = 0;
    while ((int64_t(1) << shift) < words) ++shift;
    const W* xs = static_cast<const W*>(x);
    W* os = static_cast<W*>(out);
    if (pow2) {
        gather_rows_kernel<W, true><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(xs, num_rows, idx, n, words,
                                                                                          shift, os);
    } else {
        gather_rows_kernel<W, false><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(xs, num_rows, idx, n,
                                                                                           words, shift, os);
    }
    return cudaGetLastError();
}

}  // namespace

cudaError_t run_gather_rows(const void* x, int64_t num_rows, int64_t row_bytes, const int64_t* idx, int64_t n,
                            void* out, cudaStream_t stream) {
    if (n == 0 || row_bytes == 0) return cudaSuccess;
    // the widest word dividing the row and both pointers' alignment
    const uint64_t align = reinterpret_cast<uint64_t>(x) | reinterpret_cast<uint64_t>(out) |
                           static_cast<uint64_t>(row_bytes);
    if (align % 16 == 0) return launch<uint4>(x, num_rows, row_bytes, idx, n, out, stream);
    if (align % 8 == 0) return launch<uint2>(x, num_rows, row_bytes, idx, n, out, stream);
    if (align % 4 == 0) return launch<unsigned int>(x, num_rows, row_bytes, idx, n, out, stream);
    if (align % 2 == 0) return launch<unsigned short>(x, num_rows, row_bytes, idx, n, out, stream);
    return launch<unsigned char>(x, num_rows, row_bytes, idx, n, out, stream);
}

}  // namespace gt_fused3s
