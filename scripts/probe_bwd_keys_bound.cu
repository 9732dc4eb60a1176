// What the backward by key blocks' tile step (seq_bwd_keys_kernel.cuh) can
// reach on this GPU with nothing else in the way: no loads (K, V, a Q and dO
// tile and their (lse, delta) resident in shared memory, values of no
// meaning), no mask, no dQ reduction into global memory, no walk. Blocks of
// one warpgroup (the kernel's: 64 keys, two blocks an SM), each looping the
// kernel's step with its own pieces (seq_bwd_keys_read_ld, _probs,
// _dscores, _store_ds, _store_dq): S^T = K Q^T and dP^T = V dO^T, P^T,
// dV += P^T dO, dS^T, dS^T through shared memory, the block's barrier,
// dQ = dS K, dK += dS^T Q, dQ's fp32 store to shared memory. It prints the
// rate counting the five products' flops, the kernel's "raw" rate (its
// tiles at a band's edges included); the kernel's own is in README.md.
//
//   nvcc -std=c++17 -O3 -Icsrc/kernels -arch=sm_90a -o /tmp/bwd_bound scripts/probe_bwd_keys_bound.cu
//   /tmp/bwd_bound
//
// Rows: two blocks an SM (the kernel's), one and three; without dQ (its
// product, dS^T's store and the barrier; the rate still counts five
// products); the products alone (P^T = S^T, dS^T = dP^T packed).
#include <cstdio>
#include <cstdint>
#include <cuda_fp16.h>
#include "mma_utils.cuh"
#include "smem_tile.cuh"
#include "seq_bwd_keys_kernel.cuh"
#include "wgmma.cuh"

using namespace gt_fused3s;

enum Mode { kWhole, kWithoutDq, kProductsOnly };

__device__ float probe_sink;

