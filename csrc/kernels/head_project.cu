// The per-head products of head_project.h: CUDA-core kernels, fp32
// accumulation in a fixed order.
#include "head_project.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;
constexpr int kOuterBlocks = 1056;                  // 8 per SM of an H100: the outer sums' target grid
constexpr int64_t kMaxPartials = int64_t(1) << 22;  // floats of the outer sums' chunk partials (16 MB)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// 4 consecutive entries as floats: one 16-byte load of floats, one 8-byte
// load of halves / bf16s (src aligned so).
__device__ __forceinline__ void load4_aligned(float (&dst)[4], const float* src) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}
template <typename H>
__device__ __forceinline__ void load4_aligned(float (&dst)[4], const H* src) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const H* p = reinterpret_cast<const H*>(&raw);
    dst[0] = to_float(p[0]); dst[1] = to_float(p[1]); dst[2] = to_float(p[2]); dst[3] = to_float(p[3]);
}

constexpr int kRowsWeightFloats = 12288;   // w[h]'s chunk in shared memory (48 KB): A <= 768

// 16 bytes of a row as floats (4 floats, 8 halves / bf16s); src 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load16(float (&dst)[16 / sizeof(T)], const T* src) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* p = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < int(16 / sizeof(T)); ++j) dst[j] = to_float(p[j]);
}

// acc[0..16) += xa * w's 16 floats at wr (16-byte aligned shared memory).
__device__ __forceinline__ void fma16(float (&acc)[16], float xa, const float* wr) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float4 v = reinterpret_cast<const float4*>(wr)[j];
        acc[4 * j] = fmaf(xa, v.x, acc[4 * j]);
        acc[4 * j + 1] = fmaf(xa, v.y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(xa, v.z, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(xa, v.w, acc[4 * j + 3]);
    }
}

// One thread per (n, h) row and chunk of 16 outputs (grid z), the block's
// rows of one head h: the chunk's columns of w[h] staged in shared memory
// as [A][16] (zeros past B), every thread of a warp reading the same
// entries (a broadcast): per x entry 16 FMAs from four 16-byte shared
// loads; x read 16 bytes a load (a warp's loads touch 32 rows: one entry a
// load made the kernel L1-bound, 4-5x its memory time on the 200k graph).
// A <= 768 (the shared chunk: 48 KB).
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads)
head_project_kernel(const T* __restrict__ x, const float* __restrict__ w, float scale, float* __restrict__ out,
                    int64_t rows, int heads, int c, int f) {
    extern __shared__ float4 w_tile4[];
    float* ws = reinterpret_cast<float*>(w_tile4);   // [A][16]: w[h]'s columns b0 .. b0 + 16, zeros past B
    const int A = kTransposed ? f : c, B = kTransposed ? c : f;
    const int h = blockIdx.y, b0 = blockIdx.z * 16;
    const float* wh = w + int64_t(h) * c * f;
    for (int idx = threadIdx.x; idx < A * 16; idx += blockDim.x) {
        const int a = idx / 16, b = b0 + idx % 16;
        ws[idx] = b < B ? (kTransposed ? wh[int64_t(b) * f + a] : wh[int64_t(a) * f + b]) : 0.f;
    }
    __syncthreads();
    const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (n >= rows) return;
    const T* xr = x + (n * heads + h) * A;
    float* o = out + (n * heads + h) * B + b0;
    constexpr int K = 16 / sizeof(T);   // entries of a 16-byte load
    float acc[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j] = 0.f;
    if (A % K == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {   // (uniform)
        for (int a = 0; a < A; a += K) {
            float xv[K];
            load16<T>(xv, xr + a);
#pragma unroll
            for (int t = 0; t < K; ++t) fma16(acc, xv[t], ws + (a + t) * 16);
        }
    } else {
        for (int a = 0; a < A; ++a) fma16(acc, to_float(xr[a]), ws + a * 16);
    }
    if (B % 4 == 0 && B - b0 >= 16) {   // 16-byte stores (rows of B floats, B % 4 == 0)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            reinterpret_cast<float4*>(o)[j] = make_float4(acc[4 * j] * scale, acc[4 * j + 1] * scale,
                                                          acc[4 * j + 2] * scale, acc[4 * j + 3] * scale);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            if (b0 + j < B) o[j] = acc[j] * scale;
        }
    }
}

