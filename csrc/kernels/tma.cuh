// Hopper's tensor memory accelerator (TMA, sm_90a) for the sequence
// forward's key and value tiles: one thread copies a tile of 64 rows x 128
// bytes into shared memory, 128-byte swizzled as wgmma reads it (Sw128Tile,
// smem_tile.cuh), and an mbarrier counts its bytes in. With cp.async each of
// the block's 128 threads computed its rows' 64-bit addresses and issued its
// 16-byte copies for every tile: about a quarter of the instructions the
// forward issued per tile on a band (Nsight Compute, H200, README).
//
// Host: a tensor map per tensor ([T, H, 64] rows of 16-bit elements, as
// SeqFwdParams describes them), encoded per call (no device work; the driver
// entry point is looked up once). A tensor the TMA cannot describe (strides
// not multiples of 16 bytes, more than 2^31 rows) gets ok = 0: the kernel
// copies with cp.async, as on sm_80.
//
// Device code compiles to a trap outside sm_90a (GT_WGMMA, wgmma.cuh): the
// callers test kWgmma first.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <cuda_runtime.h>

#include "wgmma.cuh"

namespace gt_fused3s {

// The key and value tensor maps of one launch (kernel parameters: the TMA
// reads them from the parameter space).
struct SeqKvMaps {
    CUtensorMap k, v;
    int32_t ok;   // 0: no maps (not Hopper, or a layout TMA cannot describe): cp.async
};

constexpr int kTmaRows = 64;                        // rows of one copy (a tile of 64 keys)
constexpr uint32_t kTmaTileBytes = kTmaRows * 128;  // 64 rows of 64 16-bit elements

// The driver's cuTensorMapEncodeTiled (null where the driver lacks it),
// looked up once.
using TmaEncode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                               const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                               CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline TmaEncode tma_encode_fn() {
    static const TmaEncode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();   // not sticky: leave no error for the next launch check
            return static_cast<TmaEncode>(nullptr);
        }
        return reinterpret_cast<TmaEncode>(fn);
    }();
    return encode;
}

// Whether rows of 64 16-bit elements (`heads` a row, `tokens` rows) at
// `base` with these byte strides are a layout the TMA takes.
inline bool tma_rows_layout_ok(const void* base, int64_t tokens, int64_t heads, int64_t head_bytes, int64_t row_bytes) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && tokens > 0 && tokens < (int64_t(1) << 31) && heads > 0 &&
           head_bytes % 16 == 0 && row_bytes % 16 == 0 && head_bytes >= 128 && row_bytes >= head_bytes * heads &&
           row_bytes < (int64_t(1) << 40);
}

// The maps of rows of 64 16-bit elements (the two below): dims from 64
// elements of a head up, boxes of one head's 64 elements by kTmaRows rows
// of the last dim, 128-byte swizzle.
template <int kRank>
inline bool tma_encode_u16_rows(CUtensorMap* map, const void* start, const cuuint64_t (&dims)[kRank],
                                const cuuint64_t (&strides)[kRank - 1]) {
    const TmaEncode encode = tma_encode_fn();
    cuuint32_t box[kRank], elem[kRank];
    for (int i = 0; i < kRank; ++i) box[i] = elem[i] = 1;
    box[0] = 64;
    box[kRank - 1] = kTmaRows;
    return encode != nullptr &&
           encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, kRank, const_cast<void*>(start), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Rows of 64 16-bit elements: dims (64, heads, tokens), boxes of 64 x 1 x 64,
// 128-byte swizzle. False where the driver or the layout does not allow it.
inline bool tma_encode_rows(CUtensorMap* map, const void* base, int64_t tokens, int64_t heads, int64_t row_stride,
                            int64_t head_stride) {
    const int64_t head_bytes = heads == 1 ? 128 : head_stride * 2;   // a single head's stride is never stepped
    const int64_t row_bytes = row_stride * 2;
    if (!tma_rows_layout_ok(base, tokens, heads, head_bytes, row_bytes)) return false;
    const cuuint64_t dims[3] = {64, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(tokens)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_bytes), static_cast<cuuint64_t>(row_bytes)};
    return tma_encode_u16_rows<3>(map, base, dims, strides);
}

