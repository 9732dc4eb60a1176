// The walk both sequence kernels (seq_fwd_kernel.cuh, seq_bwd_kernel.cuh)
// make over a row block's key tiles: 64 keys at a time, part by part and
// segment by segment (seq_mask.cuh: SeqTileCursor), the next tile's K and V
// copied into shared memory (cp.async, two stages) while this one computes.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "seq_mask.cuh"
#include "smem_tile.cuh"

namespace gt_fused3s {

// Warp `warp` copies keys 16 warp .. 16 warp + 15 of the tile under `c` (rows
// of k and v; zeros past the segment's end) into K and V slices of a stage.
template <typename Tile>
__device__ __forceinline__ void seq_load_kv(uint32_t k_dst, uint32_t v_dst, const uint16_t* k, int64_t k_stride,
                                            const uint16_t* v, int64_t v_stride, const SeqMask& mk,
                                            const SeqWindow& blk, const SeqTileCursor& c, int warp, int lane) {
    const int32_t n = c.tile * kSeqTileKeys + 16 * warp + (lane & 15);
    const int row = (lane < 16 && n < c.ks.count) ? static_cast<int>(blk.doc_start + seg_key(mk, c.ks, n)) : -1;
    Tile::load_async(k_dst, k, k_stride, v_dst, v, v_stride, row, lane);
    cp_async_commit();
}

// load_kv(cursor, stage) starts a tile's copy into `stage`; body(cursor,
// stage) computes a tile whose K and V are in `stage`, between two block
// barriers (every warp's copy has landed before it; every warp is done with
// the stage before it is refilled). Uniform across the block.
template <typename LoadKV, typename Body>
__device__ __forceinline__ void seq_walk_tiles(const SeqMask& mk, const SeqWindow& blk, LoadKV&& load_kv,
                                               Body&& body) {
    SeqTileCursor cur;
    bool more = cur.first(mk, blk);
    if (more) load_kv(cur, 0);
    int stage = 0;
    while (more) {
        SeqTileCursor nxt = cur;
        const bool has_next = nxt.next(mk, blk);
        if (has_next) {
            load_kv(nxt, stage ^ 1);   // flies while this tile computes
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        body(cur, stage);
        __syncthreads();
        cur = nxt;
        more = has_next;
        stage ^= 1;
    }
}

}  // namespace gt_fused3s
