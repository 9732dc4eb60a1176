// Dense rows of sequence attention (dense_rows.h): a few queries against all
// keys, the keys split over warps (forward, tensor cores) or thread blocks
// (backward, fp32 on CUDA cores); the rows are few, so the work is reading
// K and V once, not arithmetic.
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
// (zeros past valid; the caller commits the group). The backward copies the
// next step's K and V while this step computes: with the copies in line
// (each step waiting for its own) the earlier forward was latency-bound,
// 0.23 ms for the 256 MB of K and V at 1M keys on an H200 (README).
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

// The backward's K and V tiles of kStages steps: the step of keys j0 .. in
// stage (j0 / 64) % kStages, its K tile (which = 0) and V tile (1). Two
// stages; at D = 128 one (the copies in line), where two would cost the
// second block an SM that the chunks are sized for (dense_rows.h).
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

// Forward: each warp of block (x, b h) walks chunk x kFwdWarps + warp of the
// keys (p.chunk_keys of them; dense_rows_fwd_chunk_keys), kFwdStepKeys a
// step, through a ring of its own shared-memory stages filled by cp.async
// (no block barrier in the walk: a warp waits only for its own copies), on
// tensor cores: S = Q K^T for the queries as kMT m-tiles of 16 (mma.sync
// m16n8k16; Q from shared memory, rows past G zero), the online softmax in
// registers, O += P V; then its partial state (o unnormalised, m in log2
// units, l) for the merge. Why: the rows' work is reading K and V once; the
// earlier kernel (fp32 dot products on CUDA cores, four block barriers a
// 64-key step) was latency-bound at ~8 GB/s a block, 0.54 ms for the 1 GB of
// K and V at 4M keys on an H100, and too slow on the few SMs it gets beside
// the band kernel (bindings.cpp: seq_eager_forward).
constexpr int kFwdWarps = kDenseRowsFwdWarps;
constexpr int kFwdStepKeys = 32;
template <int kD>
constexpr int kFwdStages = kD >= 128 ? 3 : 4;   // (D = 128: three fit 227 KB)
template <int kD, int kMT>
struct FwdSmem {
    using Tile = RowTile<kD>;
    static constexpr int kQBytes = 16 * kMT * Tile::kRowElems * 2;
    static constexpr int kStepBytes = kFwdStepKeys * Tile::kRowElems * 2;   // K or V of a step
    static constexpr int kWarpBytes = kFwdStages<kD> * 2 * kStepBytes;
    static constexpr int kBytes = kQBytes + kFwdWarps * kWarpBytes;
};

template <typename T, int kD, int kMT>
__global__ void __launch_bounds__(32 * kFwdWarps) dense_rows_fwd_kernel(const DenseRowsParams p) {
    using Tile = RowTile<kD>;
    using Sm = FwdSmem<kD, kMT>;
    constexpr int kStages = kFwdStages<kD>, kChunks = kD / 8;   // 16-byte chunks a row
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t q_tile = smem_addr(smem_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads, G = p.queries;
    const uint32_t ring = q_tile + Sm::kQBytes + warp * Sm::kWarpBytes;
    const uint16_t* qg = reinterpret_cast<const uint16_t*>(p.qg) + b * p.q_batch_stride + h * p.q_head_stride;
    for (int c = threadIdx.x; c < 16 * kMT * kChunks; c += blockDim.x) {   // Q (zeros past G)
        const int i = c / kChunks, ch = c % kChunks, i0 = i < G ? i : 0;
        const int64_t r = p.q_rows != nullptr ? p.q_rows[i0] : i0;
        if (r < 0 || r >= p.q_len) __trap();   // (a wrong position must not read elsewhere)
        cp_async_16(q_tile + Tile::at(i, 8 * ch), qg + r * p.q_row_stride + 8 * ch, i < G);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kFwdWarps + warp;
    const int64_t k0 = chunk * p.chunk_keys;
    if (k0 >= p.keys) return;
    const int64_t k1 = k0 + p.chunk_keys < p.keys ? k0 + p.chunk_keys : p.keys;
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride;
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
    // the copy of the step of keys j0 .. into its stage (zeros past k1; an
    // empty group past the chunk, so that every step commits one)
    auto load = [&](int64_t j0) {
        if (j0 < k1) {
            const uint32_t st = ring + static_cast<uint32_t>(((j0 - k0) / kFwdStepKeys) % kStages) * 2 * Sm::kStepBytes;
#pragma unroll
            for (int c = lane; c < kFwdStepKeys * kChunks; c += 32) {
                const int r = c / kChunks, ch = c % kChunks;
                const bool ok = j0 + r < k1;
                const int64_t key = ok ? j0 + r : k0;
                cp_async_16(st + Tile::at(r, 8 * ch), kp + key * p.k_row_stride + 8 * ch, ok);
                cp_async_16(st + Sm::kStepBytes + Tile::at(r, 8 * ch), vp + key * p.v_row_stride + 8 * ch, ok);
            }
        }
        cp_async_commit();
    };
    const float sl2 = p.scale * kLog2e;
    float o[kMT][kD / 8][4] = {}, m[kMT][2], l[kMT][2] = {};
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) m[mt][0] = m[mt][1] = -INFINITY;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) load(k0 + s * kFwdStepKeys);
    for (int64_t j0 = k0; j0 < k1; j0 += kFwdStepKeys) {
        load(j0 + (kStages - 1) * kFwdStepKeys);
        cp_async_wait<kStages - 1>();
        __syncwarp();   // every lane's copies of this step
        const uint32_t kt = ring + static_cast<uint32_t>(((j0 - k0) / kFwdStepKeys) % kStages) * 2 * Sm::kStepBytes;
        const uint32_t vt = kt + Sm::kStepBytes;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            float s[kFwdStepKeys / 8][4] = {};   // S [16, 32]: n-tile nt holds keys j0 + 8 nt ..
#pragma unroll
            for (int ks = 0; ks < kD / 16; ++ks) {
                uint32_t a[4];
                Tile::a_frag(a, q_tile + Tile::at(16 * mt, 0), ks, lane);
#pragma unroll
                for (int np = 0; np < kFwdStepKeys / 16; ++np) {
                    uint32_t bf[4];
                    Tile::bt_frags(bf, kt + Tile::at(16 * np, 0), ks, lane);
                    mma_16816<T>(s[2 * np], a, bf[0], bf[1]);
                    mma_16816<T>(s[2 * np + 1], a, bf[2], bf[3]);
                }
            }
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < kFwdStepKeys / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {   // (rows g, g + 8; keys 8 nt + 2 t4 + e % 2)
                    const bool ok = j0 + 8 * nt + 2 * t4 + (e & 1) < k1;
                    s[nt][e] = ok ? s[nt][e] * sl2 : -INFINITY;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
                }
            }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {   // a step holds a key of the chunk: the new max is finite
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[mt][r], mx[r]);
                alpha[r] = fast_exp2(m[mt][r] - m_new);   // m = -inf: 0
                m[mt][r] = m_new;
                l[mt][r] *= alpha[r];
            }