// 4 consecutive entries k0.. of a row as floats, zeros from `width` on
// (vector loads where the row allows: a multiple of 4 wide, aligned).
template <typename T>
__device__ __forceinline__ void load4(float (&dst)[4], const T* row, int k0, int width, bool vec) {
    if (vec) {
        load4_aligned(dst, row + k0);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) dst[j] = k0 + j < width ? to_float(row[k0 + j]) : 0.f;
    }
}

// Block (chunk, h, tile group): threads = tiles x lanes, a thread one 4 x 4
// tile of (c, f) pairs over the rows n = lane, lane + lanes, ... of the
// chunk, read straight from global memory (a row's x and y entries, L1
// shared by the tiles that read them: 2 vector loads and 16 FMAs a row and
// term; independent rows keep loads in flight); then the lanes' sums are
// added in lane order through shared memory (no atomics). A version that
// staged row tiles through shared memory with a block of one warp waited
// on its loads one at a time: 2.2 ms on the 200k graph, H = 8.
template <typename T, int kTerms>
__global__ void __launch_bounds__(kThreads)
head_outer_sum_kernel(const T* __restrict__ x1, const float* __restrict__ y1, float s1, const T* __restrict__ x2,
                      const float* __restrict__ y2, float s2, float* __restrict__ partials, int64_t rows,
                      int64_t rows_per_chunk, int tiles_per_block, int heads, int c, int f) {
    __shared__ float lane_sums[kThreads * 16];
    const int tiles_f = (f + 3) / 4, tiles = (c / 4) * tiles_f;
    const int lanes = blockDim.x / tiles_per_block;
    const int tile = blockIdx.z * tiles_per_block + static_cast<int>(threadIdx.x) % tiles_per_block;
    const int lane = static_cast<int>(threadIdx.x) / tiles_per_block;
    const bool owns = tile < tiles;
    const int c0 = owns ? tile / tiles_f * 4 : 0, f0 = owns ? (tile % tiles_f) * 4 : 0;
    const int64_t chunk = blockIdx.x;
    const int h = blockIdx.y;
    const int64_t first = chunk * rows_per_chunk;
    const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
    // vector loads: x rows are c wide (a multiple of 8), y rows need f % 4 == 0
    const bool vec_x = reinterpret_cast<uintptr_t>(x1) % 16 == 0 && (x2 == nullptr ||
                       reinterpret_cast<uintptr_t>(x2) % 16 == 0);
    const bool vec_y = f % 4 == 0 && reinterpret_cast<uintptr_t>(y1) % 16 == 0 && (y2 == nullptr ||
                       reinterpret_cast<uintptr_t>(y2) % 16 == 0);
    float acc[kTerms][4][4] = {};   // (kTerms static: indexed by unrolled loops, in registers)
    if (owns) {
        for (int64_t n = first + lane; n < last; n += lanes) {
            const int64_t row = n * heads + h;
#pragma unroll
            for (int t = 0; t < kTerms; ++t) {
                float xv[4], yv[4];
                load4(xv, (t == 0 ? x1 : x2) + row * c, c0, c, vec_x);
                load4(yv, (t == 0 ? y1 : y2) + row * f, f0, f, vec_y);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[t][i][j] = fmaf(xv[i], yv[j], acc[t][i][j]);
                }
            }
        }
    }
    // the lanes' sums in lane order: lane_sums[lane][tile in block][16]
    float* mine = lane_sums + (lane * tiles_per_block + static_cast<int>(threadIdx.x) % tiles_per_block) * 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) mine[i * 4 + j] = s1 * acc[0][i][j] + (kTerms == 2 ? s2 * acc[kTerms - 1][i][j] : 0.f);
    }
    __syncthreads();
    for (int o = threadIdx.x; o < tiles_per_block * 16; o += blockDim.x) {
        const int tb = o / 16, e = o % 16, t = blockIdx.z * tiles_per_block + tb;
        const int i = e / 4, j = e % 4, oc = t / tiles_f * 4 + i, of = (t % tiles_f) * 4 + j;
        if (t >= tiles || of >= f) continue;
        float sum = 0.f;
        for (int l = 0; l < lanes; ++l) sum += lane_sums[(l * tiles_per_block + tb) * 16 + e];
        partials[((chunk * heads + h) * c + oc) * f + of] = sum;
    }
}

