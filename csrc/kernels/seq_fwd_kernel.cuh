// Sparse attention over sequences, forward: FlashAttention-2's block shape
// over the implicit key sets of seq_mask.cuh, with the graph kernel's online
// softmax (online_softmax.cuh) and shared-memory tiles (smem_tile.cuh).
//
// Work decomposition. A block of 4 warps runs one (row block of 64 queries,
// head); warp w owns the m-tile of queries 16w .. 16w+15 (the code takes
// several m-tiles per warp, seq_block_rows; two measured slower on an H100:
// the registers halved the resident warps). The block walks its key tiles
// (64 keys: four pairs of 16) in order; each warp copies one 16-key slice of
// K and V into shared memory (cp.async, zero-filled past a segment's end),
// double buffered so that the next tile loads while this one computes, and
// every warp reads all four slices through ldmatrix. A tile wholly inside
// the mask for the whole block (the inside of a band) takes no mask bits;
// otherwise, per pair, a warp gets its mask bits from the policy and skips
// pairs none of its queries sees (a band's edges). Loads per key are shared
// by 64 queries instead of 16: a quarter of the graph kernel's L2 traffic
// on a band.
//
// Per tile and m-tile, with its 16 queries as the mma M dimension:
//   S [16, 64] = Q K^T            (Q: A fragments in registers, K: ldmatrix)
//   online softmax over the 64 keys at once (one row max, one rescale of O),
//   fp32, log2 domain, -inf masking (full tiles: online_softmax_full)
//   O [16, D] += P V              (P from registers, V: ldmatrix.trans)
// Global rows (a few queries that attend to every key) are computed apart.
// At D = 64 on sm_90a a tile's two products are Hopper's warpgroup MMA
// instead (wgmma.cuh): the block's 4 warps are one warpgroup, its 64 queries
// the M = 64 of S = Q K^T (Q and K from shared memory) and of O += P V (P
// from registers, V from shared memory); the fragments in registers are the
// same, so the softmax between them is unchanged. Local 1M-token forward on
// an H100: 1.92 -> 1.55 ms (README). There, a tile of 64 consecutive keys
// comes by TMA (tma.cuh: one thread's two bulk copies instead of every
// thread's cp.async address arithmetic), the walk knows a band's full tiles
// from one interval per segment, and Q lives in shared memory (16 registers
// a thread freed: the spills went from 130 bytes to 16): local 1M on an H200
// 1.68 -> 1.52 -> 1.40 ms (README). Masks of local windows only take an
// instance whose walk runs a band's full TMA tiles in a loop of their own
// (seq_walk.cuh: kBulkRuns): local 1M 1.27 -> 1.17 ms on an H200 (README).
//
// Measured (H100, Nsight Compute, README): the kernel's speed followed its
// code size, which the instruction cache must hold (the mask policy's rare
// cases stay out of line and in loops: seq_mask.cuh), and its occupancy.
#pragma once

#include <cstdint>
#include <cmath>
#include <type_traits>
#include <cuda_runtime.h>

#include "seq_params.h"
#include "seq_mask.cuh"
#include "seq_walk.cuh"
#include "mma_utils.cuh"
#include "online_softmax.cuh"
#include "smem_tile.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "seq_band_fwd.cuh"

