// Shared-memory tiles of 16 rows for the backward pass: asynchronous gathers
// of rows from global memory (cp.async, zero-filled for padding rows) and
// ldmatrix reads in the three operand shapes of m16n8k16.
//
// A tile holds a [16, kDW] slice of 16 rows, each row padded by 8 elements
// (16 bytes) so that the 8 row addresses of one ldmatrix hit 8 distinct
// 16-byte bank groups for every kDW in {16, 32, 64, 128}.
#pragma once

#include <atomic>
#include <cstdint>
#include <cuda_runtime.h>

namespace gt_fused3s {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Attribute kAttr of kernel kKernel set to `value` (the same at every call
// on a device) once per device: an attribute is the current device's, and
// cudaFuncSetAttribute at every launch was host time on every call, whose
// pace the host sets on small graphs. Host side, before a launch. (A
// cudaDeviceReset would clear them; nothing in the library or torch's
// normal use resets a device.)
template <auto kKernel, cudaFuncAttribute kAttr>
cudaError_t set_kernel_attribute(int value) {
    static std::atomic<uint64_t> done{0};   // bit d: set on device d (devices past 63: every call)
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0u;
    if ((done.load(std::memory_order_relaxed) & bit) != 0u) return cudaSuccess;
    err = cudaFuncSetAttribute(kKernel, kAttr, value);
    if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
    return err;
}

// Dynamic shared memory past the default 48 KB, opted in.
template <auto kKernel>
cudaError_t set_max_dynamic_smem(int bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return set_kernel_attribute<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

// Ask for the largest shared-memory share of the L1/shared split for a kernel
// whose resident warps need more than the driver's default choice gives
// (Nsight Compute: a grouped forward with edge terms built for 12 warps got
// 135 KB, room for 9).
template <auto kKernel>
cudaError_t prefer_max_shared() {
    return set_kernel_attribute<kKernel, cudaFuncAttributePreferredSharedMemoryCarveout>(cudaSharedmemCarveoutMaxShared);
}

// 16-byte global -> shared copy; valid == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

// 8-byte global -> shared copy (both 8-byte aligned); valid == false writes zeros.
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const int bytes = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Shared memory written by this thread's ordinary stores (cp.async
// included), made visible to the async proxy, through which Hopper's wgmma
// reads its shared-memory operands: before the barrier that precedes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
// Without .trans, lane (g, t) receives (row g, cols 2t, 2t+1) of each matrix;
// with .trans, (rows 2t, 2t+1, col g).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The inverse of ldmatrix_x4 (sm_90): lane l gives the row address of matrix
// l / 8, row l % 8; lane (g, t) holds (row g, cols 2t, 2t+1) of each matrix.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
#else
    __trap();
#endif
}

// The three m16n8k16 operand reads (ldmatrix) of a 16-row tile whose byte
// offsets Tile::at(row, col) gives (RowTile, Sw128Tile).
template <typename Tile>
struct TileReads {
    // A fragment (rows = M, cols = K) for k-step `step`: a0..a3 of m16n8k16.
    static __device__ __forceinline__ void a_frag(uint32_t (&a)[4], uint32_t tile, int step, int lane) {
        const int m = lane >> 3;
        ldmatrix_x4(a, tile + Tile::at((m & 1) * 8 + (lane & 7), 16 * step + 8 * (m >> 1)));
    }

    // B fragments of X^T for X = this tile (rows = N, cols = K), k-step `step`,
    // for both 8-row halves: b[0], b[1] of rows 0..7, b[2], b[3] of rows 8..15.
    static __device__ __forceinline__ void bt_frags(uint32_t (&b)[4], uint32_t tile, int step, int lane) {
        const int m = lane >> 3;
        ldmatrix_x4(b, tile + Tile::at((m >> 1) * 8 + (lane & 7), 16 * step + 8 * (m & 1)));
    }

    // B fragments of X for X = this tile (rows = K, cols = N), n-tiles 2jj and
    // 2jj + 1: b[0], b[1] of n-tile 2jj, b[2], b[3] of n-tile 2jj + 1.
    static __device__ __forceinline__ void b_frags(uint32_t (&b)[4], uint32_t tile, int jj, int lane) {
        const int m = lane >> 3;
        ldmatrix_x4_trans(b, tile + Tile::at((m & 1) * 8 + (lane & 7), 8 * (2 * jj + (m >> 1))));
    }
};

template <int kDW>
struct RowTile : TileReads<RowTile<kDW>> {
    static_assert(kDW == 16 || kDW == 32 || kDW == 64 || kDW == 128, "tile slice must be 16, 32, 64 or 128 wide");
    static constexpr int kRowElems = kDW + 8;             // padded row
    static constexpr int kBytes = 16 * kRowElems * 2;
    static constexpr int kChunksPerRow = kDW / 8;         // 16-byte chunks per row slice
    static constexpr int kChunksPerLane = 16 * kChunksPerRow / 32;

    // Byte offset of (row, col) in the tile.
    static __device__ __forceinline__ uint32_t at(int row, int col) {
        return static_cast<uint32_t>((row * kRowElems + col) * 2);
    }

    // Copy rows into two tiles at once (same rows of two tensors): tile row r
    // <- global row `row_of_lane` of lane r (r = 0..15; < 0: zeros). src1 / src2
    // point to element 0 of the slice in row 0 of each tensor.
    static __device__ __forceinline__ void load_async(uint32_t tile1, const uint16_t* src1, int64_t stride1,
                                                      uint32_t tile2, const uint16_t* src2, int64_t stride2,
                                                      int row_of_lane, int lane) {
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i) {
            const int c = lane + 32 * i;   // consecutive lanes copy consecutive chunks of a row
            const int r = c / kChunksPerRow, ch = c % kChunksPerRow;
            const int row = __shfl_sync(0xffffffffu, row_of_lane, r);
            const int64_t safe = row < 0 ? 0 : row;
            cp_async_16(tile1 + at(r, ch * 8), src1 + safe * stride1 + ch * 8, row >= 0);
            cp_async_16(tile2 + at(r, ch * 8), src2 + safe * stride2 + ch * 8, row >= 0);
        }
    }
};

// A [16, 64] slice of 16-bit rows of 128 bytes, unpadded, with the 128-byte
// swizzle of Hopper's wgmma operands (wgmma.cuh: 16-byte chunk c of row r at
// chunk c ^ (r % 8)), so that wgmma reads consecutive slices as one operand
// straight from shared memory; ldmatrix reads it too (the 8 rows of one 8x8
// matrix hit 8 distinct 16-byte bank groups). Slices start 1024-byte aligned
// (the swizzle is of address bits). RowTile's interface, as the sequence
// forward uses it.
struct Sw128Tile : TileReads<Sw128Tile> {
    static constexpr int kDW = 64;
    static constexpr int kBytes = 16 * 128;
    static constexpr int kChunksPerRow = 8;
    static constexpr int kChunksPerLane = 16 * kChunksPerRow / 32;
    static __device__ __forceinline__ uint32_t at(int row, int col) {
        return static_cast<uint32_t>(row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2);
    }
};

}  // namespace gt_fused3s