// The same rows seen as [positions, rate, heads, 64] (a token t at position
// t / rate of residue t % rate), residues first .. first + count - 1 of them:
// dims (64, heads, count, positions), boxes of 64 x 1 x 1 x 64, 64 rows
// `rate` apart, one residue (a dilated window's keys in their compacted
// order, seq_band_fwd.cuh); coordinate c of the residue dim is residue
// first + c. Every residue of the range must have as many positions among
// the tokens (else the map's last row would reach past the tensor for some):
// tokens % rate == 0 allows all of them at once, else residues below
// tokens % rate and the others make two maps. Rate 1, first 0, count 1 is
// tma_encode_rows' map with a dim of 1.
inline bool tma_encode_rate_rows(CUtensorMap* map, const void* base, int64_t tokens, int64_t heads, int64_t row_stride,
                                 int64_t head_stride, int64_t rate, int64_t first, int64_t count) {
    const int64_t head_bytes = heads == 1 ? 128 : head_stride * 2;
    const int64_t row_bytes = row_stride * 2;
    if (rate < 1 || first < 0 || count < 1 || first + count > rate ||
        !tma_rows_layout_ok(base, tokens, heads, head_bytes, row_bytes) || row_bytes * rate >= (int64_t(1) << 40)) {
        return false;
    }
    const int64_t positions = (tokens - first + rate - 1) / rate;   // residue first's
    if (positions < 1 || (tokens - (first + count - 1) + rate - 1) / rate != positions) return false;
    const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(count),
                                static_cast<cuuint64_t>(positions)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_bytes), static_cast<cuuint64_t>(row_bytes),
                                   static_cast<cuuint64_t>(row_bytes * rate)};
    return tma_encode_u16_rows<4>(map, static_cast<const char*>(base) + first * row_bytes, dims, strides);
}

// fp32 rows of `width` elements (`rows` of them, `row_bytes` apart, a
// multiple of 16), boxes of `box` x 1 elements (box * 4 a multiple of 16),
// unswizzled: the backward's per-query (lse, delta) pairs of one head. A box
// must start 16-byte aligned in its row (an odd pair's start faulted with an
// illegal instruction on an H200).
inline bool tma_encode_f32_rows(CUtensorMap* map, const float* base, int64_t width, int64_t rows, int64_t row_bytes,
                                int box) {
    const TmaEncode encode = tma_encode_fn();
    if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || width <= 0 || width >= (int64_t(1) << 32) ||
        rows <= 0 || rows > 65535 || row_bytes % 16 != 0 || row_bytes < width * 4 || row_bytes >= (int64_t(1) << 40)) {
        return false;
    }
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(width), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
    const cuuint32_t boxes[2] = {static_cast<cuuint32_t>(box), 1};
    const cuuint32_t elem[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(base), dims, strides, boxes, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// fp32 rows of 64 elements: dims (64, heads, tokens), boxes of 32 x 1 x 64
// (a half row each: the 128-byte swizzle's span), 128-byte swizzle: the
// backward's dQ tiles, reduced into global memory (tma_reduce_add_rows).
inline bool tma_encode_f32_halves(CUtensorMap* map, float* base, int64_t tokens, int64_t heads, int64_t row_stride,
                                  int64_t head_stride) {
    const TmaEncode encode = tma_encode_fn();
    const int64_t head_bytes = heads == 1 ? 256 : head_stride * 4, row_bytes = row_stride * 4;
    if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || tokens <= 0 ||
        tokens >= (int64_t(1) << 31) || heads <= 0 || head_bytes % 16 != 0 || row_bytes % 16 != 0 ||
        head_bytes < 256 || row_bytes < head_bytes * heads || row_bytes >= (int64_t(1) << 40)) {
        return false;
    }
    const cuuint64_t dims[3] = {64, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(tokens)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_bytes), static_cast<cuuint64_t>(row_bytes)};
    const cuuint32_t box[3] = {32, 1, kTmaRows};
    const cuuint32_t elem[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if GT_WGMMA
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
    __trap();
#endif
}

// A ring of kN stages (one thread, before the block's barrier): each
// "full" mbarrier completed by one arrival (the producer's, announcing its
// bytes), each "empty" one by `consumers` arrivals (the consumer warps').
template <int kN>
__device__ __forceinline__ void mbar_init_ring(uint64_t (&full)[kN], uint64_t (&empty)[kN], uint32_t consumers) {
#pragma unroll
    for (int s = 0; s < kN; ++s) {
        mbar_init(smem_addr(&full[s]), 1);
        mbar_init(smem_addr(&empty[s]), consumers);
    }
}

