// Dense rows of sequence attention (dense_rows.h): a few queries against all
// keys, the keys split over thread blocks; fp32 on CUDA cores (the rows are
// few, so the work is reading K and V once, not arithmetic).
#include "dense_rows.h"

#include <cmath>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mma_utils.cuh"
#include "smem_tile.cuh"

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;
constexpr int kStepKeys = kDenseRowsStepKeys;             // keys a block holds in shared memory at a time
constexpr int kMaxG = kDenseRowsMaxQueries;
constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
struct Tiles {
    static constexpr int kRow = kD + 8;                    // padded row (16-bit elements): 16-byte reads spread over banks
    static constexpr int kGroups = kThreads / kD;          // query groups of the (query, d) mapping
    static constexpr int kPerThread = kMaxG / kGroups;     // queries a thread accumulates
};

// 8 16-bit elements (16 bytes) as floats.
template <typename T>
__device__ __forceinline__ void to_float8(const uint4& w, float (&x)[8]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = TypeTraits<T>::unpack(words[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}

// Keys j0 .. j0 + valid - 1 of (b, h) into a padded tile, by cp.async
// (zeros past valid; the caller commits the group). The kernels copy the
// next step's K and V while this step computes: with the copies in line
// (each step waiting for its own) the forward was latency-bound, 0.23 ms
// for the 256 MB of K and V at 1M keys on an H200 (README).
template <int kD>
__device__ __forceinline__ void load_tile(uint16_t* tile, const void* base, int64_t batch_stride, int64_t row_stride,
                                          int64_t head_stride, int b, int h, int64_t j0, int valid) {
    constexpr int kChunks = kD / 8;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(base) + b * batch_stride + h * head_stride;
    const uint32_t dst = smem_addr(tile);
    for (int c = threadIdx.x; c < kStepKeys * kChunks; c += kThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 8;
        const bool ok = r < valid;
        cp_async_16(dst + 2 * (r * Tiles<kD>::kRow + col), src + (ok ? (j0 + r) * row_stride + col : 0), ok);
    }
}

// The K and V tiles of kStages steps: the step of keys j0 .. in stage
// (j0 / 64) % kStages, its K tile (which = 0) and V tile (1). Two stages
// (three measured 5-7% slower on an H100 at 1M keys); the backward at
// D = 128 keeps one (the copies in line), where two would cost the second
// block an SM that the chunks are sized for (dense_rows.h).
template <int kD>
constexpr int kFwdStages = 2;
template <int kD>
constexpr int kBwdStages = kD >= 128 ? 1 : 2;
template <int kD, int kStages>
__device__ __forceinline__ uint16_t* kv_tile(uint16_t* tiles, int64_t j0, int which) {
    return tiles + (2 * static_cast<int>((j0 / kStepKeys) % kStages) + which) * kStepKeys * Tiles<kD>::kRow;
}
__device__ __forceinline__ int step_valid(const DenseRowsParams& p, int64_t j0) {
    return static_cast<int>(j0 + kStepKeys <= p.keys ? kStepKeys : p.keys - j0);
}

// The copy of the step of keys j0 .. (nothing past the chunk's end: an
// empty group, so that every step commits one and the wait counts hold).
template <int kD, int kStages>
__device__ __forceinline__ void load_step(uint16_t* tiles, const DenseRowsParams& p, int b, int h, int64_t j0,
                                          int64_t key_end) {
    if (j0 < key_end) {
        const int valid = step_valid(p, j0);
        load_tile<kD>(kv_tile<kD, kStages>(tiles, j0, 0), p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, h,
                      j0, valid);
        load_tile<kD>(kv_tile<kD, kStages>(tiles, j0, 1), p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, h,
                      j0, valid);
    }
    cp_async_commit();
}

// The walk of both kernels over chunk `chunk`'s keys, 64 at a time (block-
// uniform): the first kStages - 1 steps' copies, then each step starts the
// copy kStages - 1 steps ahead, waits for its own and calls
// step(j0, valid, K tile, V tile); the barrier after it (every read of the
// stage done before the next copy into it).
template <int kD, int kStages, typename Step>
__device__ __forceinline__ void for_each_step(uint16_t* tiles, const DenseRowsParams& p, int b, int h, int chunk,
                                              Step&& step) {
    const int64_t key0 = static_cast<int64_t>(chunk) * p.chunk_keys;
    const int64_t key_end = key0 + p.chunk_keys < p.keys ? key0 + p.chunk_keys : p.keys;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) load_step<kD, kStages>(tiles, p, b, h, key0 + s * kStepKeys, key_end);
    for (int64_t j0 = key0; j0 < key_end; j0 += kStepKeys) {
        load_step<kD, kStages>(tiles, p, b, h, j0 + (kStages - 1) * kStepKeys, key_end);
        cp_async_wait<kStages - 1>();
        __syncthreads();   // this step's K and V, every thread's (and what the kernel staged before the walk)
        step(j0, step_valid(p, j0), kv_tile<kD, kStages>(tiles, j0, 0), kv_tile<kD, kStages>(tiles, j0, 1));
        __syncthreads();   // every read of the stage (and of the kernel's per-step arrays) before the next copy
    }
}

// <row of qs (fp32, kD), row j of a padded 16-bit tile>.
template <typename T, int kD>
__device__ __forceinline__ float dot_row(const float* qrow, const uint16_t* tile, int j) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kD; c += 8) {
        float x[8];
        to_float8<T>(*reinterpret_cast<const uint4*>(tile + j * Tiles<kD>::kRow + c), x);
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qrow[c + e], x[e], s);
    }
    return s;
}

