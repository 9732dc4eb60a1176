// The per-head products of head_project.h: CUDA-core kernels, fp32
// accumulation in a fixed order.
#include "head_project.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;   // grid-stride beyond
constexpr int kOuterBlocks = 528;                   // 4 per SM of an H100: the outer sums' target grid
constexpr int64_t kMaxPartials = int64_t(1) << 22;  // floats of the outer sums' chunk partials (16 MB)
constexpr int kTileFloats = 8192;                   // the outer sums' shared row tile (32 KB)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One output per thread: the dot product of x's row (A entries of a head)
// with a row (transposed) or a column of w[h]; threads of one (n, h) read
// the same x entries (one broadcast load) and neighbouring w entries.
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads)
head_project_kernel(const T* __restrict__ x, const float* __restrict__ w, float scale, float* __restrict__ out,
                    int64_t rows, int heads, int c, int f) {
    const int A = kTransposed ? f : c, B = kTransposed ? c : f;
    const int64_t total = rows * heads * B;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t nh = i / B;
        const int b = static_cast<int>(i - nh * B), h = static_cast<int>(nh % heads);
        const T* xr = x + nh * A;
        const float* wh = w + int64_t(h) * c * f;
        float acc = 0.f;
        if constexpr (kTransposed) {   // out[n, h, c = b] = sum_f x[n, h, f] w[h, b, f]
            const float* wr = wh + int64_t(b) * f;
            for (int a = 0; a < A; ++a) acc = fmaf(to_float(xr[a]), wr[a], acc);
        } else {                       // out[n, h, f = b] = sum_c x[n, h, c] w[h, c, b]
            for (int a = 0; a < A; ++a) acc = fmaf(to_float(xr[a]), wh[int64_t(a) * f + b], acc);
        }
        out[i] = acc * scale;
    }
}

// Rows [n0, n1) of x (head h, width `width`, row stride heads * width) into
// the shared tile [tile_rows, width] as floats; zero past n1.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* __restrict__ x, int64_t n0, int64_t n1, int tile_rows,
                                          int heads, int h, int width) {
    for (int idx = threadIdx.x; idx < tile_rows * width; idx += blockDim.x) {
        const int r = idx / width, k = idx - r * width;
        const int64_t n = n0 + r;
        dst[idx] = n < n1 ? to_float(x[(n * heads + h) * width + k]) : 0.f;
    }
}

// Block (chunk, h, pair group): each thread one (c, f) pair of the group,
// summed over the chunk's rows, which pass through shared memory a tile at
// a time (both terms' x and y rows).
template <typename T>
__global__ void __launch_bounds__(kThreads)
head_outer_sum_kernel(const T* __restrict__ x1, const float* __restrict__ y1, float s1, const T* __restrict__ x2,
                      const float* __restrict__ y2, float s2, float* __restrict__ partials, int64_t rows,
                      int64_t rows_per_chunk, int tile_rows, int heads, int c, int f) {
    extern __shared__ float tile[];
    const int terms = x2 != nullptr ? 2 : 1;
    float* xs = tile;                             // [terms][tile_rows][c]
    float* ys = tile + terms * tile_rows * c;     // [terms][tile_rows][f]
    const int64_t chunk = blockIdx.x;
    const int h = blockIdx.y;
    const int p = blockIdx.z * blockDim.x + threadIdx.x;
    const bool owns = p < c * f;
    const int pc = owns ? p / f : 0, pf = owns ? p - pc * f : 0;
    const int64_t first = chunk * rows_per_chunk;
    const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    float acc1 = 0.f, acc2 = 0.f;
    for (int64_t n0 = first; n0 < last; n0 += tile_rows) {
        __syncthreads();   // the previous tile is read
        load_tile(xs, x1, n0, last, tile_rows, heads, h, c);
        load_tile(ys, y1, n0, last, tile_rows, heads, h, f);
        if (terms == 2) {
            load_tile(xs + tile_rows * c, x2, n0, last, tile_rows, heads, h, c);
            load_tile(ys + tile_rows * f, y2, n0, last, tile_rows, heads, h, f);
        }
        __syncthreads();
        if (owns) {
            for (int r = 0; r < tile_rows; ++r) acc1 = fmaf(xs[r * c + pc], ys[r * f + pf], acc1);
            if (terms == 2) {
                const float* xs2 = xs + tile_rows * c;
                const float* ys2 = ys + tile_rows * f;
                for (int r = 0; r < tile_rows; ++r) acc2 = fmaf(xs2[r * c + pc], ys2[r * f + pf], acc2);
            }
        }
    }
    if (owns) partials[((chunk * heads + h) * c + pc) * f + pf] = s1 * acc1 + (terms == 2 ? s2 * acc2 : 0.f);
}

