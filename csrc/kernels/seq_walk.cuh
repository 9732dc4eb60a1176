// The walk both sequence kernels (seq_fwd_kernel.cuh, seq_bwd_kernel.cuh)
// make over a row block's key tiles: 64 keys at a time, part by part and
// segment by segment (seq_mask.cuh: SeqTileCursor), the next tile's K and V
// copied into shared memory (cp.async, or the forward's TMA: tma.cuh; two
// stages) while this one computes.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>

#include "seq_mask.cuh"
#include "smem_tile.cuh"

namespace gt_fused3s {

// Warp `warp` copies keys 16 warp .. 16 warp + 15 of the tile under `c` (rows
// of k and v; zeros past the segment's end) into K and V slices of a stage.
// Lane l copies 16-byte chunk l % kChunksPerRow of the slice's rows
// l / kChunksPerRow + (32 / kChunksPerRow) i: a segment's rows are an
// arithmetic progression, so the lane's addresses are one product and adds
// (the global list's rows are looked up).
template <typename Tile>
__device__ __forceinline__ void seq_load_kv(uint32_t k_dst, uint32_t v_dst, const uint16_t* k, int64_t k_stride,
                                            const uint16_t* v, int64_t v_stride, const SeqMask& mk,
                                            const SeqWindow& blk, const SeqTile& c, int warp, int lane) {
    constexpr int kPerRow = Tile::kChunksPerRow, kRowsApart = 32 / kPerRow;
    const int ch = lane % kPerRow, r0 = lane / kPerRow;
    const int32_t n0 = c.tile * kSeqTileKeys + 16 * warp + r0;
    if (c.ks.step != 0) {   // uniform: keys start + step n, rows of a progression
        const int64_t tok0 = blk.doc_start + c.ks.start + static_cast<int64_t>(c.ks.step) * n0;
        const uint16_t* kp = k + tok0 * k_stride + 8 * ch;
        const uint16_t* vp = v + tok0 * v_stride + 8 * ch;
        const int64_t dk = static_cast<int64_t>(c.ks.step) * kRowsApart * k_stride;
        const int64_t dv = static_cast<int64_t>(c.ks.step) * kRowsApart * v_stride;
#pragma unroll
        for (int i = 0; i < Tile::kChunksPerLane; ++i) {   // past the segment: zeros, nothing read
            const bool valid = n0 + kRowsApart * i < c.ks.count;
            const uint32_t at = Tile::at(r0 + kRowsApart * i, 8 * ch);   // linear, or swizzled (Sw128Tile)
            cp_async_16(k_dst + at, kp + i * dk, valid);
            cp_async_16(v_dst + at, vp + i * dv, valid);
        }
    } else {   // the global list: its own rows
#pragma unroll
        for (int i = 0; i < Tile::kChunksPerLane; ++i) {
            const int32_t n = n0 + kRowsApart * i;
            const bool valid = n < c.ks.count;
            const int64_t tok = blk.doc_start + (valid ? mk.global_idx[n] : 0);
            const uint32_t at = Tile::at(r0 + kRowsApart * i, 8 * ch);
            cp_async_16(k_dst + at, k + tok * k_stride + 8 * ch, valid);
            cp_async_16(v_dst + at, v + tok * v_stride + 8 * ch, valid);
        }
    }
    cp_async_commit();
}

// load_kv(tile, stage) starts a tile's copy into `stage` and returns
// whether it came by TMA (one thread's bulk copy, counted on the stage's
// mbarrier: wait_bulk(stage) waits for it in every thread) rather than by
// every warp's cp.async (the block's barrier makes those visible);
// body(tile, stage, full) computes a tile whose K and V are in `stage`; every warp is
// done with a stage (the barrier after the body, unless the body returns
// true: it ended with one) before it is refilled.
// full: seq_tile_full for the whole block of `rows` queries (no mask bits
// needed). Uniform across the block. kAsyncReads: the body reads the stage
// through the async proxy (wgmma). kBulkRuns (load_kv brings a segment's
// full tiles in bulk when it brought the one before in bulk: the TMA of
// both sequence kernels on Hopper): a run of such tiles takes a loop of its
// own, unrolled over the two stages (constant stage offsets), without the
// cursor's bookkeeping or cp.async groups: the walk's below (the forward),
// or the caller's band_run (the backward by key blocks). The kernels instantiate it for
// masks of local windows only (seq_mask_local_only): its copies of the
// body cost the other masks' instruction cache more than they gain.
//
// kRandomSteps (SeqTileCursor::next): false in instances for masks without
// random parts (their code left out: registers).
//
// band_run (optional, with kBulkRuns): the caller's own loop over such a run,
// band_run(tile, stage, end) for tiles tile.tile .. end - 1 (full, whole in
// their segment, brought in bulk), the first loading into `stage` on entry;
// it returns with every stage free and no copy in flight. The backward by
// key blocks runs such tiles without a block barrier at their end there
// (seq_bwd_keys_kernel.cuh).
struct SeqNoBandRun {};

template <bool kAsyncReads = false, bool kBulkRuns = false, bool kRandomSteps = true, typename LoadKV, typename Body,
          typename WaitBulk, typename BandRun = SeqNoBandRun>
__device__ __forceinline__ void seq_walk_tiles(const SeqMask& mk, const SeqWindow& blk, int32_t rows, LoadKV&& load_kv,
                                               Body&& body, WaitBulk&& wait_bulk, BandRun&& band_run = BandRun{}) {
    constexpr bool kOwnRuns = !std::is_same_v<std::decay_t<BandRun>, SeqNoBandRun>;
    static_assert(kBulkRuns || !kOwnRuns, "band_run takes runs of bulk tiles");
    SeqTileCursor cur;
    bool more = cur.first(mk, blk);
    bool bulk = more && load_kv(cur.at(), 0);
    int stage = 0;
    while (more) {
        if constexpr (kOwnRuns) {
            const int32_t end = min(cur.full_hi, cur.ks.count / kSeqTileKeys);   // full and whole: bulk copies
            if (bulk && cur.full_known && blk.rows == rows && cur.tile >= cur.full_lo && cur.tile + 1 < end) {
                band_run(cur.at(), stage, end);
                cur.tile = end - 1;
                more = cur.template next<kRandomSteps>(mk, blk);
                bulk = more && load_kv(cur.at(), stage);
                continue;
            }
        } else if constexpr (kBulkRuns) {
            // invariant, as in the loop below: cur's tile is loading into `stage` (in bulk when `bulk`)
            auto run_step = [&](auto stage_c) {   // one tile of the run; false: the run ended
                constexpr int kStage = decltype(stage_c)::value;
                if (cur.tile < cur.full_lo || cur.tile >= cur.full_hi) return false;   // this tile and the next full
                const bool next_bulk = load_kv(SeqTile{cur.part, cur.tile + 1, cur.ks}, kStage ^ 1);
                wait_bulk(kStage);
                if constexpr (std::is_void_v<decltype(body(cur.at(), kStage, true))>) {
                    body(cur.at(), kStage, true);
                    __syncthreads();
                } else if (!body(cur.at(), kStage, true)) {
                    __syncthreads();
                }
                ++cur.tile;
                stage = kStage ^ 1;
                bulk = next_bulk;
                return next_bulk;
            };
            if (bulk && cur.full_known && blk.rows == rows) {
                while ((stage == 1 || run_step(std::integral_constant<int, 0>{})) &&
                       run_step(std::integral_constant<int, 1>{})) {
                }
            }
        }
        SeqTileCursor nxt = cur;
        const bool has_next = nxt.template next<kRandomSteps>(mk, blk);
        bool next_bulk = false;
        if (has_next) {
            next_bulk = load_kv(nxt.at(), stage ^ 1);   // flies while this tile computes
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        const bool full = seq_cursor_full(mk, blk, rows, cur);
        if (bulk) {
            wait_bulk(stage);
        } else {
            if constexpr (kAsyncReads) fence_proxy_async_shared();
            __syncthreads();
        }
        // (a body that returns true ended with a block barrier after its last read of the stage)
        if constexpr (std::is_void_v<decltype(body(cur.at(), stage, full))>) {
            body(cur.at(), stage, full);
            __syncthreads();
        } else if (!body(cur.at(), stage, full)) {
            __syncthreads();
        }
        cur = nxt;
        more = has_next;
        bulk = next_bulk;
        stage ^= 1;
    }
}

}  // namespace gt_fused3s