namespace gt_fused3s {

template <int kHeadDim>
struct SeqFwdConfig {
    static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128, "sequence head dim must be 32, 64 or 128");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kBlockRows = seq_block_rows(kHeadDim);
    static constexpr int kMTiles = kBlockRows / (16 * kWarps);   // m-tiles of 16 queries per warp
    static constexpr int kNT = kHeadDim / 8;      // n-tiles of O
    static constexpr int kSteps = kHeadDim / 16;  // k-steps of S
    // D = 64 on sm_90a: every tile on the warpgroup MMA (wgmma.cuh), whose
    // operands are the block's 64 queries (one m-tile a warp) and a stage's
    // K or V read straight from shared memory, 128-byte swizzled (the
    // ldmatrix reads of sm_80 take that layout too).
    static constexpr bool kWgmma = GT_WGMMA && kHeadDim == 64 && kBlockRows == 16 * kWarps;
    using Tile = std::conditional_t<kHeadDim == 64, Sw128Tile, RowTile<kHeadDim>>;
    // Shared memory: 2 stages x (K, V) x 4 slices of 16 keys (+ the slack to
    // align the swizzled stages to 1024 bytes).
    static constexpr int kSlices = kSeqTileKeys / 16;
    static_assert(kSlices == kWarps, "each warp copies one slice of a tile");
    static constexpr int kStageBytes = 2 * kSlices * Tile::kBytes;
    static constexpr int kAlign = kHeadDim == 64 ? 1024 : 16;
    static constexpr int kSmemBytes = 2 * kStageBytes + kAlign - 16;
    // On sm_90 (D = 64) the launch adds the block's Q tile after the stages
    // (64 rows, swizzled as K's): wgmma reads Q from shared memory, which
    // frees the 16 registers a thread held Q in (the kernel is at 128 and
    // spills). Only there: on an A100, 8 KB more a block would cost a
    // resident block.
    static constexpr int kQBytes = kHeadDim == 64 ? 64 * 128 : 0;
    // 4 blocks (128 registers; ptxas spilled about 100 bytes before Q moved
    // to shared memory on sm_90, 16 since; sm_80 still ~120) measured 5-15%
    // faster than 3 on an H100 at D = 64 (it was slower while the kernel's
    // code overflowed the instruction cache)
    static constexpr int kMinBlocks = kHeadDim <= 64 ? 4 : 2;
};

