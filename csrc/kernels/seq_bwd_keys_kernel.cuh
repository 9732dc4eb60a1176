// Sparse attention over sequences, backward by key blocks (Hopper, sm_90a,
// D = 64): FlashAttention-3's loop order on the sequence masks whose
// transpose is a mask of the same kinds (local, dilated and block-dilated
// parts: a local window's left and right sides swap). seq_bwd_kernel.cuh
// (by query blocks) serves every other case.
//
// Work decomposition. A block of 4 warps (one warpgroup) owns 64 keys of one
// head (the forward's row blocks, applied to keys) and walks the query tiles
// that see them with the forward's walk (seq_walk.cuh) over the transposed
// mask: rows are keys, a tile's 64 entries are queries. K and V of the block
// stay in shared memory; Q and dO of a tile come by TMA (64 consecutive
// queries) or cp.async, double buffered, with the tile's lse and delta
// (seq_bwd_prep: lse in log2 units and rowsum(dO O), 8 bytes a query, the
// same way). Per tile, on the warpgroup MMA (wgmma.cuh):
//   S^T [64 keys, 64 queries] = K Q^T,  dP^T = V dO^T    (both from shared memory)
//   P^T = exp2(S^T scale log2 e - lse), dS^T = P^T (dP^T - delta)   (registers)
//   dV += P^T dO,  dK += dS^T Q                           (P^T, dS^T from registers)
//   dQ [64 queries, 64] = dS K                            (dS^T through shared memory)
// dK and dV of the block's keys build up in registers and are written once,
// in the input dtype. dQ of the tile's queries is added to an fp32 buffer
// (other key blocks see the same queries; the caller zeroes and casts it):
// a TMA tile's as one bulk reduce-add from shared memory (thread 0, in
// flight while the next tile computes), other tiles' by 8-byte atomics.
// Masks of local windows only run a band's full tiles without the block
// barrier at each tile's end (band_run below: local 1M backward on an H100
// 3.75 -> 3.62 ms, README).
// Against the query blocks' kernel: no dK / dV buffers to zero, add to and
// cast, and four warps' MMAs at a time. README: measured, what was tried.
#pragma once

#include <cstdint>
#include <cmath>
#include <type_traits>
#include <cuda_runtime.h>

#include "seq_params.h"
#include "seq_mask.cuh"
#include "seq_walk.cuh"
#include "mma_utils.cuh"
#include "smem_tile.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace gt_fused3s {

// The TMA's tensor maps of one launch (tma.cuh): Q and dO rows, and the
// (lse, delta) pairs of each head (boxes of a tile's 64 queries).
struct SeqBwdKeysMaps {
    CUtensorMap q, dout, ld, dq;
    int32_t ok;   // 0: no maps (a layout TMA cannot describe): cp.async
};

struct SeqBwdKeysConfig {
    static constexpr int kThreads = 128;   // one warpgroup
    static constexpr int kRows = 64;       // keys per block (the forward's row blocks)
    using Tile = Sw128Tile;
    static constexpr int kTileBytes = 4 * Tile::kBytes;              // 64 rows of 64 16-bit elements
    static constexpr int kStageBytes = 2 * kTileBytes;               // Q and dO of a query tile
    // (lse2, delta) of a tile's queries, 8 bytes each: by TMA from the even
    // query at or before the first (a TMA box starts 16-byte aligned), so 66
    // of them, 128-byte aligned stages
    static constexpr int kLdBox = 2 * (kSeqTileKeys + 2);             // floats
    static constexpr int kLdBytes = (kLdBox * 4 + 127) / 128 * 128;
    // dQ of a tile (fp32) on its way to global memory by TMA: two halves of
    // 32 columns, 128-byte swizzled; two buffers, so that a tile's need not
    // wait for the last tile's reduction to have read its buffer
    static constexpr int kDqBytes = 64 * 64 * 4;
    // K, V, 2 dS^T (1024-byte aligned, 128-byte swizzled), 2 stages, 2 dQ,
    // then lse / delta (the second dS^T: a band's run, below)
    static constexpr int kSmemBytes = 4 * kTileBytes + 2 * kStageBytes + 2 * kDqBytes + 2 * kLdBytes + 1024 - 16;
    static constexpr int kMinBlocks = 2;
};

