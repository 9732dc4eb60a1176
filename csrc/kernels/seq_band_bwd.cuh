// Sparse attention over sequences, backward of a mask of one local window
// (Hopper, sm_90a, D = 64): the backward by key blocks
// (seq_bwd_keys_kernel.cuh, whose register pieces it calls) with the band
// forward's block shape (seq_band_fwd.cuh): warp specialisation, a ring of
// copies, 128 keys a block. run_seq_bwd_keys calls it first; other masks
// keep that kernel.
//
// Why (README, "the backward by key blocks' tile step"): there a block of
// one warpgroup owns 64 keys and copies each query tile's Q, dO and (lse,
// delta) itself, one tile ahead; the copies cost it 9-10% at 1.6M tokens.
// Here a block of three warpgroups (384 threads, one block an SM, as many
// blocks as SMs) walks work items: a pair of the forward's 64-row blocks,
// applied to keys (2 g, 2 g + 1: 128 keys; SeqBandPair), and a head.
// Warpgroup 0 is the producer: one thread takes the next item from a
// counter in global memory (SeqBwdKeysParams::item_counter), copies its K
// and V (two buffers: the next item's arrive while this one computes) and
// then, tile after tile, 64 consecutive queries' Q, dO and (lse, delta)
// into a ring of three stages by TMA, each counted on its "full" mbarrier,
// refilled once every consumer warp arrived on its "empty" one. So one copy
// of a query tile serves 128 keys, and the copies run up to three tiles
// ahead. Consumer c (warpgroup c + 1) owns keys 64 c .. 64 c + 63 of the
// pair and runs the other kernel's tile step on its own (its own dS^T and
// dQ buffers, barriers of its 128 threads; its keys' K and V as the
// scores' A fragments in registers, read once an item: 0.4-1.9%):
//   S^T = K Q^T, dP^T = V dO^T, P^T, dV += P^T dO, dS^T, dQ = dS K, dK += dS^T Q
// with dQ reduced into global memory by one bulk operation of its thread 0.
// A tile none of a consumer's keys sees (its band's first or last, or the
// other document's where the pair spans two) it releases unread. The two
// consumers take turns to issue their scores (two named barriers, below),
// so that one's softmax tends to run beside the other's products rather
// than both at once (README: the turns 4-5% faster at 1M-8M tokens).
// Against seq_bwd_keys_kernel (H100, README): 3-5% faster at 1M-8M tokens
// (12% at 65k) before the turns.
// Tried, not kept: the two consumers summing dQ over the 128 keys before
// one reduction (dQ's columns split between them, K in 64-byte-swizzled
// halves for wgmma's n32, a 256-thread barrier a tile): 2-4% slower than
// the other kernel, the consumers in lockstep; a tile's reduction issued
// after the next tile's barrier (one barrier a tile): 4-7% slower; each
// block striding the items instead of the counter: 2% slower at 1M tokens,
// 8-12% from 1.6M on (blocks drift apart over the pairs, whose queries and
// dQ rows overlap in L2); a block an item (GT_FUSED3S_SEQ_BAND_BWD=g): 1-3%
// faster from 1.6M on, 7-14% slower near 100k tokens (with the turns 3-6%
// slower from 1M on); each warp reducing its own 16 rows of dQ (no barrier
// after the dQ stores): no gain. With the turns (README, "the band
// backward's turns"): dQ stores without bank conflicts (lanes of odd rows
// storing column group j ^ 2): 1-3% slower; a reducer thread a consumer in
// place of its thread 0 and second barrier: 4-5% slower; other places for
// the turns: no better; (lse, delta) read before the turn and the record's
// fields kept in registers (where Nsight Compute's stall samples were): no
// change; the next tile's scores issued in a tile's tail, behind dQ and dK
// (README, "two pipelined tile steps"): 15-17% slower (the consumers in
// lockstep through their turns), 9-13% without the turns. Before the turns:
// consumer 0 storing dQ and consumer 1 adding its own before one reduction
// by a producer-warpgroup thread (half the L2 traffic): 21-25% slower.
// README, "the band backward's dQ": dQ added to global memory from
// registers (red.global.add.v2.f32, no dQ tiles or second barrier): 29-37%
// slower; dQ summed over the pair per warp, the second of the pair's warps
// to arrive adding the first's rows and reducing 16 rows: 46-54% slower.
// There too: steps of 128 queries with each consumer's dQ of 64 of them
// over the pair's 128 keys (FlashAttention-3's shape, one barrier between
// the consumers a step): 12-19% slower; and what each part of the tile
// step costs (timing probes). README, "dQ zeroed and cast inside the band
// backward": dQ's scratch zeroed by segments that producers claim (flags)
// and cast by finisher warps once every pair that reaches its rows is
// done (flags), in place of the fill and cast kernels: correct, 9-22%
// slower (those kernels are 3% of forward + backward). README, "six more
// band-backward forms": dK / dV per warp through the item's K / V tiles
// (no barrier): 0.9-1.2% slower; the edge tiles one consumer does not see
// taking no turn (consumer 1 a tile behind): up to 2.2% slower; four stages
// with one dS^T buffer a consumer: no change; a summer (the producer
// warpgroup's other warps) adding both consumers' dQ before one reduction:
// 2.3-4.6% slower; dK / dV written in the next item's first tile beside
// its scores: 20-26% slower where ptxas serialised the wgmmas (C7518, a
// branch touching accumulators while the scores were in flight), spills
// at 232 registers otherwise.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#include "seq_band_fwd.cuh"
#include "seq_bwd_keys_kernel.cuh"