#pragma unroll
            for (int nt = 0; nt < kFwdStepKeys / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = fast_exp2(s[nt][e] - m[mt][e >> 1]);
                    l[mt][e >> 1] += s[nt][e];
                }
            }
#pragma unroll
            for (int n = 0; n < kD / 8; ++n) {
                o[mt][n][0] *= alpha[0], o[mt][n][1] *= alpha[0];
                o[mt][n][2] *= alpha[1], o[mt][n][3] *= alpha[1];
            }
            // O += P V: P as the A fragments of k-steps of 16 keys
#pragma unroll
            for (int kk = 0; kk < kFwdStepKeys / 16; ++kk) {
                const uint32_t pa[4] = {TypeTraits<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                                        TypeTraits<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                                        TypeTraits<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        TypeTraits<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int jj = 0; jj < kD / 16; ++jj) {
                    uint32_t bf[4];
                    Tile::b_frags(bf, vt + Tile::at(16 * kk, 0), jj, lane);
                    mma_16816<T>(o[mt][2 * jj], pa, bf[0], bf[1]);
                    mma_16816<T>(o[mt][2 * jj + 1], pa, bf[2], bf[3]);
                }
            }
        }
        __syncwarp();   // every lane's reads of the stage before a later step's copy into it
    }
    cp_async_wait<0>();   // (the empty groups)
    const int64_t bhs = static_cast<int64_t>(p.batch) * p.heads;
    float* part = p.partial + (chunk * bhs + bh) * G * (kD + 2);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lr = l[mt][r];
            lr += __shfl_xor_sync(0xffffffffu, lr, 1);
            lr += __shfl_xor_sync(0xffffffffu, lr, 2);
            const int i = 16 * mt + 8 * r + g;
            if (i >= G) continue;
            float* st = part + i * (kD + 2);
#pragma unroll
            for (int n = 0; n < kD / 8; ++n) {
                *reinterpret_cast<float2*>(st + 8 * n + 2 * t4) = make_float2(o[mt][n][2 * r], o[mt][n][2 * r + 1]);
            }
            if (t4 == 0) {
                st[kD] = m[mt][r];
                st[kD + 1] = lr;
            }
        }
    }
}

