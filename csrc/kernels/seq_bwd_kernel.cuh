// Sparse attention over sequences, backward: the forward's blocks and key
// tiles (seq_fwd_kernel.cuh, the same key-set policy), with the gradients of
// FlashAttention-2 computed from the forward's log-sum-exp:
//   P = exp(s - lse), dP = dO V^T, dS = P (dP - delta), delta = rowsum(dO O)
//   dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.
//
// Work decomposition. A block of 4 warps takes a row block of queries (128
// for D <= 64, twice the forward's, so each key tile's dK and dV are added
// once per 128 queries: half the atomics; 64 at D = 128) and one head, and
// walks its key tiles (64 keys) with the forward's policy (seq_walk.cuh). Q
// and dO of the block sit in shared memory for the whole walk; K and V tiles
// are copied as in the forward (cp.async, double buffered). Per tile, warp w
// owns the 16 keys of slice w and computes the transposed scores of its keys
// against the block's query m-tiles, S^T [16, 16] = K_w Q_m^T at a time (keys
// as the mma M dimension: P^T and dS^T come out of the C fragments as the A
// operands of dV_w += P^T dO and dK_w += dS^T Q, no transposition), and
// dP^T = V_w dO_m^T. dS^T goes to shared memory, from where warp w reads the
// dS rows of its own m-tiles w (and w + 4) (ldmatrix.trans) for dQ += dS K
// over the tile's 64 keys: dQ stays in registers for the whole walk (a block
// owns its queries). dK and dV of the tile's keys are added to fp32 buffers
// with atomics (other row blocks see the same keys), which the caller zeroes
// and casts: the order of those additions is not fixed (not bitwise
// deterministic).
#pragma once

#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

#include "seq_params.h"
#include "seq_mask.cuh"
#include "seq_walk.cuh"
#include "mma_utils.cuh"
#include "smem_tile.cuh"

namespace gt_fused3s {

// delta = rowsum(dO O) and lse in log2 units per (token, head), 8 bytes a
// query, head-major (seq_params.h: SeqBwdPrepParams), read by both backward kernels: a group of kHeadDim / 8 lanes takes
// a row (16 bytes of dO and of O a lane) and sums it by shuffles.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) seq_bwd_prep_kernel(const SeqBwdPrepParams p) {
    constexpr int kLanes = kHeadDim / 8;
    const int64_t rows = p.num_tokens * p.num_heads;
    const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
    const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x / kLanes;
    const int sub = threadIdx.x % kLanes;
    if (p.counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.counter = 0ull;
    for (int64_t row = first; row < rows; row += step) {   // uniform per group: rows cover whole groups
        const int64_t tok = row / p.num_heads, head = row - tok * p.num_heads;
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p.do_ptr) +
                                                             tok * p.do_row_stride + head * p.do_head_stride) + sub);
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p.o_ptr) +
                                                             tok * p.o_row_stride + head * p.o_head_stride) + sub);
        const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 x = TypeTraits<T>::unpack(aw[i]), y = TypeTraits<T>::unpack(bw[i]);
            sum = fmaf(x.x, y.x, fmaf(x.y, y.y, sum));
        }
        const int lane = threadIdx.x & 31;
        const unsigned group = ((1u << kLanes) - 1u) << (lane & ~(kLanes - 1));   // (kLanes = 32: every lane)
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(group, sum, o);
        if (sub == 0) {
            *reinterpret_cast<float2*>(p.ld_ptr + head * p.ld_head_stride + 2 * tok) =
                make_float2(__ldg(p.lse_ptr + row) * 1.4426950408889634f, sum);
        }
    }
}

template <typename T, int kHeadDim>
void run_seq_bwd_prep(const SeqBwdPrepParams& params, cudaStream_t stream) {
    constexpr int kThreads = 256, kRowsPerBlock = kThreads / (kHeadDim / 8);
    const int64_t rows = params.num_tokens * params.num_heads;
    if (rows <= 0) return;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const unsigned grid = static_cast<unsigned>(blocks < 65536 * 8 ? blocks : 65536 * 8);   // then a grid-stride loop
    seq_bwd_prep_kernel<T, kHeadDim><<<grid, kThreads, 0, stream>>>(params);
}