// Tiles of a block: all of them where they fit (with 256 / tiles row lanes
// each), else kThreads a block (one lane) over several tile groups.
int outer_tiles_per_block(const HeadShape& s) {
    const int tiles = (s.c / 4) * ((s.f + 3) / 4);
    return tiles < kThreads ? (tiles > 0 ? tiles : 1) : kThreads;
}

int tile_groups(const HeadShape& s) {
    const int tiles = (s.c / 4) * ((s.f + 3) / 4);
    return (tiles + outer_tiles_per_block(s) - 1) / outer_tiles_per_block(s);
}

template <typename T>
cudaError_t launch_project(const T* x, const float* w, float scale, bool transposed, float* out, const HeadShape& s,
                           cudaStream_t stream) {
    const int A = transposed ? s.f : s.c, B = transposed ? s.c : s.f;
    if (int64_t(A) * 16 > kRowsWeightFloats) return cudaErrorInvalidValue;   // the binding checks F <= 768
    if (s.rows == 0) return cudaSuccess;
    const int64_t blocks = (s.rows + kThreads - 1) / kThreads;
    if (blocks >= (int64_t(1) << 31) || s.heads > 65535) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(s.heads), static_cast<unsigned>((B + 15) / 16));
    const size_t smem = sizeof(float) * size_t(A) * 16;
    if (transposed) {
        head_project_kernel<T, true><<<grid, kThreads, smem, stream>>>(x, w, scale, out, s.rows, s.heads, s.c, s.f);
    } else {
        head_project_kernel<T, false><<<grid, kThreads, smem, stream>>>(x, w, scale, out, s.rows, s.heads, s.c, s.f);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_outer_sum(const T* x1, const float* y1, float s1, const T* x2, const float* y2, float s2,
                             float* partials, int64_t chunks, const HeadShape& s, cudaStream_t stream) {
    if (s.c % 4 != 0) return cudaErrorInvalidValue;   // C is a head dim (a multiple of 8)
    const int64_t per_chunk = (s.rows + chunks - 1) / chunks;
    const int64_t rows_per_chunk = per_chunk > 0 ? per_chunk : 1;
    const int tpb = outer_tiles_per_block(s);
    const int threads = kThreads / tpb * tpb;   // whole lanes
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(s.heads), static_cast<unsigned>(tile_groups(s)));
    if (x2 != nullptr) {
        head_outer_sum_kernel<T, 2><<<grid, threads, 0, stream>>>(x1, y1, s1, x2, y2, s2, partials, s.rows,
                                                                  rows_per_chunk, tpb, s.heads, s.c, s.f);
    } else {
        head_outer_sum_kernel<T, 1><<<grid, threads, 0, stream>>>(x1, y1, s1, x2, y2, s2, partials, s.rows,
                                                                  rows_per_chunk, tpb, s.heads, s.c, s.f);
    }
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
    // about kOuterBlocks blocks (of up to kThreads threads), at least 256 rows a chunk
    const int64_t per_chunk_grid = int64_t(s.heads) * tile_groups(s);
    int64_t chunks = (s.rows + 255) / 256;
    const int64_t fill = int64_t(kOuterBlocks) / (per_chunk_grid > 0 ? per_chunk_grid : 1);
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