namespace gt_fused3s {

struct SeqBandBwdMaps {
    CUtensorMap q, dout, ld, dq, k, v, dk, dv;
};

struct SeqBandBwdConfig {
    static constexpr int kConsumers = 2;   // warpgroups of 64 keys
    static constexpr int kThreads = 128 * (kConsumers + 1);
    static constexpr int kStages = 3;
    // an item's K, then V (64 rows of each consumer, 128-byte swizzled)
    static constexpr uint32_t kKvBytes = 4 * kTmaTileBytes;
    // a stage: Q, dO (64 queries), then their (lse2, delta) (SeqBwdKeysConfig's box)
    static constexpr uint32_t kStageBytes = (2 * kTmaTileBytes + SeqBwdKeysConfig::kLdBytes + 1023) / 1024 * 1024;
    static constexpr uint32_t kDsBytes = kTmaTileBytes;              // a consumer's dS^T (64 keys x 64 queries)
    static constexpr uint32_t kDqBytes = SeqBwdKeysConfig::kDqBytes;   // a consumer's fp32 dQ tile (two halves)
    // two K / V buffers, the stages, two dS^T and two dQ tiles a consumer, the alignment
    static constexpr int kSmemBytes = 2 * kKvBytes + kStages * kStageBytes + 2 * kConsumers * (kDsBytes + kDqBytes) + 1024;
    // setmaxnreg: the block holds 168 x 384 = 64,512 registers; 40 x 128 +
    // 232 x 256 of them. The consumers' code needs no more than 232 (no
    // spills; at 224 it spills), and the producer's thread then keeps its
    // values in registers, not local memory (README, "dQ zeroed and cast
    // inside the band backward", its setmaxnreg part: 0.3-1.5% faster than
    // 24 / 240).
    static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
    static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 168 * kThreads, "setmaxnreg's pool");
    // named barriers: 0 the block's, 1 + c consumer c's (its 128 threads),
    // 3 + c consumer c's turn to issue its scores (both consumers' 256)
    static constexpr int kOwnBarrier = 1, kTurnBarrier = 3;
};
static_assert(SeqBandBwdConfig::kSmemBytes <= 227 * 1024, "the band backward's shared memory: an SM's");

// An item's two key blocks (the forward's 64-row windows 2 g, 2 g + 1 of
// the transposed mask, rate 1) and the passes over their queries: one where
// both lie in one document, else one each. A block's queries (positions)
// are [wkb, wke); a pass's tiles are 64 queries from its first block's wkb.
struct SeqBandPair {
    SeqBandWindow win[2];
    bool has[2];
    int32_t wkb[2], wke[2];
    int pass_of[2];                // -1: no keys
    int32_t first[2], kbeg[2];     // per pass: the token of position 0, its first query
    int end0, ntiles;              // pass 0's tiles, then pass 1's