template <int kMode, int kBlocks>
__global__ void __launch_bounds__(128, kBlocks) bwd_keys_step_kernel(int iters, float sl2) {
#if GT_WGMMA
    using Tile = Sw128Tile;
    constexpr int kTile = 4 * Tile::kBytes;   // 64 rows x 64
    extern __shared__ __align__(16) unsigned char smem[];
    const uint32_t smem0 = (smem_addr(smem) + 1023u) & ~1023u;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    uint16_t* base = reinterpret_cast<uint16_t*>(smem + (smem0 - smem_addr(smem)));
    for (int i = threadIdx.x; i < 5 * kTile / 2; i += blockDim.x) base[i] = __half_as_ushort(__float2half(0.01f * ((i * 37) % 17 - 8)));
    const uint32_t k_tile = smem0, v_tile = smem0 + kTile, q_tile = smem0 + 2 * kTile, do_tile = smem0 + 3 * kTile,
                   ds_tile = smem0 + 4 * kTile, dq_tile = smem0 + 5 * kTile, ld0 = dq_tile + 64 * 64 * 4;
    float2* ld_w = reinterpret_cast<float2*>(smem + (ld0 - smem_addr(smem)));
    if (threadIdx.x < 64) ld_w[threadIdx.x] = make_float2(0.1f, 0.01f);
    fence_proxy_async_shared();
    __syncthreads();
    const uint32_t desc_lo = wgmma_desc_sw128_lo(smem0);
    auto desc = [&](uint32_t addr) { return wgmma_desc_sw128_at(desc_lo, addr - smem0); };
    const float2* lds = reinterpret_cast<const float2*>(smem + (ld0 - smem_addr(smem)));
    float dk[32], dv[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;
    float acc = 0.f;
    for (int it = 0; it < iters; ++it) {
        float s[32], dp[32];
        seq_bwd_keys_scores<__half>(s, dp, desc, k_tile, q_tile, v_tile, do_tile);
        float4 ld[8];
        seq_bwd_keys_read_ld(lds, t, ld);
        wgmma_wait<1>();
        wgmma_fence_operands(s);
        uint32_t pa[4][4], dsa[4][4];
        float pv[32];
        if constexpr (kMode == kProductsOnly) {   // P^T = S^T packed
#pragma unroll
            for (int i = 0; i < 32; ++i) pv[i] = s[i];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                pa[j >> 1][2 * (j & 1)] = TypeTraits<__half>::pack(pv[4 * j], pv[4 * j + 1]);
                pa[j >> 1][2 * (j & 1) + 1] = TypeTraits<__half>::pack(pv[4 * j + 2], pv[4 * j + 3]);
            }
        } else {
            const uint32_t bits[4] = {~0u, ~0u, ~0u, ~0u};
            seq_bwd_keys_probs<__half, true>(s, ld, bits, sl2, pv, pa);
        }
        wgmma_fence();
#pragma unroll
        for (int sl = 0; sl < 4; ++sl) wgmma_m64n64k16<__half, true>(dv, pa[sl], desc(do_tile + sl * Tile::kBytes), true);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operands(dp);
        if constexpr (kMode == kProductsOnly) {   // dS^T = dP^T packed
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                dsa[j >> 1][2 * (j & 1)] = TypeTraits<__half>::pack(dp[4 * j], dp[4 * j + 1]);
                dsa[j >> 1][2 * (j & 1) + 1] = TypeTraits<__half>::pack(dp[4 * j + 2], dp[4 * j + 3]);
            }
        } else {
            seq_bwd_keys_dscores<__half>(pv, dp, ld, dsa);
        }
        float dq[32];
        if constexpr (kMode != kWithoutDq) {
            seq_bwd_keys_store_ds(ds_tile, dsa, warp, lane);
            fence_proxy_async_shared();
            __syncthreads();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_m64n64k16_ss<__half, true, true>(dq, desc(ds_tile + kk * Tile::kBytes), desc(k_tile + kk * Tile::kBytes), kk > 0);
            wgmma_commit();
        }
#pragma unroll
        for (int sl = 0; sl < 4; ++sl) wgmma_m64n64k16<__half, true>(dk, dsa[sl], desc(q_tile + sl * Tile::kBytes), true);
        wgmma_commit();
        if constexpr (kMode != kWithoutDq) {
            wgmma_wait<1>();
            wgmma_fence_operands(dq);
            seq_bwd_keys_store_dq(dq_tile, dq, 1.f, warp, lane);
        }
        wgmma_wait<0>();
        wgmma_fence_operands(dk);
        wgmma_fence_operands(dv);
        if constexpr (kMode != kWithoutDq) __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) acc += dk[i] + dv[i];
    if (acc == 12345.f) probe_sink = acc;   // (keeps the loop)
#endif
}

template <int kMode, int kBlocks>
void run(const char* name, int sms) {
    const int iters = 4000, smem = 5 * 8192 + 16384 + 1024 + 1024;
    auto k = bwd_keys_step_kernel<kMode, kBlocks>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    k<<<sms * kBlocks, 128, smem>>>(10, 0.18f);
    cudaEventRecord(a);
    k<<<sms * kBlocks, 128, smem>>>(iters, 0.18f);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    const double flop = double(sms) * kBlocks * iters * (5 * 2.0 * 64 * 64 * 64);
    std::printf("%-16s %d blocks an SM: %7.3f ms, %6.1f TFLOP/s (five products' flops)  %s\n", name, kBlocks, ms, flop / ms / 1e9, cudaGetErrorString(cudaGetLastError()));
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
    printf("%s, %d SMs\n", prop.name, sms);
    for (int rep = 0; rep < 2; ++rep) {
        run<kWhole, 2>("the step", sms);
        run<kWhole, 1>("the step", sms);
        run<kWhole, 3>("the step", sms);
        run<kWithoutDq, 2>("without dQ", sms);
        run<kProductsOnly, 2>("products only", sms);
    }
    return 0;
}