// Element `at` of a 16-bit array as a float.
template <typename T>
__device__ __forceinline__ float elem(const uint16_t* x, int64_t at) {
    const uint16_t u = x[at];
    if constexpr (std::is_same<T, __half>::value) return __half2float(__ushort_as_half(u));
    else return __bfloat162float(__ushort_as_bfloat16(u));
}

// Forward: block (chunk, b h) takes keys chunk * p.chunk_keys .., 64 at a
// time with an online softmax per query, and writes its partial state
// (o unnormalised, m in log2 units, l) for the merge.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads) dense_rows_fwd_kernel(const DenseRowsParams p) {
    using Tl = Tiles<kD>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float(*qs)[kD] = reinterpret_cast<float(*)[kD]>(smem_raw);                           // q scale log2(e)
    float(*ss)[kStepKeys] = reinterpret_cast<float(*)[kStepKeys]>(qs + kMaxG);         // scores, then probabilities
    uint16_t* tiles = reinterpret_cast<uint16_t*>(ss + kMaxG);                           // K, V of kStages steps
    __shared__ float m_s[kMaxG], l_s[kMaxG], alpha_s[kMaxG];
    const int chunk = blockIdx.x, bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
    const int G = p.queries, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float scale_log2 = p.scale * kLog2e;
    const uint16_t* qg = reinterpret_cast<const uint16_t*>(p.qg);
    for (int x = tid; x < G * kD; x += kThreads) {
        const int i = x / kD, d = x % kD;
        qs[i][d] = elem<T>(qg, ((static_cast<int64_t>(b) * G + i) * p.heads + h) * kD + d) * scale_log2;
    }
    if (tid < G) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.f;
    }
    const int d = tid % kD, grp = tid / kD;
    float o[Tl::kPerThread];
#pragma unroll
    for (int r = 0; r < Tl::kPerThread; ++r) o[r] = 0.f;

    for_each_step<kD, kFwdStages<kD>>(tiles, p, b, h, chunk, [&](int64_t, int valid, const uint16_t* kt,
                                                                  const uint16_t* vt) {
        for (int x = tid; x < G * kStepKeys; x += kThreads) {   // consecutive threads: consecutive keys
            const int i = x / kStepKeys, j = x % kStepKeys;
            ss[i][j] = j < valid ? dot_row<T, kD>(qs[i], kt, j) : -INFINITY;
        }
        __syncthreads();
        for (int i = warp; i < G; i += kThreads / 32) {   // a warp per query: the online softmax step
            const float s0 = ss[i][lane], s1 = ss[i][lane + 32];
            float mx = fmaxf(s0, s1);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m_s[i], mx);
            const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
            ss[i][lane] = p0;
            ss[i][lane + 32] = p1;
            float sum = p0 + p1;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f(m_s[i] - m_new);   // 0 on the first step (m = -inf)
                l_s[i] = l_s[i] * alpha + sum;
                m_s[i] = m_new;
                alpha_s[i] = alpha;
            }
        }
        __syncthreads();   // probabilities and alpha in place