// The tile step's register work (the kernel's, and
// scripts/probe_bwd_keys_bound.cu's). The accumulators' layout: d[4j + e] =
// (key 16 warp + g (e < 2) or + 8, query 8j + 2t + (e & 1)).
//
// (lse2, delta) of the thread's queries 8j + 2t (x, y) and 8j + 2t + 1 (z, w).
__device__ __forceinline__ void seq_bwd_keys_read_ld(const float2* lds, int t, float4 (&ld)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 a = lds[8 * j + 2 * t], b = lds[8 * j + 2 * t + 1];
        ld[j] = make_float4(a.x, a.y, b.x, b.y);
    }
}

// One k-step of a score product with its A operand (the keys' K or V)
// either a 128-byte-swizzled tile in shared memory (its address) or the
// warp's A fragments in registers (seq_bwd_keys_a_frags: read once for a
// block's keys, not 2 KB a k-step every tile).
template <typename T, typename Desc>
__device__ __forceinline__ void seq_bwd_keys_score_step(float (&d)[32], uint32_t a_tile, Desc&& desc, int step,
                                                        uint64_t desc_b) {
    wgmma_m64n64k16_ss<T>(d, desc(a_tile + 32 * step), desc_b, step > 0);
}
template <typename T, typename Desc>
__device__ __forceinline__ void seq_bwd_keys_score_step(float (&d)[32], const uint32_t (&a_frags)[4][4], Desc&&,
                                                        int step, uint64_t desc_b) {
    wgmma_m64n64k16<T, false>(d, a_frags[step], desc_b, step > 0);
}

// S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries; Q, dO and, given as
// addresses, K, V 128-byte-swizzled tiles in shared memory; desc: the
// kernel's descriptor of a shared address), two commit groups so that P^T
// is computed while dP^T is in the MMA.
template <typename T, typename Desc, typename KV>
__device__ __forceinline__ void seq_bwd_keys_scores(float (&s)[32], float (&dp)[32], Desc&& desc, const KV& k,
                                                    uint32_t q_tile, const KV& v, uint32_t do_tile) {
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < 4; ++step) seq_bwd_keys_score_step<T>(s, k, desc, step, desc(q_tile + 32 * step));
    wgmma_commit();
#pragma unroll
    for (int step = 0; step < 4; ++step) seq_bwd_keys_score_step<T>(dp, v, desc, step, desc(do_tile + 32 * step));
    wgmma_commit();
}

// A 64-row Sw128Tile (keys x D = 64) as wgmma's A fragments for the warp's
// 16 rows, k-steps 0..3 (the m16n8k16 A layout: Sw128Tile::a_frag).
__device__ __forceinline__ void seq_bwd_keys_a_frags(uint32_t (&a)[4][4], uint32_t tile, int warp, int lane) {
#pragma unroll
    for (int step = 0; step < 4; ++step) Sw128Tile::a_frag(a[step], tile + warp * Sw128Tile::kBytes, step, lane);
}

// Column tile j of an accumulator (x0, x1: row g; x2, x3: row g + 8) rounded
// to T into the A fragments of k-step j / 2 (the C fragments of column tiles
// 2 sl and 2 sl + 1 are k-step sl's A fragment, mma_utils.cuh).
template <typename T>
__device__ __forceinline__ void seq_bwd_keys_pack_tile(uint32_t (&a)[4][4], int j, float x0, float x1, float x2,
                                                       float x3) {
    a[j >> 1][2 * (j & 1)] = TypeTraits<T>::pack(x0, x1);
    a[j >> 1][2 * (j & 1) + 1] = TypeTraits<T>::pack(x2, x3);
}