template <int kHeadDim>
struct SeqBwdConfig {
    static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128, "sequence head dim must be 32, 64 or 128");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBlockRows = seq_bwd_block_rows(kHeadDim);   // 8 or 4 m-tiles of 16 queries
    static constexpr int kMTiles = kBlockRows / 16;
    static constexpr int kDqTiles = kMTiles / kWarps;   // m-tiles whose dQ a warp holds: w, w + 4
    static constexpr int kNT = kHeadDim / 8;         // n-tiles of dQ, dK, dV
    static constexpr int kSteps = kHeadDim / 16;     // k-steps of S^T and dP^T
    using Tile = RowTile<kHeadDim>;
    using DsTile = RowTile<kBlockRows>;              // dS^T: 16 keys x the block's queries
    static constexpr int kSlices = kSeqTileKeys / 16;
    static_assert(kSlices == kWarps && kMTiles == kDqTiles * kWarps, "warp w: key slice w, dQ of m-tiles w + 4i");
    static constexpr int kStageBytes = 2 * kSlices * Tile::kBytes;      // K and V of one tile
    static constexpr int kQdoBytes = 2 * kMTiles * Tile::kBytes;         // Q and dO of the block
    static constexpr int kDsBytes = kSlices * DsTile::kBytes;
    static constexpr int kRowBytes = 2 * kBlockRows * 4;                 // lse (log2) and delta per query
    static constexpr int kSmemBytes = 2 * kStageBytes + kQdoBytes + kDsBytes + kRowBytes;
    static constexpr bool kHoldKV = kHeadDim <= 64;   // K_w, V_w fragments held across m-tiles
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(SeqBwdConfig<kHeadDim>::kThreads, 1) seq_bwd_kernel(const __grid_constant__ SeqBwdParams p) {
    using Cfg = SeqBwdConfig<kHeadDim>;
    using Tile = typename Cfg::Tile;
    using DsTile = typename Cfg::DsTile;
    constexpr int kNT = Cfg::kNT;
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int head = blockIdx.y;
    const SeqFwdParams& f = p.fwd;

    SeqWindow blk;
    if (!seq_window(f, blockIdx.x, blk) || blk.rows == 0) return;   // block-uniform
    const SeqMask& mk = f.mask;

    const uint16_t* q = reinterpret_cast<const uint16_t*>(f.q_ptr) + head * f.q_head_stride;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(f.k_ptr) + head * f.k_head_stride;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(f.v_ptr) + head * f.v_head_stride;
    const uint16_t* dout = reinterpret_cast<const uint16_t*>(p.do_ptr) + head * p.do_head_stride;

    const uint32_t smem0 = smem_addr(smem);
    auto k_slice = [&](int stage, int sl) { return smem0 + stage * Cfg::kStageBytes + sl * Tile::kBytes; };
    auto v_slice = [&](int stage, int sl) {
        return smem0 + stage * Cfg::kStageBytes + (Cfg::kSlices + sl) * Tile::kBytes;
    };
    const uint32_t qdo0 = smem0 + 2 * Cfg::kStageBytes;
    auto q_slice = [&](int m) { return qdo0 + m * Tile::kBytes; };
    auto do_slice = [&](int m) { return qdo0 + (Cfg::kMTiles + m) * Tile::kBytes; };
    const uint32_t ds0 = qdo0 + Cfg::kQdoBytes;
    auto ds_slice = [&](int sl) { return ds0 + sl * DsTile::kBytes; };
    float* lse2_s = reinterpret_cast<float*>(smem + 2 * Cfg::kStageBytes + Cfg::kQdoBytes + Cfg::kDsBytes);
    float* delta_s = lse2_s + Cfg::kBlockRows;

    // Warp w copies the Q and dO rows of m-tiles w, w + 4.
    auto token_of = [&](int r) { return blk.doc_start + blk.base + static_cast<int64_t>(blk.stride) * r; };
#pragma unroll
    for (int i = 0; i < Cfg::kDqTiles; ++i) {
        const int m = warp + Cfg::kWarps * i;
        const int r = 16 * m + (lane & 15);
        const int row = (lane < 16 && r < blk.rows) ? static_cast<int>(token_of(r)) : -1;
        Tile::load_async(q_slice(m), q, f.q_row_stride, do_slice(m), dout, p.do_row_stride, row, lane);
    }
    cp_async_commit();
    for (int r = threadIdx.x; r < Cfg::kBlockRows; r += Cfg::kThreads) {
        float2 ld = make_float2(0.f, 0.f);   // lse2 -inf: a query without keys (no bits on)
        if (r < blk.rows) ld = __ldg(reinterpret_cast<const float2*>(p.ld_ptr + head * p.ld_head_stride) + token_of(r));
        lse2_s[r] = ld.x;
        delta_s[r] = ld.y;
    }

    float dq[Cfg::kDqTiles][kNT][4];
#pragma unroll
    for (int i = 0; i < Cfg::kDqTiles; ++i) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) dq[i][j][0] = dq[i][j][1] = dq[i][j][2] = dq[i][j][3] = 0.f;
    }

    auto load_tile = [&](const SeqTile& c, int stage) {
        seq_load_kv<Tile>(k_slice(stage, warp), v_slice(stage, warp), k, f.k_row_stride, v, f.v_row_stride, mk, blk,
                          c, warp, lane);
        return false;   // cp.async: no bulk copies to wait for
    };
    // (the walk's first barrier also covers Q, dO, lse and delta, copied above)
    seq_walk_tiles(mk, blk, Cfg::kBlockRows, load_tile, [&](const SeqTile& cur, int stage, bool full) {
        const int32_t n0 = cur.tile * kSeqTileKeys + 16 * warp;   // this warp's keys in the segment
        float dk[kNT][4], dv[kNT][4];
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
        }
        // K_w and V_w as A fragments are the same for every m-tile: at D <= 64
        // they are read once per tile (a third of the warp's ldmatrix; the
        // backward is bound by shared-memory reads), at D = 128 per m-tile
        // (their 64 registers would spill)
        constexpr int kHeld = Cfg::kHoldKV ? Cfg::kSteps : 1;
        uint32_t ka[kHeld][4], va[kHeld][4];
        if constexpr (Cfg::kHoldKV) {
#pragma unroll
            for (int step = 0; step < Cfg::kSteps; ++step) {
                Tile::a_frag(ka[step], k_slice(stage, warp), step, lane);
                Tile::a_frag(va[step], v_slice(stage, warp), step, lane);
            }
        }
#pragma unroll 1
        for (int m = 0; m < Cfg::kMTiles; ++m) {
            uint32_t bits = 0xFFu;   // a full tile: every query of the block sees every key
            const bool any = full || seq_pair_bits<true>(mk, seq_sub_window(blk, m), cur.part, cur.ks, n0, lane, bits);   // warp-uniform
            uint32_t pa[4] = {0u, 0u, 0u, 0u}, dsa[4] = {0u, 0u, 0u, 0u};
            if (any) {
                // S^T [16 keys, 16 queries] = K_w Q_m^T and dP^T = V_w dO_m^T
                float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
                for (int step = 0; step < Cfg::kSteps; ++step) {
                    const int h = Cfg::kHoldKV ? step : 0;
                    if constexpr (!Cfg::kHoldKV) Tile::a_frag(ka[0], k_slice(stage, warp), step, lane);
                    uint32_t b[4];
                    Tile::bt_frags(b, q_slice(m), step, lane);
                    mma_16816<T>(s[0], ka[h], b[0], b[1]);
                    mma_16816<T>(s[1], ka[h], b[2], b[3]);
                    if constexpr (!Cfg::kHoldKV) Tile::a_frag(va[0], v_slice(stage, warp), step, lane);
                    Tile::bt_frags(b, do_slice(m), step, lane);
                    mma_16816<T>(dp[0], va[h], b[0], b[1]);
                    mma_16816<T>(dp[1], va[h], b[2], b[3]);
                }
                // element (b, i): key g (i < 2) or g + 8, query 16m + 8b + 2t + (i & 1)
                float pv[2][4], dsv[2][4];
#pragma unroll
                for (int b = 0; b < 2; ++b) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = 16 * m + 8 * b + 2 * t + (i & 1);
                        const bool on = (bits >> (4 * b + i)) & 1u;
                        pv[b][i] = on ? fast_exp2(s[b][i] * f.scale_log2 - lse2_s[r]) : 0.f;
                        dsv[b][i] = pv[b][i] * (dp[b][i] - delta_s[r]);
                    }
                }
                // as A operands (rows: keys, k: the m-tile's queries), mma_utils.cuh's layout
                pa[0] = TypeTraits<T>::pack(pv[0][0], pv[0][1]);
                pa[1] = TypeTraits<T>::pack(pv[0][2], pv[0][3]);
                pa[2] = TypeTraits<T>::pack(pv[1][0], pv[1][1]);
                pa[3] = TypeTraits<T>::pack(pv[1][2], pv[1][3]);
                dsa[0] = TypeTraits<T>::pack(dsv[0][0], dsv[0][1]);
                dsa[1] = TypeTraits<T>::pack(dsv[0][2], dsv[0][3]);
                dsa[2] = TypeTraits<T>::pack(dsv[1][0], dsv[1][1]);
                dsa[3] = TypeTraits<T>::pack(dsv[1][2], dsv[1][3]);
                // dV_w += P^T dO_m, dK_w += dS^T Q_m
#pragma unroll
                for (int jj = 0; jj < kNT / 2; ++jj) {
                    uint32_t b[4];
                    Tile::b_frags(b, do_slice(m), jj, lane);
                    mma_16816<T>(dv[2 * jj], pa, b[0], b[1]);
                    mma_16816<T>(dv[2 * jj + 1], pa, b[2], b[3]);
                    Tile::b_frags(b, q_slice(m), jj, lane);
                    mma_16816<T>(dk[2 * jj], dsa, b[0], b[1]);
                    mma_16816<T>(dk[2 * jj + 1], dsa, b[2], b[3]);
                }
            }
            // dS^T of (keys of slice w, queries of m-tile m) into shared memory (zeros where masked)
            const uint32_t at0 = ds_slice(warp) + DsTile::at(g, 16 * m + 2 * t);
            const uint32_t at1 = ds_slice(warp) + DsTile::at(g + 8, 16 * m + 2 * t);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at0), "r"(dsa[0]) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at1), "r"(dsa[1]) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at0 + 16u), "r"(dsa[2]) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at1 + 16u), "r"(dsa[3]) : "memory");
        }
        __syncthreads();   // dS^T of every warp's keys

        // dQ of m-tiles w, w + 4 += dS [their 16 queries, 64 keys] K [64 keys, D]