    GT_SEQ_HD bool find(const SeqFwdParams& p, int64_t g, int32_t left, int32_t right) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            has[c] = seq_band_window(p, 2 * g + c, 1, win[c]);
            wkb[c] = has[c] ? seq_max(0, win[c].base - left) : 0;
            wke[c] = has[c] ? static_cast<int32_t>(seq_min64(win[c].len, int64_t(win[c].base) + win[c].rows + right)) : 0;
        }
        if (!has[0] && !has[1]) return false;
        const bool one = !has[0] || !has[1] || win[0].first == win[1].first;
        pass_of[0] = has[0] ? 0 : -1;
        pass_of[1] = has[1] ? (one ? 0 : 1) : -1;
        const int c0 = has[0] ? 0 : 1;   // pass 0's first block
        first[0] = win[c0].first;
        kbeg[0] = wkb[c0];
        const int32_t end_a = has[1] && one ? wke[1] : wke[c0];
        end0 = (end_a - kbeg[0] + kSeqTileKeys - 1) / kSeqTileKeys;
        first[1] = one ? 0 : win[1].first;
        kbeg[1] = one ? 0 : wkb[1];
        ntiles = end0 + (one ? 0 : (wke[1] - wkb[1] + kSeqTileKeys - 1) / kSeqTileKeys);
        return true;
    }
};

// The item as the producer found it, published in shared memory beside its
// K / V buffer (written before the buffer's "full" arrival). head < 0: no
// more items.
struct SeqBandBwdItem {
    int32_t head, ntiles, end0;
    int32_t first[2], kbeg[2];                    // per pass
    int32_t pass_of[2], wkb[2], wke[2];           // per key block (consumer)
    int32_t base[2], rows[2], len[2], wfirst[2];  // per key block: SeqBandWindow's

    GT_SEQ_HD void set(const SeqBandPair& pr, int32_t h) {
        head = h;
        ntiles = pr.ntiles;
        end0 = pr.end0;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            first[c] = pr.first[c];
            kbeg[c] = pr.kbeg[c];
            pass_of[c] = pr.pass_of[c];
            wkb[c] = pr.wkb[c];
            wke[c] = pr.wke[c];
            base[c] = pr.win[c].base;
            rows[c] = pr.has[c] ? pr.win[c].rows : 0;
            len[c] = pr.win[c].len;
            wfirst[c] = pr.win[c].first;
        }
    }
    // whether key block c sees a query of the tile at `ks` of pass `ps`
    GT_SEQ_HD bool live(int c, int ps, int32_t ks) const {
        return pass_of[c] == ps && ks < wke[c] && ks + kSeqTileKeys > wkb[c];
    }
};

// Whether the band backward serves the (transposed) mask: one local window
// (the kernel's rate 1).
GT_SEQ_HD bool seq_band_bwd_takes(const SeqMask& mk) {
    return mk.num_parts == 1 && mk.parts[0].kind == kSeqLocal && mk.row_stride == 1 && mk.parts[0].a >= 0 &&
           mk.parts[0].b >= 0;
}

// Whether a tile (queries ks .. ks + 63) needs no mask bits for a block of
// `rows` keys from position k0 (the transposed window: key j sees queries
// j - left .. j + right of its document of `len` tokens): all 64 keys see
// all 64 queries.
GT_SEQ_HD bool seq_band_bwd_full(int32_t rows, int32_t k0, int32_t ks, int32_t left, int32_t right, int32_t len) {
    return rows == 64 && ks >= k0 + 63 - left && int64_t(ks) + 63 <= int64_t(k0) + right && ks + kSeqTileKeys <= len;
}