// Merge: block (b h, i) folds the chunks' states of query i; thread (part,
// d) folds chunks part, part + kParts, ..., then the parts are folded in
// shared memory (a row has up to ~4 x SMs / (B H) chunks: dense_rows_chunk_keys).
// 1024 threads: with B H = 1 the grid is the G queries' blocks only, and
// each thread's chain of dependent loads is the kernel's time (H100, 3
// rows, ~520 chunks below 2^20 keys x batch x heads: 22 us with 256
// threads, 3.5 x the rows' forward at 65k keys; 12.8-12.9 us with 1024;
// 11.1-11.2 us with 8 states loaded ahead instead of 4).
constexpr int kMergeThreads = 1024;
template <typename T, int kD>
__global__ void __launch_bounds__(kMergeThreads) dense_rows_merge_kernel(const DenseRowsParams p) {
    constexpr int kParts = kMergeThreads / kD;
    __shared__ float ms[kParts], ls[kParts][kD], os[kParts][kD];
    const int bh = blockIdx.x, i = blockIdx.y, b = bh / p.heads, h = bh % p.heads, G = p.queries;
    const int d = threadIdx.x % kD, part = threadIdx.x / kD;
    const int64_t chunks = (p.keys + p.chunk_keys - 1) / p.chunk_keys, bhs = static_cast<int64_t>(p.batch) * p.heads;
    float m = -INFINITY, l = 0.f, o = 0.f;
    constexpr int kAhead = 8;   // states loaded before they are folded: the loads overlap, not the fold's latency chain
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
        const float out = L > 0.f ? O / L : 0.f;
        p.og[((static_cast<int64_t>(b) * G + i) * p.heads + h) * kD + d] = out;
        if (p.out_rows != nullptr) {
            const int64_t r = p.out_at_q_rows ? p.q_rows[i] : i;
            T* dst = reinterpret_cast<T*>(p.out_rows) + b * p.out_batch_stride + r * p.out_row_stride +
                     h * p.out_head_stride + d;
            if constexpr (std::is_same<T, __half>::value) *dst = __float2half_rn(out);
            else *dst = __float2bfloat16_rn(out);
        }
        if (d == 0) p.lse[static_cast<int64_t>(bh) * G + i] = L > 0.f ? (M + log2f(L)) * 0.69314718055994531f : -INFINITY;
    }
}

// Backward: block (chunk, b h) recomputes P and dS of its keys against the
// G queries, writes (or adds to: dkv_add) dK and dV of its keys (every key
// is one block's) and adds dQ of the queries with atomics.
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
            const int64_t at = ((static_cast<int64_t>(b) * p.keys + j0 + j) * p.heads + h) * kD + c;
            uint4* dk = reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.dk) + at);
            uint4* dv = reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.dv) + at);
            // dkv_add: onto the sequence kernel's dK, dV (no [B, L, H, D] of
            // the rows' own and no pass adding the two)
            uint32_t wk[4] = {0u, 0u, 0u, 0u}, wv[4] = {0u, 0u, 0u, 0u};
            if (p.dkv_add) {
                const uint4 ok = *dk, ov = *dv;
                wk[0] = ok.x; wk[1] = ok.y; wk[2] = ok.z; wk[3] = ok.w;
                wv[0] = ov.x; wv[1] = ov.y; wv[2] = ov.z; wv[3] = ov.w;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 bk = TypeTraits<T>::unpack(wk[e]), bv = TypeTraits<T>::unpack(wv[e]);   // (0 unless dkv_add)
                wk[e] = TypeTraits<T>::pack(fmaf(p.scale, ak[2 * e], bk.x), fmaf(p.scale, ak[2 * e + 1], bk.y));
                wv[e] = TypeTraits<T>::pack(av[2 * e] + bv.x, av[2 * e + 1] + bv.y);
            }
            *dk = make_uint4(wk[0], wk[1], wk[2], wk[3]);
            *dv = make_uint4(wv[0], wv[1], wv[2], wv[3]);
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
constexpr int bwd_smem_bytes() {
    return 2 * kMaxG * kD * 4 + 2 * kBwdStages<kD> * kStepKeys * Tiles<kD>::kRow * 2 + 2 * kMaxG * kStepKeys * 4 +
           2 * kMaxG * 4;
}

}  // namespace

template <typename T, int HeadDim>
cudaError_t run_dense_rows_fwd(const DenseRowsParams& p, cudaStream_t stream) {
    if (p.keys <= 0 || p.queries <= 0 || p.batch <= 0 || p.heads <= 0) return cudaSuccess;
    const int64_t chunks = dense_rows_chunks(p.keys, p.chunk_keys);
    const dim3 grid(static_cast<unsigned>((chunks + kFwdWarps - 1) / kFwdWarps), static_cast<unsigned>(p.batch * p.heads));
    auto launch = [&](auto m_tiles) -> cudaError_t {
        constexpr int kMT = decltype(m_tiles)::value;
        constexpr auto kernel = dense_rows_fwd_kernel<T, HeadDim, kMT>;
        constexpr int kSmem = FwdSmem<HeadDim, kMT>::kBytes;
        const cudaError_t e = set_max_dynamic_smem<kernel>(kSmem);
        if (e == cudaSuccess) kernel<<<grid, 32 * kFwdWarps, kSmem, stream>>>(p);
        return e;
    };
    const cudaError_t e = p.queries <= 16 ? launch(std::integral_constant<int, 1>{}) : launch(std::integral_constant<int, 2>{});
    if (e != cudaSuccess) return e;
    dense_rows_merge_kernel<T, HeadDim><<<dim3(static_cast<unsigned>(p.batch * p.heads), static_cast<unsigned>(p.queries)),
                                       kMergeThreads, 0, stream>>>(p);
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