#pragma unroll
        for (int sl = 0; sl < Cfg::kSlices; ++sl) {
            uint32_t a[Cfg::kDqTiles][4];
#pragma unroll
            for (int i = 0; i < Cfg::kDqTiles; ++i) {
                // A = (dS^T)^T: lane l addresses row 8 (mi >> 1) + l % 8 (keys), column 16m + 8 (mi & 1) (queries)
                const int mi = lane >> 3, m = warp + Cfg::kWarps * i;
                ldmatrix_x4_trans(a[i], ds_slice(sl) + DsTile::at(8 * (mi >> 1) + (lane & 7), 16 * m + 8 * (mi & 1)));
            }
#pragma unroll
            for (int jj = 0; jj < kNT / 2; ++jj) {
                uint32_t b[4];
                Tile::b_frags(b, k_slice(stage, sl), jj, lane);
#pragma unroll
                for (int i = 0; i < Cfg::kDqTiles; ++i) {
                    mma_16816<T>(dq[i][2 * jj], a[i], b[0], b[1]);
                    mma_16816<T>(dq[i][2 * jj + 1], a[i], b[2], b[3]);
                }
            }
        }

        // dK, dV of this warp's keys: rows g, g + 8 of the slice
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int32_t n = n0 + g + 8 * r;
            if (n >= cur.ks.count) continue;
            const int64_t tok = blk.doc_start + seg_key(mk, cur.ks, n);
            float* dkr = p.dk_ptr + tok * p.grad_row_stride + head * p.grad_head_stride + 2 * t;
            float* dvr = p.dv_ptr + tok * p.grad_row_stride + head * p.grad_head_stride + 2 * t;
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                if (dk[j][2 * r] != 0.f || dk[j][2 * r + 1] != 0.f) {
                    add_pair(dkr + 8 * j, p.scale * dk[j][2 * r], p.scale * dk[j][2 * r + 1]);
                }
                if (dv[j][2 * r] != 0.f || dv[j][2 * r + 1] != 0.f) add_pair(dvr + 8 * j, dv[j][2 * r], dv[j][2 * r + 1]);
            }
        }
    }, [](int) {});   // (its closing barrier also frees the dS^T tile for the next tile)
    cp_async_wait<0>();   // a block without key tiles still waits for its Q and dO copy

    // dQ of this warp's queries (m-tiles w, w + 4): rows g, g + 8; d = 8j + 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < Cfg::kDqTiles; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * (warp + Cfg::kWarps * i) + g + 8 * r;
            if (row >= blk.rows) continue;
            uint32_t* dqr = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dq_ptr) + token_of(row) * p.grad_row_stride +
                                                        head * p.grad_head_stride + 2 * t);
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                dqr[4 * j] = TypeTraits<T>::pack(p.scale * dq[i][j][2 * r], p.scale * dq[i][j][2 * r + 1]);
            }
        }
    }
}

template <typename T, int kHeadDim>
void run_seq_bwd(const SeqBwdParams& params, cudaStream_t stream) {
    using Cfg = SeqBwdConfig<kHeadDim>;
    if (params.fwd.num_windows <= 0 || params.fwd.num_heads <= 0) return;
    set_max_dynamic_smem<seq_bwd_kernel<T, kHeadDim>>(Cfg::kSmemBytes);   // (an error shows at the launch)
    const dim3 grid(static_cast<unsigned>(params.fwd.num_windows), static_cast<unsigned>(params.fwd.num_heads));
    seq_bwd_kernel<T, kHeadDim><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
}

}  // namespace gt_fused3s
