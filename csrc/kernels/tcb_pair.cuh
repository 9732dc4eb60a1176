// Column indices and bitmap rows of one pair of consecutive TCBs, as every
// kernel over the BSB walks them: loaded one step ahead of use (PairRaw),
// then decoded into the per-thread shape of the mma tiles (PairMeta).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace gt_fused3s {

// Per-pair column/bitmap data as loaded (one step ahead of use).
struct PairRaw {
    int32_t c;     // cols[pair * 8 + (lane & 15)] (columns 0..7 of TCB a, then of TCB b), -1 = none
    uint4 wa, wb;  // bitmap of TCB a and b as 4 x 32-bit words (w0.lo, w0.hi, w1.lo, w1.hi)
};

// Per-pair data in the shape the tiles use.
struct PairMeta {
    int32_t colk[2];   // K row of this thread's column g in TCB a, b
    int32_t colv[4];   // V rows: cols 2t, 2t+1 of TCB a, then of TCB b
    uint32_t mask;     // see online_softmax_pair
};

__device__ __forceinline__ void load_pair_raw(PairRaw& r, const int32_t* __restrict__ cols,
                                              const uint4* __restrict__ bitmap, int tcb, int tcb_end, int lane) {
    const int idx = tcb * 8 + (lane & 15);
    r.c = idx < tcb_end * 8 ? __ldg(cols + idx) : -1;
    r.wa = tcb < tcb_end ? __ldg(bitmap + tcb) : make_uint4(0u, 0u, 0u, 0u);
    r.wb = tcb + 1 < tcb_end ? __ldg(bitmap + tcb + 1) : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ PairMeta decode_pair(const PairRaw& r, int lane) {
    const int g = lane >> 2, t = lane & 3;
    PairMeta m;
    m.colk[0] = __shfl_sync(0xffffffffu, r.c, g);
    m.colk[1] = __shfl_sync(0xffffffffu, r.c, 8 + g);
    m.colv[0] = __shfl_sync(0xffffffffu, r.c, 2 * t);
    m.colv[1] = __shfl_sync(0xffffffffu, r.c, 2 * t + 1);
    m.colv[2] = __shfl_sync(0xffffffffu, r.c, 8 + 2 * t);
    m.colv[3] = __shfl_sync(0xffffffffu, r.c, 9 + 2 * t);
    // Row g's bits of word 0 are bits 2L, 2L+1 (row g+8: same bits of word 1):
    // 32-bit half L / 16, shift 2L mod 32.
    const bool hi = lane >= 16;
    const int sh = (2 * lane) & 31;
    const uint32_t a0 = hi ? r.wa.y : r.wa.x, a1 = hi ? r.wa.w : r.wa.z;
    const uint32_t b0 = hi ? r.wb.y : r.wb.x, b1 = hi ? r.wb.w : r.wb.z;
    m.mask = ((a0 >> sh) & 3u) | (((a1 >> sh) & 3u) << 2) | (((b0 >> sh) & 3u) << 4) | (((b1 >> sh) & 3u) << 6);
    return m;
}

}  // namespace gt_fused3s