// P^T = exp2(S^T scale_log2 - lse2) where the mask bits give the pair
// (kFull: every pair), and as the A fragments of k-step sl (queries 16 sl ..:
// the C fragments of column tiles 2 sl and 2 sl + 1, mma_utils.cuh).
template <typename T, bool kFull>
__device__ __forceinline__ void seq_bwd_keys_probs(const float (&s)[32], const float4 (&ld)[8], const uint32_t (&bits)[4],
                                                   float scale_log2, float (&pv)[32], uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float lse2 = (e & 1) ? ld[j].z : ld[j].x;
            const bool on = kFull || ((bits[j >> 1] >> (4 * (j & 1) + e)) & 1u);
            pv[4 * j + e] = on ? fast_exp2(s[4 * j + e] * scale_log2 - lse2) : 0.f;
        }
        seq_bwd_keys_pack_tile<T>(pa, j, pv[4 * j], pv[4 * j + 1], pv[4 * j + 2], pv[4 * j + 3]);
    }
}

// dS^T = P^T (dP^T - delta) as A fragments (as seq_bwd_keys_probs').
template <typename T>
__device__ __forceinline__ void seq_bwd_keys_dscores(const float (&pv)[32], const float (&dp)[32], const float4 (&ld)[8],
                                                     uint32_t (&dsa)[4][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float dsv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) dsv[e] = pv[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? ld[j].w : ld[j].y));
        seq_bwd_keys_pack_tile<T>(dsa, j, dsv[0], dsv[1], dsv[2], dsv[3]);
    }
}

// An accumulator (rows 16 warp + g, + 8; columns 8 j + 2 t, + 1), times
// `scale`, as A fragments: what seq_bwd_keys_store_ds stores as a 64 x 64 tile.
template <typename T>
__device__ __forceinline__ void seq_bwd_keys_pack(const float (&c)[32], float scale, uint32_t (&a)[4][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        seq_bwd_keys_pack_tile<T>(a, j, scale * c[4 * j], scale * c[4 * j + 1], scale * c[4 * j + 2],
                                  scale * c[4 * j + 3]);
    }
}

// dS^T into shared memory at ds_at (rows: keys, Sw128Tile), for dQ = dS K:
// per k-step sl, the four 8x8 matrices of its A fragment (rows 16 warp +
// 8 (m & 1), columns 16 sl + 8 (m >> 1)), lane l giving row l % 8 of matrix l / 8.
__device__ __forceinline__ void seq_bwd_keys_store_ds(uint32_t ds_at, const uint32_t (&dsa)[4][4], int warp, int lane) {
#pragma unroll
    for (int sl = 0; sl < 4; ++sl) {
        const int m = lane >> 3;
        stmatrix_x4(ds_at + Sw128Tile::at(16 * warp + 8 * (m & 1) + (lane & 7), 16 * sl + 8 * (m >> 1)), dsa[sl]);
    }
}

// dQ, scaled, into the fp32 shared tile at dq_at for the bulk reduction: rows
// = queries 16 warp + g (+ 8), d = 8j + 2t, 2t + 1, in two halves of 32
// columns (a half tile apart; half j / 4), 16-byte chunk 2 (j % 4) + t / 2
// of a 128-byte row, swizzled.
__device__ __forceinline__ void seq_bwd_keys_store_dq(uint32_t dq_at, const float (&dq)[32], float scale, int warp,
                                                      int lane) {
    constexpr uint32_t half_bytes = SeqBwdKeysConfig::kDqBytes / 2;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp + g + 8 * r;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint32_t at = dq_at + (j >> 2) * half_bytes + row * 128 + (((2 * (j & 3) + (t >> 1)) ^ (row & 7)) << 4) +
                                8 * (t & 1);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(scale * dq[4 * j + 2 * r]),
                         "f"(scale * dq[4 * j + 2 * r + 1])
                         : "memory");
        }
    }
}