int pair_groups(const HeadShape& s) { return (s.c * s.f + kThreads - 1) / kThreads; }

int tile_rows_for(const HeadShape& s, int terms) {
    const int r = kTileFloats / (terms * (s.c + s.f));
    return r < 1 ? 1 : (r > 64 ? 64 : r);
}

template <typename T>
cudaError_t launch_project(const T* x, const float* w, float scale, bool transposed, float* out, const HeadShape& s,
                           cudaStream_t stream) {
    const int64_t total = s.rows * s.heads * (transposed ? s.c : s.f);
    if (total == 0) return cudaSuccess;
    int64_t blocks = (total + kThreads - 1) / kThreads;
    blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
    if (transposed) {
        head_project_kernel<T, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, w, scale, out, s.rows,
                                                                                          s.heads, s.c, s.f);
    } else {
        head_project_kernel<T, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, w, scale, out, s.rows,
                                                                                           s.heads, s.c, s.f);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_outer_sum(const T* x1, const float* y1, float s1, const T* x2, const float* y2, float s2,
                             float* partials, int64_t chunks, const HeadShape& s, cudaStream_t stream) {
    const int terms = x2 != nullptr ? 2 : 1;
    const int tile = tile_rows_for(s, terms);
    const size_t smem = sizeof(float) * size_t(terms) * size_t(tile) * size_t(s.c + s.f);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;   // C + F beyond what the binding allows
    const int64_t per_chunk = (s.rows + chunks - 1) / chunks;
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(s.heads),
                    static_cast<unsigned>(pair_groups(s)));
    head_outer_sum_kernel<T><<<grid, kThreads, smem, stream>>>(x1, y1, s1, x2, y2, s2, partials, s.rows,
                                                               per_chunk > 0 ? per_chunk : 1, tile, s.heads, s.c, s.f);
    return cudaGetLastError();
}

}  // namespace

cudaError_t run_head_project(const void* x, RowDtype x_dtype, const float* w, float scale, bool transposed,
                             float* out, const HeadShape& s, cudaStream_t stream) {
    switch (x_dtype) {
        case RowDtype::kF16:
            return launch_project(static_cast<const __half*>(x), w, scale, transposed, out, s, stream);
        case RowDtype::kBF16:
            return launch_project(static_cast<const __nv_bfloat16*>(x), w, scale, transposed, out, s, stream);
        default:
            return launch_project(static_cast<const float*>(x), w, scale, transposed, out, s, stream);
    }
}

int64_t head_outer_sum_chunks(const HeadShape& s) {
    const int64_t per_chunk_grid = int64_t(s.heads) * pair_groups(s);
    int64_t chunks = (s.rows + 63) / 64;                       // at least 64 rows a chunk
    const int64_t fill = kOuterBlocks / (per_chunk_grid > 0 ? per_chunk_grid : 1);
    const int64_t room = kMaxPartials / (int64_t(s.heads) * s.c * s.f > 0 ? int64_t(s.heads) * s.c * s.f : 1);
    if (chunks > fill) chunks = fill;
    if (chunks > room) chunks = room;
    return chunks > 0 ? chunks : 1;
}

cudaError_t run_head_outer_sum(const void* x1, const float* y1, float s1, const void* x2, const float* y2, float s2,
                               RowDtype x_dtype, float* partials, int64_t chunks, const HeadShape& s,
                               cudaStream_t stream) {
    switch (x_dtype) {
        case RowDtype::kF16:
            return launch_outer_sum(static_cast<const __half*>(x1), y1, s1, static_cast<const __half*>(x2), y2, s2,
                                    partials, chunks, s, stream);
        case RowDtype::kBF16:
            return launch_outer_sum(static_cast<const __nv_bfloat16*>(x1), y1, s1,
                                    static_cast<const __nv_bfloat16*>(x2), y2, s2, partials, chunks, s, stream);
        default:
            return launch_outer_sum(static_cast<const float*>(x1), y1, s1, static_cast<const float*>(x2), y2, s2,
                                    partials, chunks, s, stream);
    }
}

}  // namespace gt_fused3s