#pragma unroll
        for (int r = 0; r < Tl::kPerThread; ++r) {
            const int i = grp + Tl::kGroups * r;
            if (i >= G) break;
            float acc = o[r] * alpha_s[i];
            for (int j = 0; j < kStepKeys; ++j) acc = fmaf(ss[i][j], elem<T>(vt, j * Tl::kRow + d), acc);
            o[r] = acc;
        }
    });
    const int64_t bhs = static_cast<int64_t>(p.batch) * p.heads;
    float* part = p.partial + (static_cast<int64_t>(chunk) * bhs + bh) * G * (kD + 2);
#pragma unroll
    for (int r = 0; r < Tl::kPerThread; ++r) {
        const int i = grp + Tl::kGroups * r;
        if (i < G) part[i * (kD + 2) + d] = o[r];
    }
    if (tid < G) {
        part[tid * (kD + 2) + kD] = m_s[tid];
        part[tid * (kD + 2) + kD + 1] = l_s[tid];
    }
}

// Merge: block (b h, i) folds the chunks' states of query i; thread (part,
// d) folds chunks part, part + kParts, ..., then the parts are folded in
// shared memory (a row has up to ~4 x SMs / (B H) chunks: dense_rows_chunk_keys).
template <int kD>
__global__ void __launch_bounds__(kThreads) dense_rows_merge_kernel(const DenseRowsParams p) {
    constexpr int kParts = kThreads / kD;
    __shared__ float ms[kParts], ls[kParts][kD], os[kParts][kD];
    const int bh = blockIdx.x, i = blockIdx.y, b = bh / p.heads, h = bh % p.heads, G = p.queries;
    const int d = threadIdx.x % kD, part = threadIdx.x / kD;
    const int64_t chunks = (p.keys + p.chunk_keys - 1) / p.chunk_keys, bhs = static_cast<int64_t>(p.batch) * p.heads;
    float m = -INFINITY, l = 0.f, o = 0.f;
    constexpr int kAhead = 4;   // states loaded before they are folded: the loads overlap, not the fold's latency chain
    for (int64_t c0 = part; c0 < chunks; c0 += kAhead * kParts) {
        float mc[kAhead], lc[kAhead], oc[kAhead];
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
            const int64_t c = c0 + u * kParts;
            mc[u] = -INFINITY, lc[u] = 0.f, oc[u] = 0.f;
            if (c < chunks) {
                const float* st = p.partial + ((c * bhs + bh) * G + i) * (kD + 2);
                mc[u] = st[kD], lc[u] = st[kD + 1], oc[u] = st[d];
            }
        }
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
            if (mc[u] == -INFINITY) continue;   // past the last chunk (a chunk holds keys: its m is finite)
            const float m_new = fmaxf(m, mc[u]);
            const float a = exp2f(m - m_new), ac = exp2f(mc[u] - m_new);   // (m = -inf: a = 0)
            l = l * a + lc[u] * ac;
            o = o * a + oc[u] * ac;
            m = m_new;
        }
    }
    if (d == 0) ms[part] = m;
    ls[part][d] = l;
    os[part][d] = o;
    __syncthreads();
    if (part == 0) {
        float M = -INFINITY;
#pragma unroll
        for (int q = 0; q < kParts; ++q) M = fmaxf(M, ms[q]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int q = 0; q < kParts; ++q) {
            const float a = ms[q] == -INFINITY ? 0.f : exp2f(ms[q] - M);   // a part without chunks
            L += ls[q][d] * a;
            O += os[q][d] * a;
        }
        p.og[((static_cast<int64_t>(b) * G + i) * p.heads + h) * kD + d] = L > 0.f ? O / L : 0.f;
        if (d == 0) p.lse[static_cast<int64_t>(bh) * G + i] = L > 0.f ? (M + log2f(L)) * 0.69314718055994531f : -INFINITY;
    }
}