// dK (scaled) and dV of the thread's two key rows in the input dtype: rows
// row0 and row0 + 8 of a block of `rows` keys (those below), the tokens
// base + stride row.
template <typename T>
__device__ __forceinline__ void seq_bwd_keys_store_dkdv(const SeqBwdKeysParams& p, const float (&dk)[32],
                                                        const float (&dv)[32], int64_t base, int64_t stride, int row0,
                                                        int rows, int head, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row >= rows) continue;
        const int64_t tok = base + stride * row;
        const int64_t at = tok * p.grad_row_stride + head * p.grad_head_stride + 2 * t;
        uint32_t* dkr = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.dk_ptr) + at);
        uint32_t* dvr = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.dv_ptr) + at);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            dkr[4 * j] = TypeTraits<T>::pack(p.scale * dk[4 * j + 2 * r], p.scale * dk[4 * j + 2 * r + 1]);
            dvr[4 * j] = TypeTraits<T>::pack(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
    }
}

// __launch_bounds__ tells the host which code the device got: the full
// kernel where it was compiled for sm_90a, a trap elsewhere (smaller bound),
// read back by seq_bwd_keys_ready() through cudaFuncGetAttributes.
// kBandRuns (masks of local windows only): the walk's own loop for a band's
// runs of full TMA tiles (seq_walk.cuh).
template <typename T, bool kBandRuns = false>
__global__ void __launch_bounds__(GT_WGMMA ? SeqBwdKeysConfig::kThreads : 32, SeqBwdKeysConfig::kMinBlocks)
seq_bwd_keys_kernel(const __grid_constant__ SeqBwdKeysParams p, const __grid_constant__ SeqBwdKeysMaps maps) {
#if GT_WGMMA
    using Cfg = SeqBwdKeysConfig;
    using Tile = Cfg::Tile;
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int head = blockIdx.y;
    const SeqFwdParams& f = p.fwd;

    SeqWindow blk;   // the block's keys (rows of the transposed mask)
    if (!seq_window(f, blockIdx.x, blk) || blk.rows == 0) return;   // block-uniform
    const SeqMask& mk = f.mask;
    const SeqWindow win = seq_sub_window(blk, warp);   // this warp's 16 keys

    const uint16_t* q = reinterpret_cast<const uint16_t*>(f.q_ptr) + head * f.q_head_stride;
    const uint16_t* k = reinterpret_cast<const uint16_t*>(f.k_ptr) + head * f.k_head_stride;
    const uint16_t* v = reinterpret_cast<const uint16_t*>(f.v_ptr) + head * f.v_head_stride;
    const uint16_t* dout = reinterpret_cast<const uint16_t*>(p.do_ptr) + head * p.do_head_stride;

    const uint32_t smem0 = (smem_addr(smem) + 1023u) & ~1023u;
    const uint32_t k_tile = smem0, v_tile = smem0 + Cfg::kTileBytes, ds_tile = smem0 + 2 * Cfg::kTileBytes;
    auto q_slice = [&](int stage, int sl) { return smem0 + (4 + 2 * stage) * Cfg::kTileBytes + sl * Tile::kBytes; };
    auto do_slice = [&](int stage, int sl) { return smem0 + (5 + 2 * stage) * Cfg::kTileBytes + sl * Tile::kBytes; };
    const uint32_t dq_tile = smem0 + 4 * Cfg::kTileBytes + 2 * Cfg::kStageBytes;
    const uint32_t ld0 = dq_tile + 2 * Cfg::kDqBytes;
    uint32_t dq_buf = 0u;   // the dQ buffer of the next bulk tile
    const float2* ld_s = reinterpret_cast<const float2*>(smem + (ld0 - smem_addr(smem)));
    const uint32_t desc_lo = wgmma_desc_sw128_lo(smem0);
    auto desc = [&](uint32_t addr) { return wgmma_desc_sw128_at(desc_lo, addr - smem0); };

    // K and V of the block's keys: warp w copies rows 16 w .. (zeros past the
    // block), lane l chunk l % 8 of rows l / 8 + 4 i
    {
        const int ch = lane & 7;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = (lane >> 3) + 4 * i;
            const bool valid = r < win.rows;
            const int64_t row = valid ? blk.doc_start + win.base + static_cast<int64_t>(win.stride) * r : 0;
            const uint32_t at = Tile::at(16 * warp + r, 8 * ch);
            cp_async_16(k_tile + at, k + row * f.k_row_stride + 8 * ch, valid);
            cp_async_16(v_tile + at, v + row * f.v_row_stride + 8 * ch, valid);
        }
        cp_async_commit();
    }
    __shared__ alignas(8) uint64_t qdo_bar[2];
    uint32_t bar_phase = 0u;   // bit s: the parity of stage s's next bulk phase
    const bool tma = maps.ok != 0;
    if (tma && threadIdx.x == 0) {
        mbar_init(smem_addr(&qdo_bar[0]), 1);
        mbar_init(smem_addr(&qdo_bar[1]), 1);
    }
    cp_async_wait<0>();
    fence_proxy_async_shared();   // wgmma reads K and V through the async proxy
    __syncthreads();              // every warp's rows, and the mbarriers initialised

    // 64 consecutive queries: Q, dO and their (lse, delta) by TMA (thread 0,
    // on the stage's mbarrier: no block barrier); other tiles by cp.async
    auto bulk_tile = [&](const SeqTile& c) {
        return tma && c.ks.step == 1 && c.ks.count - c.tile * kSeqTileKeys >= kSeqTileKeys;   // block-uniform
    };
    auto first_query = [&](const SeqTile& c) {
        return static_cast<int32_t>(blk.doc_start + c.ks.start + c.tile * kSeqTileKeys);
    };
    // A tile's (lse2, delta) per query: thread i < 64 copies query i's (zeros past the segment)
    auto load_ld = [&](const SeqTile& c, int stage) {
        if (threadIdx.x < kSeqTileKeys) {
            const int32_t n = c.tile * kSeqTileKeys + threadIdx.x;
            const bool valid = n < c.ks.count;
            const int64_t tok = valid ? blk.doc_start + seg_key(mk, c.ks, n) : 0;
            cp_async_8(ld0 + stage * Cfg::kLdBytes + 8 * threadIdx.x, p.ld_ptr + head * p.ld_head_stride + 2 * tok,
                       valid);
        }
    };
    auto bulk_copy = [&](const SeqTile& c, int stage) {   // one thread
        const uint32_t bar = smem_addr(&qdo_bar[stage]);
        const int32_t row = first_query(c);
        mbar_expect_tx(bar, 2 * kTmaTileBytes + Cfg::kLdBox * 4);
        tma_load_rows(q_slice(stage, 0), maps.q, head, row, bar);
        tma_load_rows(do_slice(stage, 0), maps.dout, head, row, bar);
        tma_load_2d(ld0 + stage * Cfg::kLdBytes, maps.ld, 2 * (row & ~1), head, bar);
    };
    auto load_tile = [&](const SeqTile& c, int stage) {
        if (bulk_tile(c)) {
            if (threadIdx.x == 0) bulk_copy(c, stage);
            cp_async_commit();   // an empty group: the walk counts one group per tile
            return true;
        }
        load_ld(c, stage);
        seq_load_kv<Tile>(q_slice(stage, warp), do_slice(stage, warp), q, f.q_row_stride, dout, p.do_row_stride, mk,
                          blk, c, warp, lane);   // (commits the group, lse / delta included)
        return false;
    };
    auto wait_bulk = [&](int stage) {
        mbar_wait(smem_addr(&qdo_bar[stage]), (bar_phase >> stage) & 1u);
        bar_phase ^= 1u << stage;
    };

    float dk[32], dv[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;

    // A TMA tile's dQ (rows from `row`), from its shared buffer `at`: one
    // thread's bulk reduce-add into the fp32 buffer, in flight while the next tile computes
    auto reduce_dq = [&](int32_t row, uint32_t at) {
        tma_reduce_add_rows(maps.dq, 0, head, row, at);
        tma_reduce_add_rows(maps.dq, 32, head, row, at + Cfg::kDqBytes / 2);
        tma_commit();
    };
    // A band's run (band_run below): the tile whose dQ waits in its shared
    // buffer for thread 0's reduction (-1: none), and the dS^T buffer
    int32_t dq_pending = -1;
    uint32_t ds_buf = 0u;
    // thread 0: the pending tile's reduction (its dQ waits in the buffer before the next one's)
    auto reduce_pending = [&]() { reduce_dq(dq_pending, dq_tile + (dq_buf ^ 1u) * Cfg::kDqBytes); };
    // One tile; a full one (the inside of a band: every key of the block
    // sees every query of the tile) takes no mask bits. kRun: a tile of a
    // band's run, which ends without a block barrier (band_run below).
    auto tile_step = [&](auto full_tag, const SeqTile& cur, int stage, auto run_tag) {
        constexpr bool kFull = decltype(full_tag)::value;
        constexpr bool kRun = decltype(run_tag)::value;
        const uint32_t ds_at = kRun ? ds_tile + ds_buf * Cfg::kTileBytes : ds_tile;
        constexpr int kSlices = kSeqTileKeys / 16;
        uint32_t bits[kSlices];
        if constexpr (!kFull) seq_tile_bits(mk, win, cur.part, cur.ks, cur.tile * kSeqTileKeys, lane, bits);
        // S^T and dP^T: d[4j + e] = (key 16 warp + g (e < 2) or + 8, query 8j + 2t + (e & 1)),
        // two groups, so that P^T is computed while dP^T is in the MMA
        float s[32], dp[32];
        seq_bwd_keys_scores<T>(s, dp, desc, k_tile, q_slice(stage, 0), v_tile, do_slice(stage, 0));
        // (lse2, delta) of this thread's queries 8j + 2t, 8j + 2t + 1, read while the MMAs run
        // (a TMA tile's pairs start at its first query's parity)
        const float2* lds = ld_s + stage * (Cfg::kLdBytes / 8) + (bulk_tile(cur) ? first_query(cur) & 1 : 0);
        float4 ld[8];
        seq_bwd_keys_read_ld(lds, t, ld);
        wgmma_wait<1>();
        wgmma_fence_operands(s);
        uint32_t pa[kSlices][4], dsa[kSlices][4];
        float pv[32];
        seq_bwd_keys_probs<T, kFull>(s, ld, bits, f.scale_log2, pv, pa);
        // dV += P^T dO: k-step sl over queries 16 sl .. (B: rows = queries), while dS^T is computed
        wgmma_fence();
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl) wgmma_m64n64k16<T, true>(dv, pa[sl], desc(do_slice(stage, sl)), true);
        wgmma_commit();
        wgmma_wait<1>();   // dP^T (dV may still run)
        wgmma_fence_operands(dp);
        seq_bwd_keys_dscores<T>(pv, dp, ld, dsa);
        seq_bwd_keys_store_ds(ds_at, dsa, warp, lane);   // for dQ = dS K below
        fence_proxy_async_shared();   // dS^T, stored by every warp, read by wgmma
        if (threadIdx.x == 0) {
            // the reduction before the last has read its buffer (a run's last
            // one is not yet issued)
            if constexpr (kRun) tma_wait_read<0>();
            else tma_wait_read<1>();
        }
        __syncthreads();   // a run's: every warp also done with the last tile
        if constexpr (kRun) {
            if (threadIdx.x == 0 && dq_pending >= 0) reduce_pending();   // the last tile's dQ, stored by every warp
            ds_buf ^= 1u;
        }
        // dQ [64 queries, 64] = dS K: A = (dS^T)^T and B = K, both with rows = keys (k-step kk: keys 16 kk ..)
        float dq[32];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wgmma_m64n64k16_ss<T, true, true>(dq, desc(ds_at + kk * Tile::kBytes), desc(k_tile + kk * Tile::kBytes),
                                             kk > 0);
        }
        wgmma_commit();
        // dK += dS^T Q after dQ: it runs while dQ is stored (waited for before the stage can be refilled)
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl) wgmma_m64n64k16<T, true>(dk, dsa[sl], desc(q_slice(stage, sl)), true);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operands(dq);
        wgmma_fence_operands(dv);
        // dQ rows: queries 16 warp + g (+ 8) of the tile. A TMA tile's 64
        // consecutive rows: into the shared tile, whose reduction into dQ
        // thread 0 starts after the block's barrier (one bulk operation, in
        // flight while the next tile computes); other tiles by atomics.
        if (bulk_tile(cur)) {
            const uint32_t dq_at = dq_tile + dq_buf * Cfg::kDqBytes;
            dq_buf ^= 1u;
            seq_bwd_keys_store_dq(dq_at, dq, p.scale, warp, lane);
            wgmma_wait<0>();              // dK: its reads of the stage
            wgmma_fence_operands(dk);
            fence_proxy_async_shared();   // read by the bulk reduction
            if constexpr (kRun) {         // reduced after the next tile's (or the run's last) barrier
                dq_pending = first_query(cur);
                return true;
            }
            __syncthreads();              // (also every warp's last read of the stage: the walk's barrier)
            if (threadIdx.x == 0) reduce_dq(first_query(cur), dq_at);
            return true;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int32_t n = cur.tile * kSeqTileKeys + 16 * warp + g + 8 * r;
            if (n >= cur.ks.count) continue;
            const int64_t tok = blk.doc_start + seg_key(mk, cur.ks, n);
            float* dqr = p.dq_ptr + tok * p.grad_row_stride + head * p.grad_head_stride + 2 * t;
#pragma unroll
            for (int j = 0; j < 8; ++j) add_pair(dqr + 8 * j, p.scale * dq[4 * j + 2 * r], p.scale * dq[4 * j + 2 * r + 1]);
        }
        wgmma_wait<0>();   // dK: its reads of the stage, before the walk's barrier
        wgmma_fence_operands(dk);
        return false;
    };
    auto body = [&](const SeqTile& cur, int stage, bool full) {
        return full ? tile_step(std::true_type{}, cur, stage, std::false_type{})
                    : tile_step(std::false_type{}, cur, stage, std::false_type{});
    };
    if constexpr (kBandRuns) {
        // A band's run of full tiles without the block barrier at each
        // tile's end (one of the two a tile): each warp, done with a stage,
        // counts itself in, and the fourth to finish tile t copies tile t + 2
        // into that stage; tile t's dQ is reduced by thread 0 after tile
        // t + 1's barrier (every warp has stored it by then), and dS^T
        // alternates between two buffers (a warp may store tile t + 1's
        // while another's dQ MMA still reads tile t's).
        __shared__ uint32_t stage_done[2];
        if (threadIdx.x == 0) stage_done[0] = stage_done[1] = 0u;   // (the walk's first barrier comes before a run)
        auto band_run = [&](const SeqTile& first, int stage0, int32_t end) {
            const int32_t a = first.tile;
            if (threadIdx.x == 0) bulk_copy(SeqTile{first.part, a + 1, first.ks}, stage0 ^ 1);
            auto step = [&](auto stage_c, int32_t tile) {   // in stage kS (a constant: uniform descriptors)
                constexpr int kS = decltype(stage_c)::value;
                wait_bulk(kS);
                tile_step(std::true_type{}, SeqTile{first.part, tile, first.ks}, kS, std::true_type{});
                if (tile + 2 < end && lane == 0) {
                    // counts of a stage are in fours: tile + 2's come after its copy, after tile's fourth
                    uint32_t before;
                    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
                                 : "=r"(before) : "r"(smem_addr(&stage_done[kS])) : "memory");
                    if ((before & 3u) == 3u) bulk_copy(SeqTile{first.part, tile + 2, first.ks}, kS);
                }
            };
            int32_t tile = a;
            bool odd = stage0 == 1;
            while (tile < end) {
                if (!odd) {
                    step(std::integral_constant<int, 0>{}, tile);
                    if (++tile >= end) break;
                }
                odd = false;
                step(std::integral_constant<int, 1>{}, tile);
                ++tile;
            }
            __syncthreads();   // every warp done with both stages and dS^T buffers, the last dQ stored
            if (threadIdx.x == 0) reduce_pending();
            dq_pending = -1;
            ds_buf = 0u;
        };
        seq_walk_tiles<true, true, false>(mk, blk, Cfg::kRows, load_tile, body, wait_bulk, band_run);
    } else {
        seq_walk_tiles<true, false, false>(mk, blk, Cfg::kRows, load_tile, body, wait_bulk);
    }

    if (threadIdx.x == 0) tma_wait_all();   // the last reductions done before the block's shared memory goes

    // dK, dV of the block's keys (the warp's rows g, g + 8)
    seq_bwd_keys_store_dkdv<T>(p, dk, dv, blk.doc_start + win.base, win.stride, g, win.rows, head, t);