// The issuing thread's arrival, announcing `bytes` to come by TMA.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#if GT_WGMMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

// A thread's arrival (no bytes announced): a consumer releasing a stage.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if GT_WGMMA
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#else
    __trap();
#endif
}

// Until the phase of parity `parity` has completed (every byte announced landed).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if GT_WGMMA
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#else
    __trap();
#endif
}

// The producer's slot (items & 1) of a double buffer for its `items`-th
// item, once the consumers released the item two before it (counted on
// `empty`; the first two slots are free).
__device__ __forceinline__ int mbar_take_slot(uint64_t (&empty)[2], uint32_t items) {
    const int b = items & 1;
    if (items >= 2) mbar_wait(smem_addr(&empty[b]), ((items >> 1) - 1) & 1);
    return b;
}

// The end of a producer's items: a record without an item (head -1) in its
// next slot, published by an arrival on that slot's "full" mbarrier.
template <typename Record>
__device__ __forceinline__ void mbar_publish_end(Record (&published)[2], uint64_t (&full)[2], uint64_t (&empty)[2],
                                                 uint32_t items) {
    const int b = mbar_take_slot(empty, items);
    published[b].head = -1;
    mbar_arrive(smem_addr(&full[b]));
}

// Box (0, head, row) of `map` into shared memory at `dst` (1024-byte aligned),
// its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_rows(uint32_t dst, const CUtensorMap& map, int32_t head, int32_t row,
                                              uint32_t bar) {
#if GT_WGMMA
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(head), "r"(row), "r"(bar)
        : "memory");
#else
    __trap();
#endif
}

// Rows row .. row + 63 of residue first + `residue` (tokens rate row + first
// + residue ..) of a tma_encode_rate_rows map, head `head`, into shared memory at `dst`
// (1024-byte aligned), its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_rate_rows(uint32_t dst, const CUtensorMap& map, int32_t head, int32_t residue,
                                                   int32_t row, uint32_t bar) {
#if GT_WGMMA
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(0), "r"(head), "r"(residue), "r"(row), "r"(bar)
        : "memory");
#else
    __trap();
#endif
}

// Box (x, y) of a 2D `map` into shared memory at `dst` (128-byte aligned),
// its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap& map, int32_t x, int32_t y, uint32_t bar) {
#if GT_WGMMA
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(dst),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
#else
    __trap();
#endif
}

// Global box (x, head, row) of `map` += (kAdd) or = the shared tile at
// `src` (1024-byte aligned, laid out as the map's swizzle), asynchronously:
// one thread's bulk group (tma_commit; tma_wait_read before `src` is written
// again).
template <bool kAdd>
__device__ __forceinline__ void tma_write_rows(const CUtensorMap& map, int32_t x, int32_t head, int32_t row,
                                               uint32_t src) {
#if GT_WGMMA
    const uint64_t m = reinterpret_cast<uint64_t>(&map);
    if constexpr (kAdd) {
        asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                     ::"l"(m), "r"(x), "r"(head), "r"(row), "r"(src) : "memory");
    } else {
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                     ::"l"(m), "r"(x), "r"(head), "r"(row), "r"(src) : "memory");
    }
#else
    __trap();
#endif
}
__device__ __forceinline__ void tma_reduce_add_rows(const CUtensorMap& map, int32_t x, int32_t head, int32_t row,
                                                    uint32_t src) {
    tma_write_rows<true>(map, x, head, row, src);
}
__device__ __forceinline__ void tma_store_rows(const CUtensorMap& map, int32_t x, int32_t head, int32_t row,
                                               uint32_t src) {
    tma_write_rows<false>(map, x, head, row, src);
}
__device__ __forceinline__ void tma_commit() {
#if GT_WGMMA
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Until this thread's bulk groups but the newest kPending have read their
// shared-memory sources.
template <int kPending = 0>
__device__ __forceinline__ void tma_wait_read() {
#if GT_WGMMA
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Until this thread's bulk groups have completed (their writes made).
__device__ __forceinline__ void tma_wait_all() {
#if GT_WGMMA
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

}  // namespace gt_fused3s