// Backward: block (chunk, b h) recomputes P and dS of its keys against the
// G queries, writes dK and dV of its keys (every key is one block's) and
// adds dQ of the queries with atomics.
//   P = exp2(s scale log2 e - lse log2 e), dS = P (dO . v - delta)
//   dV_j = sum_i P_ij dO_i, dK_j = scale sum_i dS_ij q_i, dQ_i += scale sum_j dS_ij k_j
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads) dense_rows_bwd_kernel(const DenseRowsParams p) {
    using Tl = Tiles<kD>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float(*qs)[kD] = reinterpret_cast<float(*)[kD]>(smem_raw);                        // q
    float(*dos)[kD] = qs + kMaxG;                                                      // dO
    uint16_t* tiles = reinterpret_cast<uint16_t*>(dos + kMaxG);                        // K, V of kStages steps
    float(*ps)[kStepKeys] = reinterpret_cast<float(*)[kStepKeys]>(tiles + 2 * kBwdStages<kD> * kStepKeys * Tl::kRow);
    float(*dss)[kStepKeys] = ps + kMaxG;
    float* lse2_s = reinterpret_cast<float*>(dss + kMaxG);
    float* delta_s = lse2_s + kMaxG;

    const int chunk = blockIdx.x, bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
    const int G = p.queries, tid = threadIdx.x;
    const float scale_log2 = p.scale * kLog2e;
    const uint16_t* qg = reinterpret_cast<const uint16_t*>(p.qg);
    const uint16_t* dog = reinterpret_cast<const uint16_t*>(p.dog);
    for (int x = tid; x < G * kD; x += kThreads) {
        const int i = x / kD, d = x % kD;
        const int64_t at = ((static_cast<int64_t>(b) * G + i) * p.heads + h) * kD + d;
        qs[i][d] = elem<T>(qg, at);
        dos[i][d] = elem<T>(dog, at);
    }
    if (tid < G) {
        lse2_s[tid] = p.lse[static_cast<int64_t>(bh) * G + tid] * kLog2e;
        delta_s[tid] = p.delta[static_cast<int64_t>(bh) * G + tid];
    }
    const int d = tid % kD, grp = tid / kD;
    float dq[Tl::kPerThread];
#pragma unroll
    for (int r = 0; r < Tl::kPerThread; ++r) dq[r] = 0.f;

    for_each_step<kD, kBwdStages<kD>>(tiles, p, b, h, chunk, [&](int64_t j0, int valid, const uint16_t* kt,
                                                                  const uint16_t* vt) {
        for (int x = tid; x < G * kStepKeys; x += kThreads) {
            const int i = x / kStepKeys, j = x % kStepKeys;
            float pr = 0.f, ds = 0.f;
            if (j < valid) {
                pr = exp2f(dot_row<T, kD>(qs[i], kt, j) * scale_log2 - lse2_s[i]);
                ds = pr * (dot_row<T, kD>(dos[i], vt, j) - delta_s[i]);
            }
            ps[i][j] = pr;
            dss[i][j] = ds;
        }
        __syncthreads();
        // dK, dV of the step's keys: 8 consecutive d of one key a thread
        constexpr int kChunks = kD / 8;
        for (int x = tid; x < kStepKeys * kChunks; x += kThreads) {
            const int j = x / kChunks, c = (x % kChunks) * 8;
            if (j >= valid) continue;
            float ak[8] = {}, av[8] = {};
            for (int i = 0; i < G; ++i) {
                const float pij = ps[i][j], dsij = dss[i][j];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    av[e] = fmaf(pij, dos[i][c + e], av[e]);
                    ak[e] = fmaf(dsij, qs[i][c + e], ak[e]);
                }
            }
            uint32_t wk[4], wv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                wk[e] = TypeTraits<T>::pack(p.scale * ak[2 * e], p.scale * ak[2 * e + 1]);
                wv[e] = TypeTraits<T>::pack(av[2 * e], av[2 * e + 1]);
            }
            const int64_t at = ((static_cast<int64_t>(b) * p.keys + j0 + j) * p.heads + h) * kD + c;
            *reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.dk) + at) = make_uint4(wk[0], wk[1], wk[2], wk[3]);
            *reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.dv) + at) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
        }
        // dQ of the queries over the step's keys