#else
    __trap();
#endif
}

// Whether this device runs the kernel: compiled for sm_90a (its launch bound,
// see above) and a Hopper GPU. Asked once per process and dtype; no device
// work, no synchronisation.
template <typename T>
bool seq_bwd_keys_ready() {
    static const bool ready = wgmma_kernel_runs(seq_bwd_keys_kernel<T>, SeqBwdKeysConfig::kThreads);
    return ready;
}

// The band backward (seq_band_bwd.cuh), which serves masks of one local
// window: true where it ran.
template <typename T>
bool run_seq_band_bwd(const SeqBwdKeysParams& params, cudaStream_t stream);

template <typename T>
void run_seq_bwd_keys(const SeqBwdKeysParams& params, cudaStream_t stream) {
    using Cfg = SeqBwdKeysConfig;
    if (params.fwd.num_windows <= 0 || params.fwd.num_heads <= 0) return;
    if (run_seq_band_bwd<T>(params, stream)) return;
    SeqBwdKeysMaps maps{};
    const SeqFwdParams& f = params.fwd;
    maps.ok = tma_encode_rows(&maps.q, f.q_ptr, f.num_tokens, f.num_heads, f.q_row_stride, f.q_head_stride) &&
              tma_encode_rows(&maps.dout, params.do_ptr, f.num_tokens, f.num_heads, params.do_row_stride,
                              params.do_head_stride) &&
              tma_encode_f32_rows(&maps.ld, params.ld_ptr, 2 * f.num_tokens, f.num_heads, params.ld_head_stride * 4,
                                  Cfg::kLdBox) &&
              tma_encode_f32_halves(&maps.dq, params.dq_ptr, f.num_tokens, f.num_heads, params.grad_row_stride,
                                    params.grad_head_stride);
    const dim3 grid(static_cast<unsigned>(f.num_windows), static_cast<unsigned>(f.num_heads));
    auto launch = [&](auto band_runs) {
        constexpr auto kernel = seq_bwd_keys_kernel<T, decltype(band_runs)::value>;
        set_max_dynamic_smem<kernel>(Cfg::kSmemBytes);   // (an error shows at the launch)
        kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, maps);
    };
    if (seq_mask_local_only(f.mask)) launch(std::true_type{});   // the band's loop
    else launch(std::false_type{});
}

}  // namespace gt_fused3s