// kBandRuns (masks of local windows only, D = 64): the walk's own loop for
// a band's runs of full TMA tiles (seq_walk.cuh).
template <typename T, int kHeadDim, bool kBandRuns = false>
__global__ void __launch_bounds__(SeqFwdConfig<kHeadDim>::kThreads, SeqFwdConfig<kHeadDim>::kMinBlocks)
seq_fwd_kernel(const __grid_constant__ SeqFwdParams p, const __grid_constant__ SeqKvMaps maps) {
    using Cfg = SeqFwdConfig<kHeadDim>;
    using Tile = typename Cfg::Tile;
    constexpr int kNT = Cfg::kNT;
    constexpr int kM = Cfg::kMTiles;
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int head = blockIdx.y;

    SeqWindow blk;
    if (!seq_window(p, blockIdx.x, blk) || blk.rows == 0) return;   // block-uniform
    const SeqMask& mk = p.mask;

    const uint16_t* q = reinterpret_cast<const uint16_t*>(p.q_ptr) + head * p.q_head_stride;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(p.k_ptr) + head * p.k_head_stride;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(p.v_ptr) + head * p.v_head_stride;

    // Per m-tile of this warp (queries 16 (kM warp + i) ..): its sub-window,
    // Q as m16n8k16 A fragments (a0: row g, k 2t..2t+1; a1: row g+8; a2, a3:
    // k + 8), the O accumulator and the softmax state.
    SeqWindow win[kM];
    int64_t tok[kM][2];
    bool in[kM][2];
    uint32_t qa[kM][Cfg::kSteps][4];   // mma.sync only (wgmma reads Q from shared memory)
    float o[kM][kNT][4];
    SoftmaxState st[kM];
#pragma unroll
    for (int i = 0; i < kM; ++i) {
        win[i] = seq_sub_window(blk, kM * warp + i);
        in[i][0] = g < win[i].rows;
        in[i][1] = g + 8 < win[i].rows;
        tok[i][0] = blk.doc_start + win[i].base + static_cast<int64_t>(win[i].stride) * g;
        tok[i][1] = tok[i][0] + static_cast<int64_t>(win[i].stride) * 8;
        if constexpr (!Cfg::kWgmma) {
            const uint16_t* q0 = q + (in[i][0] ? tok[i][0] : 0) * p.q_row_stride + 2 * t;
            const uint16_t* q1 = q + (in[i][1] ? tok[i][1] : 0) * p.q_row_stride + 2 * t;
#pragma unroll
            for (int s = 0; s < Cfg::kSteps; ++s) {
                qa[i][s][0] = in[i][0] ? __ldg(reinterpret_cast<const unsigned int*>(q0 + 16 * s)) : 0u;
                qa[i][s][1] = in[i][1] ? __ldg(reinterpret_cast<const unsigned int*>(q1 + 16 * s)) : 0u;
                qa[i][s][2] = in[i][0] ? __ldg(reinterpret_cast<const unsigned int*>(q0 + 16 * s + 8)) : 0u;
                qa[i][s][3] = in[i][1] ? __ldg(reinterpret_cast<const unsigned int*>(q1 + 16 * s + 8)) : 0u;
            }
        }
#pragma unroll
        for (int j = 0; j < kNT; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
        softmax_init(st[i]);
    }

    const uint32_t smem0 = (smem_addr(smem) + Cfg::kAlign - 1) & ~static_cast<uint32_t>(Cfg::kAlign - 1);
    auto k_slice = [&](int stage, int slice) { return smem0 + stage * Cfg::kStageBytes + slice * Tile::kBytes; };
    auto v_slice = [&](int stage, int slice) {
        return smem0 + stage * Cfg::kStageBytes + (Cfg::kSlices + slice) * Tile::kBytes;
    };
    // wgmma descriptors of a stage's K (advanced along K by `bytes`) and of
    // its V slices, from one low word (wgmma.cuh)
    const uint32_t desc_lo = wgmma_desc_sw128_lo(smem0);
    auto k_desc = [&](int stage, int bytes) { return wgmma_desc_sw128_at(desc_lo, stage * Cfg::kStageBytes + bytes); };
    auto v_desc = [&](int stage, int slice) {
        return wgmma_desc_sw128_at(desc_lo, stage * Cfg::kStageBytes + (Cfg::kSlices + slice) * Tile::kBytes);
    };
    // Hopper: a tile of 64 consecutive keys of one segment (the inside of a
    // band) comes by TMA, K and V one bulk copy each from thread 0, counted
    // on its stage's mbarrier; other tiles (a segment's last, dilated or
    // global keys, zero-filled past the segment) by every warp's cp.async.
    __shared__ alignas(8) uint64_t kv_bar[2];
    uint32_t bar_phase = 0u;   // bit s: the parity of stage s's next bulk phase
    const bool tma = Cfg::kWgmma && maps.ok != 0;
    const uint32_t q_tile = smem0 + 2 * Cfg::kStageBytes;
    if constexpr (Cfg::kWgmma) {
        // warp w copies the 16 rows of its sub-window into rows 16 w .. of
        // the Q tile (zeros past the window), lane l chunks l % 8 of rows
        // l / 8 + 4 i
        const int ch = lane & 7;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = (lane >> 3) + 4 * i;
            const bool valid = r < win[0].rows;
            const int64_t row = valid ? blk.doc_start + win[0].base + static_cast<int64_t>(win[0].stride) * r : 0;
            cp_async_16(q_tile + Tile::at(16 * warp + r, 8 * ch), q + row * p.q_row_stride + 8 * ch, valid);
        }
        cp_async_commit();
        if (tma && threadIdx.x == 0) {
            mbar_init(smem_addr(&kv_bar[0]), 1);
            mbar_init(smem_addr(&kv_bar[1]), 1);
        }
        cp_async_wait<0>();
        fence_proxy_async_shared();   // wgmma reads Q through the async proxy
        __syncthreads();              // every warp's Q rows, and the mbarriers initialised, before any use
    }
    auto load_tile = [&](const SeqTile& c, int stage) {
        if constexpr (Cfg::kWgmma) {
            if (tma && c.ks.step == 1 && c.ks.count - c.tile * kSeqTileKeys >= kSeqTileKeys) {   // block-uniform
                if (threadIdx.x == 0) {
                    const uint32_t bar = smem_addr(&kv_bar[stage]);
                    const int32_t row = static_cast<int32_t>(blk.doc_start + c.ks.start + c.tile * kSeqTileKeys);
                    mbar_expect_tx(bar, 2 * kTmaTileBytes);
                    tma_load_rows(k_slice(stage, 0), maps.k, head, row, bar);
                    tma_load_rows(v_slice(stage, 0), maps.v, head, row, bar);
                }
                cp_async_commit();   // an empty group: the walk counts one group per tile
                return true;
            }
        }
        seq_load_kv<Tile>(k_slice(stage, warp), v_slice(stage, warp), k, p.k_row_stride, v, p.v_row_stride, mk, blk,
                          c, warp, lane);
        return false;
    };
    auto wait_bulk = [&](int stage) {
        mbar_wait(smem_addr(&kv_bar[stage]), (bar_phase >> stage) & 1u);
        bar_phase ^= 1u << stage;
    };
    // One tile: S = Q K^T, k-step by k-step over all pairs (independent mma
    // chains), the softmax step over its 64 keys, O += P V. A full tile (the
    // inside of a band: seq_tile_full for the whole block) takes no mask
    // bits, no per-pair branches and the scale folded into the exponent;
    // otherwise pairs no query of this warp sees are skipped (masked).
    auto tile_step = [&](auto full_tag, const SeqTile& cur, int stage) {
        constexpr bool kFull = decltype(full_tag)::value;
        constexpr uint32_t kAll = (1u << Cfg::kSlices) - 1u;
        uint32_t bits[kM][Cfg::kSlices], any = kAll;
        if constexpr (!kFull) {
            any = 0u;
#pragma unroll
            for (int i = 0; i < kM; ++i) {
                any |= seq_tile_bits(mk, win[i], cur.part, cur.ks, cur.tile * kSeqTileKeys, lane, bits[i]);
            }
        }
        float s[kM][Cfg::kSlices][2][4];
        // wgmma: every pair of the tile (a pair no query of a warp sees has
        // bits 0: its P is 0); mma.sync: the pairs the warp's queries see
        if constexpr (Cfg::kWgmma) {   // S [64, 64] = Q K^T: one warpgroup MMA a k-step
            float (&d)[32] = *reinterpret_cast<float (*)[32]>(&s[0][0][0][0]);
            wgmma_fence();
#pragma unroll
            for (int step = 0; step < Cfg::kSteps; ++step) {
                wgmma_m64n64k16_ss<T>(d, wgmma_desc_sw128_at(desc_lo, q_tile - smem0 + 32 * step), k_desc(stage, 32 * step),
                                      step > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands(d);
        } else {
#pragma unroll
            for (int i = 0; i < kM; ++i) {
#pragma unroll
                for (int sl = 0; sl < Cfg::kSlices; ++sl) {
                    s[i][sl][0][0] = s[i][sl][0][1] = s[i][sl][0][2] = s[i][sl][0][3] = 0.f;
                    s[i][sl][1][0] = s[i][sl][1][1] = s[i][sl][1][2] = s[i][sl][1][3] = 0.f;
                }
            }
#pragma unroll
            for (int step = 0; step < Cfg::kSteps; ++step) {
#pragma unroll
                for (int sl = 0; sl < Cfg::kSlices; ++sl) {
                    if (!kFull && !((any >> sl) & 1u)) continue;   // warp-uniform
                    uint32_t b[4];
                    Tile::bt_frags(b, k_slice(stage, sl), step, lane);
#pragma unroll
                    for (int i = 0; i < kM; ++i) {
                        mma_16816<T>(s[i][sl][0], qa[i][step], b[0], b[1]);
                        mma_16816<T>(s[i][sl][1], qa[i][step], b[2], b[3]);
                    }
                }
            }
        }
        uint32_t pa[kM][Cfg::kSlices][4];
#pragma unroll
        for (int i = 0; i < kM; ++i) {
            if constexpr (kFull) {
                online_softmax_full<T, kNT, Cfg::kSlices>(s[i], p.scale_log2, st[i], o[i], pa[i]);
            } else {
                auto no_bias = [](int, int, int, float v) { return v; };
                online_softmax_pairs<T, kNT, Cfg::kSlices>(s[i], bits[i], p.scale_log2, no_bias, no_bias, st[i], o[i],
                                                           pa[i]);
            }
        }
        if constexpr (Cfg::kWgmma) {   // O [64, 64] += P V: a k-step per slice of 16 keys
            float (&d)[32] = *reinterpret_cast<float (*)[32]>(&o[0][0][0]);
            wgmma_fence();
#pragma unroll
            for (int sl = 0; sl < Cfg::kSlices; ++sl) {
                wgmma_m64n64k16<T, true>(d, pa[0][sl], v_desc(stage, sl), true);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands(d);
        } else {
#pragma unroll
            for (int sl = 0; sl < Cfg::kSlices; ++sl) {
                if (!kFull && !((any >> sl) & 1u)) continue;
#pragma unroll
                for (int jj = 0; jj < kNT / 2; ++jj) {
                    uint32_t b[4];
                    Tile::b_frags(b, v_slice(stage, sl), jj, lane);
#pragma unroll
                    for (int i = 0; i < kM; ++i) {
                        mma_16816<T>(o[i][2 * jj], pa[i][sl], b[0], b[1]);
                        mma_16816<T>(o[i][2 * jj + 1], pa[i][sl], b[2], b[3]);
                    }
                }
            }
        }
    };
    seq_walk_tiles<Cfg::kWgmma, Cfg::kWgmma && kBandRuns, !kBandRuns>(mk, blk, Cfg::kBlockRows, load_tile, [&](const SeqTile& cur, int stage, bool full) {
        if (full) tile_step(std::true_type{}, cur, stage);
        else tile_step(std::false_type{}, cur, stage);
    }, wait_bulk);

    // O in the mma C layout: row g (c0, c1) and g + 8 (c2, c3), d = 8j + 2t, 2t+1.
#pragma unroll
    for (int i = 0; i < kM; ++i) {
        softmax_finish(st[i]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (!in[i][r]) continue;
            const float l = st[i].l[r];
            const float inv = l != 0.f ? 1.f / l : 0.f;   // a NaN l (NaN scores) stays NaN, as in the graph kernel
            uint32_t* dst = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.o_ptr) + tok[i][r] * p.o_row_stride +
                                                        head * p.o_head_stride + 2 * t);
#pragma unroll
            for (int j = 0; j < kNT; ++j) dst[4 * j] = TypeTraits<T>::pack(o[i][j][2 * r] * inv, o[i][j][2 * r + 1] * inv);
            if (t == 0) {
                p.lse_ptr[tok[i][r] * p.lse_row_stride + head * p.lse_head_stride] =
                    l != 0.f ? (st[i].m[r] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
            }
        }
    }
}

template <typename T, int kHeadDim>
void run_seq_fwd(const SeqFwdParams& params, cudaStream_t stream) {
    using Cfg = SeqFwdConfig<kHeadDim>;
    if (params.num_windows <= 0 || params.num_heads <= 0) return;
    if constexpr (kHeadDim == 64) {   // one local or dilated window on Hopper: the warp-specialised band kernel
        if (run_seq_band_fwd<T>(params, stream)) return;
    }
    int smem = Cfg::kSmemBytes;
    if constexpr (Cfg::kQBytes > 0) {   // Hopper: the Q tile (the kernel uses it where it is built with wgmma)
        int dev = 0, major = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        if (major == 9) smem += Cfg::kQBytes;
    }
    // The TMA's tensor maps where the kernel may use them (D = 64; compiled
    // for sm_90a it does; elsewhere they go unread).
    SeqKvMaps maps{};
    if constexpr (kHeadDim == 64) {
        const int64_t tokens = params.num_tokens, heads = params.num_heads;
        maps.ok = tma_encode_rows(&maps.k, params.k_ptr, tokens, heads, params.k_row_stride, params.k_head_stride) &&
                  tma_encode_rows(&maps.v, params.v_ptr, tokens, heads, params.v_row_stride, params.v_head_stride);
    }
    const dim3 grid(static_cast<unsigned>(params.num_windows), static_cast<unsigned>(params.num_heads));
    auto launch = [&](auto band_runs) {
        constexpr auto kernel = seq_fwd_kernel<T, kHeadDim, decltype(band_runs)::value>;
        set_max_dynamic_smem<kernel>(smem);   // D = 128 (an error shows at the launch)
        kernel<<<grid, Cfg::kThreads, smem, stream>>>(params, maps);
    };
    if constexpr (kHeadDim == 64) {   // masks of local windows only: the kernel with the band's loop
        if (seq_mask_local_only(params.mask)) return launch(std::true_type{});
    }
    launch(std::false_type{});
}

}  // namespace gt_fused3s