#pragma unroll
        for (int r = 0; r < Tl::kPerThread; ++r) {
            const int i = grp + Tl::kGroups * r;
            if (i >= G) break;
            float acc = dq[r];
            for (int j = 0; j < kStepKeys; ++j) acc = fmaf(dss[i][j], elem<T>(kt, j * Tl::kRow + d), acc);
            dq[r] = acc;
        }
    });
#pragma unroll
    for (int r = 0; r < Tl::kPerThread; ++r) {
        const int i = grp + Tl::kGroups * r;
        if (i < G) atomicAdd(p.dqg + ((static_cast<int64_t>(b) * G + i) * p.heads + h) * kD + d, p.scale * dq[r]);
    }
}

template <int kD>
constexpr int fwd_smem_bytes() {
    return kMaxG * kD * 4 + kMaxG * kStepKeys * 4 + 2 * kFwdStages<kD> * kStepKeys * Tiles<kD>::kRow * 2;
}
template <int kD>
constexpr int bwd_smem_bytes() {
    return 2 * kMaxG * kD * 4 + 2 * kBwdStages<kD> * kStepKeys * Tiles<kD>::kRow * 2 + 2 * kMaxG * kStepKeys * 4 +
           2 * kMaxG * 4;
}

}  // namespace

template <typename T, int HeadDim>
cudaError_t run_dense_rows_fwd(const DenseRowsParams& p, cudaStream_t stream) {
    if (p.keys <= 0 || p.queries <= 0 || p.batch <= 0 || p.heads <= 0) return cudaSuccess;
    constexpr int kSmem = fwd_smem_bytes<HeadDim>();
    const cudaError_t e = set_max_dynamic_smem<dense_rows_fwd_kernel<T, HeadDim>>(kSmem);
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>(dense_rows_chunks(p.keys, p.chunk_keys)), static_cast<unsigned>(p.batch * p.heads));
    dense_rows_fwd_kernel<T, HeadDim><<<grid, kThreads, kSmem, stream>>>(p);
    dense_rows_merge_kernel<HeadDim><<<dim3(static_cast<unsigned>(p.batch * p.heads), static_cast<unsigned>(p.queries)),
                                       kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int HeadDim>
cudaError_t run_dense_rows_bwd(const DenseRowsParams& p, cudaStream_t stream) {
    if (p.keys <= 0 || p.queries <= 0 || p.batch <= 0 || p.heads <= 0) return cudaSuccess;
    constexpr int kSmem = bwd_smem_bytes<HeadDim>();
    const cudaError_t e = set_max_dynamic_smem<dense_rows_bwd_kernel<T, HeadDim>>(kSmem);
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>(dense_rows_chunks(p.keys, p.chunk_keys)), static_cast<unsigned>(p.batch * p.heads));
    dense_rows_bwd_kernel<T, HeadDim><<<grid, kThreads, kSmem, stream>>>(p);
    return cudaGetLastError();
}

#define GT_DENSE_ROWS_INSTANCES(T)                                                                 \
    template cudaError_t run_dense_rows_fwd<T, 32>(const DenseRowsParams&, cudaStream_t);          \
    template cudaError_t run_dense_rows_fwd<T, 64>(const DenseRowsParams&, cudaStream_t);          \
    template cudaError_t run_dense_rows_fwd<T, 128>(const DenseRowsParams&, cudaStream_t);         \
    template cudaError_t run_dense_rows_bwd<T, 32>(const DenseRowsParams&, cudaStream_t);          \
    template cudaError_t run_dense_rows_bwd<T, 64>(const DenseRowsParams&, cudaStream_t);          \
    template cudaError_t run_dense_rows_bwd<T, 128>(const DenseRowsParams&, cudaStream_t);
GT_DENSE_ROWS_INSTANCES(__half)
GT_DENSE_ROWS_INSTANCES(__nv_bfloat16)
#undef GT_DENSE_ROWS_INSTANCES

}  // namespace gt_fused3s