// The mask bits of a tile (queries ks .. ks + 63 of a document of `len`
// tokens) for the thread's keys row_a, row_a + 8 (positions; rows_end: the
// block's last + 1) in seq_bwd_keys_probs' layout: query i and key j pair
// where i - j + left in [0, width] (the transposed window).
GT_SEQ_HD void seq_band_bwd_bits(int32_t ks, int32_t row_a, int32_t rows_end, int32_t len, int32_t left,
                                 uint32_t width, int t, uint32_t (&bits)[4]) {
#pragma unroll
    for (int sl = 0; sl < 4; ++sl) bits[sl] = 0u;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int32_t query = ks + 8 * j + 2 * t + (e & 1), row = row_a + 8 * (e >> 1);
            const bool on = query < len && row < rows_end &&
                            static_cast<uint32_t>(query - row) + static_cast<uint32_t>(left) <= width;
            bits[j >> 1] |= static_cast<uint32_t>(on) << (4 * (j & 1) + e);
        }
    }
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// __launch_bounds__ tells the host which code the device got (as
// seq_bwd_keys_kernel). Persistent: block b runs item b, then those the
// counter gives (gridDim.x on), or without one b + gridDim.x, ... (an item:
// a pair and a head, pair-major). The consumers read each item from its
// record (SeqBandBwdItem) and stop at one without an item.
template <typename T>
__global__ void __launch_bounds__(GT_WGMMA ? SeqBandBwdConfig::kThreads : 32, 1)
seq_band_bwd_kernel(const __grid_constant__ SeqBwdKeysParams p, const __grid_constant__ SeqBandBwdMaps maps,
                    int64_t num_pairs) {
#if GT_WGMMA
    using Cfg = SeqBandBwdConfig;
    constexpr int kStages = Cfg::kStages;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ alignas(8) uint64_t full_bar[kStages], empty_bar[kStages], kv_full[2], kv_empty[2];
    __shared__ SeqBandBwdItem published[2];   // the item of each K / V buffer

    const SeqFwdParams& f = p.fwd;
    const int32_t left = f.mask.parts[0].a, right = f.mask.parts[0].b;
    const int64_t num_items = num_pairs * f.num_heads;
    const int wg = threadIdx.x >> 7;
    const uint32_t smem0 = (smem_addr(smem) + 1023u) & ~1023u;
    auto kv = [&](int b) { return smem0 + static_cast<uint32_t>(b) * Cfg::kKvBytes; };   // K, then V
    auto stage_at = [&](int s) { return smem0 + 2 * Cfg::kKvBytes + static_cast<uint32_t>(s) * Cfg::kStageBytes; };
    const uint32_t ds0 = smem0 + 2 * Cfg::kKvBytes + kStages * Cfg::kStageBytes;
    const uint32_t dq0 = ds0 + 2 * Cfg::kConsumers * Cfg::kDsBytes;
    if (threadIdx.x == 0) {
        mbar_init_ring(kv_full, kv_empty, 4 * Cfg::kConsumers);   // every consumer warp
        mbar_init_ring(full_bar, empty_bar, 4 * Cfg::kConsumers);
    }
    __syncthreads();

    if (wg == 0) {   // the producer
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x != 0) return;
        uint32_t tiles = 0, items = 0;   // copied so far (the rings' positions)
        // The next item: the counter's (blocks take items in about the order
        // of the pairs, whose queries and dQ rows overlap: L2), or (no
        // counter) the block's next stride.
        auto next_item = [&](int64_t item) {
            return p.item_counter != nullptr ? int64_t(gridDim.x) + int64_t(atomicAdd(p.item_counter, 1ull))
                                             : item + gridDim.x;
        };
        for (int64_t item = blockIdx.x; item < num_items; item = next_item(item)) {
            SeqBandPair pr;
            if (!pr.find(f, item / f.num_heads, left, right)) continue;
            const int head = static_cast<int>(item % f.num_heads);
            const int b = mbar_take_slot(kv_empty, items);
            published[b].set(pr, head);   // (released by the arrival below)
            const uint32_t bar = smem_addr(&kv_full[b]);
            mbar_expect_tx(bar, 2 * kTmaTileBytes * (pr.has[0] + pr.has[1]));
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                if (!pr.has[c]) continue;
                const int32_t row = pr.win[c].first + pr.win[c].base;
                const uint32_t at = kv(b) + c * kTmaTileBytes;
                tma_load_rows(at, maps.k, head, row, bar);
                tma_load_rows(at + 2 * kTmaTileBytes, maps.v, head, row, bar);
            }
            for (int t = 0; t < pr.ntiles; ++t) {
                const int ps = t < pr.end0 ? 0 : 1;
                const int32_t q0 = pr.first[ps] + pr.kbeg[ps] + kSeqTileKeys * (t - (ps ? pr.end0 : 0));
                const int s = tiles % kStages;
                if (tiles >= kStages) mbar_wait(smem_addr(&empty_bar[s]), ((tiles / kStages) - 1) & 1);
                const uint32_t sbar = smem_addr(&full_bar[s]);
                mbar_expect_tx(sbar, 2 * kTmaTileBytes + SeqBwdKeysConfig::kLdBox * 4);
                tma_load_rows(stage_at(s), maps.q, head, q0, sbar);
                tma_load_rows(stage_at(s) + kTmaTileBytes, maps.dout, head, q0, sbar);
                tma_load_2d(stage_at(s) + 2 * kTmaTileBytes, maps.ld, 2 * (q0 & ~1), head, sbar);
                ++tiles;
            }
            ++items;
        }
        mbar_publish_end(published, kv_full, kv_empty, items);
        return;
    }

    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int c = wg - 1, ctid = threadIdx.x & 127;
    const int warp = ctid >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const uint32_t width = static_cast<uint32_t>(left) + static_cast<uint32_t>(right);
    const uint32_t desc_lo = wgmma_desc_sw128_lo(smem0);
    auto desc = [&](uint32_t addr) { return wgmma_desc_sw128_at(desc_lo, addr - smem0); };
    uint32_t tiles = 0, buf = 0;   // as the producer's; the parity of this consumer's dS^T / dQ buffers
    // A tile's dQ (rows from `row`), from its shared buffer `at`: thread 0's
    // bulk reduce-add into the fp32 dQ, in flight while the next tile computes
    auto reduce_dq = [&](int32_t row, int head, uint32_t at) {
        tma_reduce_add_rows(maps.dq, 0, head, row, at);
        tma_reduce_add_rows(maps.dq, 32, head, row, at + Cfg::kDqBytes / 2);
        tma_commit();
    };
    // The consumers take turns to issue a tile's scores (S^T, dP^T), consumer
    // 0 first: each waits on its turn's barrier, issues, and hands the turn
    // over (bar.arrive: no wait). So one's softmax tends to run beside the
    // other's products rather than both at once (README: 4-5% at 1M-8M tokens).
    // Every tile takes a turn, live or not, so that the two counts match.
    auto turn_wait = [&]() { named_barrier_sync(Cfg::kTurnBarrier + c, 256); };
    auto turn_pass = [&]() { named_barrier_arrive(Cfg::kTurnBarrier + (c ^ 1), 256); };
    if (c == 1) turn_pass();
    for (uint32_t items = 0;; ++items) {
        const int b = items & 1;
        mbar_wait(smem_addr(&kv_full[b]), (items >> 1) & 1);
        const SeqBandBwdItem& rec = published[b];
        const int head = rec.head;
        if (head < 0) break;
        const int ntiles = rec.ntiles, end0 = rec.end0;
        const int32_t cr0 = rec.base[c], crows = rec.rows[c], len = rec.len[c], wfirst = rec.wfirst[c];
        const int32_t row_a = cr0 + 16 * warp + g;   // the thread's keys: row_a, row_a + 8
        const uint32_t k_tile = kv(b) + c * kTmaTileBytes, v_tile = k_tile + 2 * kTmaTileBytes;
        // K and V as the scores' A fragments, read once an item (not 2 KB of
        // each a k-step of every tile: README, "K and V in the band
        // backward's registers"); the buffer's K stays for dQ = dS K
        uint32_t ka[4][4], va[4][4];
        seq_bwd_keys_a_frags(ka, k_tile, warp, lane);
        seq_bwd_keys_a_frags(va, v_tile, warp, lane);

        float dk[32], dv[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.f;
        for (int tt = 0; tt < ntiles; ++tt, ++tiles) {
            const int s = tiles % kStages;
            const int ps = tt < end0 ? 0 : 1;
            const int32_t ks = rec.kbeg[ps] + kSeqTileKeys * (tt - (ps ? end0 : 0));
            const int32_t q0 = rec.first[ps] + ks;   // the tile's first token
            const bool live = rec.live(c, ps, ks);
            const uint32_t q_at = stage_at(s), do_at = q_at + kTmaTileBytes;
            mbar_wait(smem_addr(&full_bar[s]), (tiles / kStages) & 1);
            turn_wait();
            if (live) {
                const uint32_t ds_at = ds0 + (2 * c + buf) * Cfg::kDsBytes, dq_at = dq0 + (2 * c + buf) * Cfg::kDqBytes;
                const bool full = seq_band_bwd_full(crows, cr0, ks, left, right, len);
                uint32_t bits[4] = {0u, 0u, 0u, 0u};
                if (!full) seq_band_bwd_bits(ks, row_a, cr0 + crows, len, left, width, t, bits);
                float s_t[32], dp[32];
                seq_bwd_keys_scores<T>(s_t, dp, desc, ka, q_at, va, do_at);
                turn_pass();
                const float2* lds = reinterpret_cast<const float2*>(smem + (q_at + 2 * kTmaTileBytes - smem_addr(smem))) +
                                    (q0 & 1);
                float4 ld[8];
                seq_bwd_keys_read_ld(lds, t, ld);
                wgmma_wait<1>();
                wgmma_fence_operands(s_t);
                uint32_t pa[4][4], dsa[4][4];
                float pv[32];
                if (full) seq_bwd_keys_probs<T, true>(s_t, ld, bits, f.scale_log2, pv, pa);
                else seq_bwd_keys_probs<T, false>(s_t, ld, bits, f.scale_log2, pv, pa);
                wgmma_fence();
#pragma unroll
                for (int sl = 0; sl < 4; ++sl) wgmma_m64n64k16<T, true>(dv, pa[sl], desc(do_at + sl * Sw128Tile::kBytes), true);
                wgmma_commit();
                wgmma_wait<1>();   // dP^T (dV may still run)
                wgmma_fence_operands(dp);
                seq_bwd_keys_dscores<T>(pv, dp, ld, dsa);
                seq_bwd_keys_store_ds(ds_at, dsa, warp, lane);
                fence_proxy_async_shared();   // dS^T, stored by every warp, read by wgmma
                if (ctid == 0) tma_wait_read<1>();   // the reduction before the last has read this dQ buffer
                named_barrier_sync(Cfg::kOwnBarrier + c, 128);
                // dQ [64 queries, 64] = dS K: A = (dS^T)^T and B = K, both with rows = keys
                float dq[32];
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    wgmma_m64n64k16_ss<T, true, true>(dq, desc(ds_at + kk * Sw128Tile::kBytes),
                                                      desc(k_tile + kk * Sw128Tile::kBytes), kk > 0);
                }
                wgmma_commit();
                // dK += dS^T Q after dQ: it runs while dQ is stored
#pragma unroll
                for (int sl = 0; sl < 4; ++sl) wgmma_m64n64k16<T, true>(dk, dsa[sl], desc(q_at + sl * Sw128Tile::kBytes), true);
                wgmma_commit();
                wgmma_wait<1>();
                wgmma_fence_operands(dq);
                wgmma_fence_operands(dv);
                seq_bwd_keys_store_dq(dq_at, dq, p.scale, warp, lane);
                wgmma_wait<0>();   // dK: its reads of the stage
                wgmma_fence_operands(dk);
                fence_proxy_async_shared();   // dQ, read by the bulk reduction
                if (lane == 0) mbar_arrive(smem_addr(&empty_bar[s]));
                named_barrier_sync(Cfg::kOwnBarrier + c, 128);   // every warp's dQ rows stored
                if (ctid == 0) reduce_dq(q0, head, dq_at);
                buf ^= 1u;
            } else {
                turn_pass();
                if (lane == 0) mbar_arrive(smem_addr(&empty_bar[s]));
            }
        }
        if (lane == 0) mbar_arrive(smem_addr(&kv_empty[b]));   // this item's K, V and record read: the buffer is free

        // dK, dV of the block's keys (rows 16 warp + g, + 8). A block of 64
        // keys: through the dQ buffer that the reduction before the last
        // read, by two TMA stores of thread 0 (README, "the band backward's
        // dK and dV by TMA": the threads' own stores, 32 a thread, cost
        // 3-4.5% of the kernel, both consumers' tensor work waiting; this
        // form about 1-2% less); the buffers then swap, so that the next dQ
        // goes to the last reduction's, whose read the next wait (all but the
        // newest group) covers. A shorter block (a document's last): the
        // threads' stores, none past its keys.
        if (crows == 64) {
            const uint32_t dkv_at = dq0 + (2 * c + buf) * Cfg::kDqBytes;
            if (ctid == 0) tma_wait_read<1>();   // the reduction before the last has read this buffer
            named_barrier_sync(Cfg::kOwnBarrier + c, 128);
            uint32_t frag[4][4];
            seq_bwd_keys_pack<T>(dk, p.scale, frag);
            seq_bwd_keys_store_ds(dkv_at, frag, warp, lane);
            seq_bwd_keys_pack<T>(dv, 1.f, frag);
            seq_bwd_keys_store_ds(dkv_at + kTmaTileBytes, frag, warp, lane);
            fence_proxy_async_shared();   // read by TMA
            named_barrier_sync(Cfg::kOwnBarrier + c, 128);
            if (ctid == 0) {
                const int32_t row = wfirst + cr0;
                tma_store_rows(maps.dk, 0, head, row, dkv_at);
                tma_store_rows(maps.dv, 0, head, row, dkv_at + kTmaTileBytes);
                tma_commit();
            }
            buf ^= 1u;
        } else {
            seq_bwd_keys_store_dkdv<T>(p, dk, dv, int64_t(wfirst) + cr0, 1, 16 * warp + g, crows, head, t);
        }
    }
    if (c == 0) turn_wait();   // consumer 1's last hand-over
    if (ctid == 0) tma_wait_all();   // the last reductions done before the block's shared memory goes
#else
    __trap();
#endif
}

// Whether this device runs the kernel (compiled for sm_90a: its launch
// bound). Asked once per process and dtype; no device work.
template <typename T>
bool seq_band_bwd_ready() {
    static const bool ready = wgmma_kernel_runs(seq_band_bwd_kernel<T>, SeqBandBwdConfig::kThreads);
    return ready;
}

// The backward of params by this kernel where it serves it (the caller's
// checks: D = 64, sm_90; here: a mask of one local window, the forward's
// 64-row blocks, tensors the TMA describes): true when launched (or nothing
// to do), false where the caller runs another. As many blocks as
// params.fwd.num_sms. GT_FUSED3S_SEQ_BAND_BWD=0: the other kernel (A/B).
template <typename T>
bool run_seq_band_bwd(const SeqBwdKeysParams& params, cudaStream_t stream) {
    using Cfg = SeqBandBwdConfig;
    const SeqFwdParams& f = params.fwd;
    const SeqMask& mk = f.mask;
    const char* env = std::getenv("GT_FUSED3S_SEQ_BAND_BWD");
    if ((env != nullptr && env[0] == '0') || !seq_band_bwd_takes(mk) || f.block_rows != 64 || f.num_sms <= 0 || !seq_band_bwd_ready<T>()) {
        return false;
    }
    SeqBandBwdMaps maps{};
    const int64_t T_ = f.num_tokens, H = f.num_heads;
    const bool ok =
        tma_encode_rows(&maps.q, f.q_ptr, T_, H, f.q_row_stride, f.q_head_stride) &&
        tma_encode_rows(&maps.k, f.k_ptr, T_, H, f.k_row_stride, f.k_head_stride) &&
        tma_encode_rows(&maps.v, f.v_ptr, T_, H, f.v_row_stride, f.v_head_stride) &&
        tma_encode_rows(&maps.dout, params.do_ptr, T_, H, params.do_row_stride, params.do_head_stride) &&
        tma_encode_f32_rows(&maps.ld, params.ld_ptr, 2 * T_, H, params.ld_head_stride * 4, SeqBwdKeysConfig::kLdBox) &&
        tma_encode_f32_halves(&maps.dq, params.dq_ptr, T_, H, params.grad_row_stride, params.grad_head_stride) &&
        tma_encode_rows(&maps.dk, params.dk_ptr, T_, H, params.grad_row_stride, params.grad_head_stride) &&
        tma_encode_rows(&maps.dv, params.dv_ptr, T_, H, params.grad_row_stride, params.grad_head_stride);
    if (!ok) return false;
    if (f.num_windows <= 0 || H <= 0) return true;
    const int64_t pairs = (f.num_windows + 1) / 2;
    const int64_t blocks = env != nullptr && env[0] == 'g' ? pairs * H : std::min<int64_t>(pairs * H, f.num_sms);
    constexpr auto kernel = seq_band_bwd_kernel<T>;
    set_max_dynamic_smem<kernel>(Cfg::kSmemBytes);   // (an error shows at the launch)
    SeqBwdKeysParams run = params;
    if (env != nullptr && env[0] == 's') run.item_counter = nullptr;   // (A/B: each block strides the items)
    kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(run, maps, pairs);
    return true;
}

}  // namespace gt_fused3s
