// Sparse attention over sequences, forward, for a mask of one local window
// (keys row - a .. row + b of the query's document), or of a local window
// and global keys (Longformer's: kGlobal, seq_band_global_keys), and with
// random blocks of whole 128-key tiles after them (BigBird's: kRandom), at
// head dim 64 on Hopper (sm_90a): FlashAttention-3's block shape with warp
// specialisation, in place of seq_fwd_kernel.cuh's instances
// (run_seq_fwd<T, 64> calls it). A dilated window of rate r (alone or with
// global keys) is a local window among the positions of one residue mod r:
// the kernel walks each residue's positions as it walks a document's, its
// TMA maps taking 64 rows r apart (SeqBandWindow, tma_encode_rate_rows;
// two maps a tensor where the tokens are not a multiple of r: SeqBandMaps).
//
// A block of four warpgroups (512 threads, one block an SM, as many blocks
// as SMs) walks work items: an item is a group of three of the forward's
// 64-query row blocks, 3 g .. 3 g + 2 (cu_windows as every caller makes
// it: the host passes nothing new), and a head. Warpgroup 0 is the
// producer: one thread copies an item's three Q tiles into one of two
// buffers and then, tile after tile, 128 consecutive keys of K and V into
// a ring of four shared-memory stages by TMA (tma.cuh), each buffer's and
// stage's bytes counted on its "full" mbarrier; it refills one once every
// consumer warp has arrived on its "empty" one. So the next item's Q and
// first key tiles arrive while the consumers finish the current item and
// write its output. The producer keeps 32 registers (setmaxnreg), the
// consumers 160.
// Consumer c (warpgroup c + 1) owns row block 3 g + c; per tile:
//   S [64, 128] = Q K^T      four wgmma.m64n128k16 (Q and K from shared memory)
//   mask bits                at the band's edges only (an unsigned range test
//                            per score); a tile wholly inside the band for
//                            the 64 rows takes none
//   online softmax           fp32, log2 domain; the row maximum moves only
//                            when it grew by more than 2^8 (online_softmax_full's
//                            rule); P rounded to T in registers
//   O [64, 64] += P V        eight wgmma.m64n64k16, P from registers
// Where the consumer's keys reach one 64-key half of a pass's first or last
// tile only, the step runs on that half (m64n64 products, 32 exponentials
// a thread): the group's middle row block no longer computes a tile more
// than the others (README: 1.6M tokens 2.53 -> 2.40 ms on an H100).
// Random blocks (kRandom) come after the passes' tiles: each row block's
// list (its document's and query block's; row blocks that share one share
// its tiles), the lists' i-th blocks side by side so that row blocks of
// different lists compute at once; a key the band or the global part
// gives is masked there (counted by its part). The producer notes each
// random tile's key and list beside its stage (SeqBandNote). Against the
// sequence kernel's instance (BigBird at 4M tokens: 20.1 -> 16.7 ms on an
// H100, README), a random tile serves up to 128 queries in one copy, and
// the copies run up to four tiles ahead of the MMAs.
// Row blocks of one document share their keys' tiles (one pass over the
// union of their key ranges); a block whose row blocks span two or three
// documents walks one pass per document, each consumer computing in its
// own and only releasing the others' tiles. A tile none of a consumer's
// queries sees (its band's first or last) is released unread.
//
// Against the band instance (a warpgroup of 64 queries a block, 64-key
// tiles, every warp copying), a key tile in shared memory serves 192
// queries instead of 64 and an MMA is twice as wide. A block an item with
// two stages (this kernel's first form) was 6-10% slower at 1M-16M tokens:
// each block waited for its first copies and wrote its output with nothing
// beside it (GT_FUSED3S_SEQ_BAND=g launches a block an item). Tried
// and not kept (README): the warpgroups' score products, or their
// softmax, in a fixed ring order (named barriers), FlashAttention-3's
// overlap of tile t's softmax with tile t - 1's P V, that overlap and the
// ring together (branch wip/seq-band-overlap-ring), 192-key tiles, and a
// quarter or half of the exponentials on the FMA pipe (a cubic), and
// cheaper edge masks (a key range or a bit mask a row, quarters of keys the
// warp's rows all see skipped): each slower or no faster. Nsight Compute
// (README): the tensor pipe and the MUFU each near 48% of their peaks, in
// turn rather than beside each other.
#pragma once

#include <cstdint>
#include <cmath>
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <cuda_runtime.h>

#include "mma_utils.cuh"
#include "seq_mask.cuh"
#include "seq_params.h"
#include "smem_tile.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace gt_fused3s {

// The launch's tensor maps (boxes of 64 rows of one residue,
// tma_encode_rate_rows): [0] of the residues below `split` = tokens % rate,
// which have one position more than the others, [1] of the others (all of
// them where the tokens are a multiple of the rate).
struct SeqBandMaps {
    CUtensorMap q[2], k[2], v[2];
    int32_t split;
};

// Which of the maps (split: SeqBandMaps::split) holds residue `residue`,
// and its coordinate there.
GT_SEQ_HD int seq_band_map_of(int32_t split, int32_t& residue) {
    const int m = residue >= split;
    residue -= m ? split : 0;
    return m;
}

// The work's order: the groups as a [rate, groups / rate] matrix walked by
// columns (t -> group), so that blocks at work at once read neighbouring
// residues of the same tokens, which share DRAM pages (a residue after
// another: dilated + global at 4M tokens, rate 2, 1.86 ms against 1.76).
// Rate 1: the identity. `slots`: seq_band_slots (rate x ceil(groups /
// rate)); the slots past the last group find no query.
GT_SEQ_HD int64_t seq_band_slots(int64_t groups, int32_t rate) { return rate * ((groups + rate - 1) / rate); }
GT_SEQ_HD int64_t seq_band_group(int64_t t, int64_t slots, int32_t rate) {
    return rate == 1 ? t : (t % rate) * (slots / rate) + t / rate;
}

// The band kernel's key tiles: 128 keys.
constexpr int kSeqBandKeys = 128;

struct SeqBandConfig {
    static constexpr int kConsumers = 3;                   // warpgroups of 64 queries
    static constexpr int kKeys = kSeqBandKeys;             // keys a tile
    static constexpr int kThreads = 128 * (kConsumers + 1);
    // the key tiles' ring: four stages (three were 2-5% slower at 1M-8M
    // tokens once the half tiles balanced the consumers, five 3.3-4.5% slower
    // at 1M-16M, README; with random blocks a list's consumers find its
    // next tile copied while the others' lists hold stages)
    static constexpr int kStages = 4;
    static constexpr uint32_t kTileBytes = kKeys * 128;    // 128 rows of 64 16-bit elements
    static constexpr uint32_t kQBytes = kConsumers * kTmaTileBytes;
    // each consumer's copy of its document's global keys' K and V rows (kGlobal)
    static constexpr int kGlobalBytes = 2 * kSeqMaxGlobal * RowTile<64>::kRowElems * 2;
    // two buffers of Q tiles, the key tiles' stages, the global keys' rows
    // (kGlobal only: the rest of shared memory is L1's), the 1024-byte alignment
    GT_SEQ_HD static constexpr int smem_bytes(bool global) {
        return 2 * kQBytes + kStages * 2 * kTileBytes + (global ? kConsumers * kGlobalBytes : 0) + 1024;
    }
    static constexpr int kProducerRegs = 32, kConsumerRegs = 160;
};
static_assert(SeqBandConfig::smem_bytes(true) <= 227 * 1024, "the band kernel's shared memory: an SM's");

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if GT_WGMMA
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if GT_WGMMA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Whether a local window of `left` keys back and width = left + right
// gives `row` the key `key` (one unsigned compare: key - row + left in
// [0, width] mod 2^32). The band tiles' loop writes it inline, with the
// second row's test as d - 8.
GT_SEQ_HD bool seq_band_gives(int32_t key, int32_t row, int32_t left, uint32_t width) {
    return static_cast<uint32_t>(key - row) + static_cast<uint32_t>(left) <= width;
}

// The mask's global part, and its random part, where the band kernel takes
// them (seq_band_takes): -1 where there is none.
GT_SEQ_HD int seq_band_global_part(const SeqMask& mk) {
    return mk.num_parts > 1 && mk.parts[1].kind == kSeqGlobal ? 1 : -1;
}
GT_SEQ_HD int seq_band_random_part(const SeqMask& mk) {
    const int r = mk.num_parts - 1;
    return r > 0 && mk.parts[r].kind == kSeqRandom ? r : -1;
}

// Whether the band kernel serves the mask: one local window, or one dilated
// window at its rate (the mask's row stride: the window is then a local one
// among the positions of one residue mod the rate), alone or with global
// keys (Longformer's, dilated + global); and a local window (rate 1) with
// random blocks of a multiple of 128 keys after it, with or without global
// keys (BigBird's: whole key tiles, and a 64-query row block in one query
// block).
GT_SEQ_HD bool seq_band_takes(const SeqMask& mk) {
    const SeqMaskPart& pt = mk.parts[0];
    const bool window = (pt.kind == kSeqLocal && mk.row_stride == 1) || (pt.kind == kSeqDilated && mk.row_stride == pt.c);
    const int g = seq_band_global_part(mk), r = seq_band_random_part(mk);
    const bool random_ok = r < 0 || (mk.row_stride == 1 && mk.parts[r].a % kSeqBandKeys == 0 && mk.parts[r].b > 0);
    return window && pt.a >= 0 && pt.b >= 0 && random_ok && mk.num_parts == 1 + (g > 0) + (r > 0);
}

// A row block of the band kernel: 64 queries of one residue rho mod the rate
// (rate 1: rho = 0, every position). Its queries and keys are positions of
// the residue, numbered 0 .. len - 1: position x is the document's position
// rho + rate x, the token first + rate x. In these positions the window is a
// local one (left, right), and consecutive positions are consecutive rows of
// the rate's TMA map (tma_encode_rate_rows). Tokens below 2^31 (the maps'
// bound, tma_rows_layout_ok): 32-bit (the producer's 32 registers spilled
// with 64-bit ones).
struct SeqBandWindow {
    int32_t first;       // the token of position 0: the document's first token + rho
    int32_t doc_len;     // the document's tokens
    int32_t rho, len;    // the residue and its positions in the document
    int32_t base, rows;  // the block's queries: positions base .. base + rows - 1
};

// The TMA map's coordinates (residue, row) of the token first + rate x.
GT_SEQ_HD void seq_band_map_coords(int32_t first, int32_t x, int32_t rate, int32_t& residue, int32_t& row) {
    const int32_t q = rate == 1 ? first : first / rate;
    residue = first - q * rate;
    row = q + x;
}

// Where the document's position j lies among residue rho's positions (rate
// apart): false where it is not one of them.
GT_SEQ_HD bool seq_band_position(int32_t j, int32_t rho, int32_t rate, int32_t& pos) {
    const int32_t d = j - rho;
    if (rate == 1) {
        pos = d;
        return true;
    }
    pos = d / rate;
    return d >= 0 && d == pos * rate;
}

// One pass of a group: the key tiles [kbeg, kbeg + 128 n) of one residue of
// one document (positions; `first` as SeqBandWindow's).
struct SeqBandPass {
    int32_t first, kbeg, n;
};

// Row block w of the forward's 64-query blocks (seq_window_in's order: a
// residue's blocks, residue after residue; at rate 1 without its divisions:
// every thread of the block finds three, and the general form's four
// integer divisions each were a tenth of a block's instructions). False
// past the last block or where it holds no query (a residue past a short
// document's end).
GT_SEQ_HD bool seq_band_window(const SeqFwdParams& p, int64_t w, int32_t rate, SeqBandWindow& win) {
    if (w >= seq_ld(p.cu_windows + p.num_docs)) return false;
    const int lo = seq_window_doc(p, w);
    const int64_t start = seq_ld(p.cu_seqlens + lo);
    const int32_t wl = static_cast<int32_t>(w - seq_ld(p.cu_windows + lo));
    win.doc_len = seq_ld(p.cu_seqlens + lo + 1) - static_cast<int32_t>(start);
    if (rate == 1) {
        win.rho = 0;
        win.len = win.doc_len;
        win.base = 64 * wl;
    } else {
        const int32_t per_residue = ((win.doc_len + rate - 1) / rate + 63) / 64;
        win.rho = wl / per_residue;
        win.base = 64 * (wl - win.rho * per_residue);
        win.len = (win.doc_len - win.rho + rate - 1) / rate;
    }
    win.first = static_cast<int32_t>(start) + win.rho;
    win.rows = seq_min(64, win.len - win.base);
    return win.rows > 0;
}

// Of a group's tiles t = 0 .. ntiles - 1 (its passes' tiles in turn, the
// passes ending at end0, end1): tile t's pass, and its first key (kb: each
// pass's first key).
GT_SEQ_HD int seq_band_pass_at(int t, int end0, int end1) { return t < end0 ? 0 : t < end1 ? 1 : 2; }
GT_SEQ_HD int32_t seq_band_tile_key(const int32_t (&kb)[3], int end0, int end1, int t, int ps, int kKeys) {
    return ps == 0 ? kb[0] + t * kKeys : ps == 1 ? kb[1] + (t - end0) * kKeys : kb[2] + (t - end1) * kKeys;
}

// A group: three consecutive row blocks 3 g .. 3 g + 2, their key ranges,
// and the passes over their keys (a row block starts a pass unless the one
// before it that holds queries is of its document and residue). All
// passes' tiles form one sequence t = 0 .. ntiles - 1 (one loop body: a
// loop per pass tripled the code, which the instruction cache holds).
// Every array is indexed by constants only (an index known at run time put
// them in local memory).
struct SeqBandGroup {
    static constexpr int kRows = 3;
    SeqBandWindow win[kRows];
    bool has[kRows];
    int32_t wkb[kRows], wke[kRows];   // each row block's keys [wkb, wke) among its residue's positions
    int pass_of[kRows];               // the pass of each row block, -1 where it holds no query
    SeqBandPass pass[kRows];
    int end0, end1, ntiles;
    // The random part (find_random): a list of random key blocks per
    // document and query block, held by the first row block that has it
    // (its slot); list_of[c]: row block c's slot, -1 where it holds no
    // query; per slot the list's walk (seq_random_walk) and blocks (rper: 0
    // where the slot holds no list), and the group's random tiles.
    int list_of[kRows];
    int32_t rstart[kRows], rstep[kRows], rnb[kRows], rper[kRows];
    int32_t nrandom;

    // False where the group holds no query (past the last row block).
    // rate: the mask's row stride (the kernel's rate-1 instances pass a
    // constant 1: their code is the local window's alone).
    GT_SEQ_HD bool find(const SeqFwdParams& p, int64_t g, int32_t left, int32_t right, int kKeys, int32_t rate) {
        int npass = 0;
        int32_t prev = -1;   // the token of position 0 of the last row block with queries
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
            has[c] = seq_band_window(p, int64_t(kRows) * g + c, rate, win[c]);
            wkb[c] = has[c] ? seq_max(0, win[c].base - left) : 0;
            wke[c] = has[c] ? static_cast<int32_t>(seq_min64(win[c].len, int64_t(win[c].base) + win[c].rows + right)) : 0;
            pass_of[c] = -1;
            if (!has[c]) continue;
            npass += npass == 0 || win[c].first != prev;
            pass_of[c] = npass - 1;
            prev = win[c].first;
        }
        if (npass == 0) return false;
#pragma unroll
        for (int ps = 0; ps < kRows; ++ps) {
            int32_t kb = 0, ke = 0, first = 0;
            bool opens = true;
#pragma unroll
            for (int c = 0; c < kRows; ++c) {
                if (pass_of[c] != ps) continue;
                if (opens) kb = wkb[c], first = win[c].first;
                opens = false;
                ke = wke[c];   // the pass's last row block's end
            }
            pass[ps] = SeqBandPass{first, kb, (ke - kb + kKeys - 1) / kKeys};
        }
        end0 = pass[0].n;
        end1 = end0 + pass[1].n;
        ntiles = end1 + pass[2].n;
        return true;
    }
    // The random part pt's lists (rate 1: positions are the document's):
    // row blocks of one document and one query block (pt.a a multiple of
    // 128, seq_band_takes: a row block lies in one) share one.
    GT_SEQ_HD void find_random(const SeqMaskPart& pt) {
        nrandom = 0;
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
            rper[c] = 0;
            list_of[c] = -1;
            if (!has[c]) continue;
            const int32_t qb = win[c].base / pt.a;
            list_of[c] = c;
#pragma unroll
            for (int e = 0; e < c; ++e) {
                if (has[e] && win[e].first == win[c].first && win[e].base / pt.a == qb) list_of[c] = list_of[e];
            }
            if (list_of[c] != c) continue;
            rnb[c] = (win[c].len + pt.a - 1) / pt.a;
            rper[c] = seq_min(pt.b, rnb[c]);
            seq_random_walk(pt, qb, rnb[c], rstart[c], rstep[c]);
            nrandom += rper[c] * (pt.a / kSeqBandKeys);
        }
    }
    // The random tiles in the kernel's order: the lists' i-th blocks side by
    // side (row blocks of different lists compute at once), block after
    // block; emit(first, key, slot, global) per tile of 128 keys: the
    // list's document's first token, the tile's first key (a position;
    // past the document's end for a short last block's tail tiles), and
    // whether one of the document's global keys lies in the tile (its
    // scores then test each key against them).
    template <typename Emit>
    GT_SEQ_HD void for_random_tiles(const SeqMask& mk, const SeqMaskPart& pt, Emit&& emit) const {
        int32_t kb[kRows], most = 0;
#pragma unroll
        for (int c = 0; c < kRows; ++c) {
            kb[c] = rper[c] > 0 ? rstart[c] : 0;
            most = seq_max(most, rper[c]);
        }
        for (int i = 0; i < most; ++i) {
#pragma unroll
            for (int c = 0; c < kRows; ++c) {
                if (i >= rper[c]) continue;
                const int nglobal = seq_global_count(mk, win[c].len);
                for (int32_t key = kb[c] * pt.a; key < (kb[c] + 1) * pt.a; key += kSeqBandKeys) {
                    bool global = false;
                    for (int n = 0; n < nglobal; ++n) global |= mk.global_idx[n] >= key && mk.global_idx[n] < key + kSeqBandKeys;
                    emit(win[c].first, key, c, global);
                }
                kb[c] += rstep[c];
                if (kb[c] >= rnb[c]) kb[c] -= rnb[c];
            }
        }
    }
    GT_SEQ_HD int pass_at(int t) const { return seq_band_pass_at(t, end0, end1); }
    // tile t's first key, a position of its pass's residue
    GT_SEQ_HD int32_t tile_key(int t, int ps, int kKeys) const {
        const int32_t kb[3] = {pass[0].kbeg, pass[1].kbeg, pass[2].kbeg};
        return seq_band_tile_key(kb, end0, end1, t, ps, kKeys);
    }
    GT_SEQ_HD int32_t first(int ps) const { return ps == 0 ? pass[0].first : ps == 1 ? pass[1].first : pass[2].first; }
};

// A work item as the producer found it (SeqBandGroup::find), published in
// shared memory for its consumers with the item's Q tiles (one record a Q
// buffer, written before the q_full arrival that releases it): the 384
// consumer threads no longer each find the group's three row blocks.
// head < 0: no more items.
struct SeqBandItem {
    int32_t head, ntiles, end0, end1;
    int32_t kbeg[SeqBandGroup::kRows];   // each pass's first key
    // per row block (consumer): its pass (-1: no query), keys [wkb, wke), window
    int32_t pass_of[SeqBandGroup::kRows], wkb[SeqBandGroup::kRows], wke[SeqBandGroup::kRows];
    SeqBandWindow win[SeqBandGroup::kRows];
    // the random part: each row block's list (its slot, SeqBandNote::slot)
    // and the group's random tiles (after its passes' tiles)
    int32_t list_of[SeqBandGroup::kRows], nrandom;

    GT_SEQ_HD void set(const SeqBandGroup& grp, int32_t h, bool random) {
        head = h;
        ntiles = grp.ntiles;
        nrandom = random ? grp.nrandom : 0;
        end0 = grp.end0;
        end1 = grp.end1;
#pragma unroll
        for (int c = 0; c < SeqBandGroup::kRows; ++c) {
            kbeg[c] = grp.pass[c].kbeg;
            pass_of[c] = grp.pass_of[c];
            wkb[c] = grp.wkb[c];
            wke[c] = grp.wke[c];
            win[c] = grp.win[c];
            list_of[c] = random ? grp.list_of[c] : -1;
        }
    }
    GT_SEQ_HD int pass_at(int t) const { return seq_band_pass_at(t, end0, end1); }
};

// A random tile as the producer copies it, in shared memory beside its
// stage (written before the stage's "full" arrival): its first key, its
// list's slot, and whether a global key lies in it.
struct SeqBandNote {
    int32_t key, slot, global;
};

// Whether a random tile (keys ks .. ks + 127) needs no mask for a row
// block of `rows` queries whose band's keys are [kb, ke) (SeqBandGroup's
// wkb, wke): all 64 rows hold queries, the band gives none of the tile's
// keys (counted there), all lie in the document, and none is global.
GT_SEQ_HD bool seq_band_random_inside(int32_t rows, int32_t ks, int32_t kb, int32_t ke, int32_t len, bool global) {
    return rows == 64 && (ks >= ke || ks + kSeqBandKeys <= kb) && ks + kSeqBandKeys <= len && !global;
}

// The columns of a random tile (first key ks) that hold one of the
// document's `n` global keys, among those of thread t4 of a quad (the
// wgmma accumulator's: columns 8 j + 2 t4 + e), as bits 2 j + e: the
// global part gives those keys (counted there).
GT_SEQ_HD uint32_t seq_band_global_columns(const SeqMask& mk, int n, int32_t ks, int t4) {
    uint32_t bits = 0u;
    for (int i = 0; i < n; ++i) {
        const int32_t col = mk.global_idx[i] - ks;
        if (static_cast<uint32_t>(col) < static_cast<uint32_t>(kSeqBandKeys) && ((col >> 1) & 3) == t4) {
            bits |= 1u << (2 * (col >> 3) + (col & 1));
        }
    }
    return bits;
}

// The online softmax's reference m (log2 units) of the thread's rows g and
// g + 8, given their maxima mx over new scores: it moves, for every row of
// the warp, when a row's grew by more than 2^8 (online_softmax_full's rule),
// and l and O (the wgmma accumulator's layout) follow it.
__device__ __forceinline__ void seq_band_move_reference(const float (&mx)[2], float (&m)[2], float (&l)[2],
                                                        float (&o)[32]) {
    if (__any_sync(0xffffffffu, mx[0] > m[0] + 8.f || mx[1] > m[1] + 8.f)) {
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float m_new = fmaxf(m[r], mx[r]);
            alpha[r] = m_new == -INFINITY ? 1.f : fast_exp2(m[r] - m_new);   // from -inf: 0 (o, l are 0)
            m[r] = m_new;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }
}

// The row maxima of a tile's scores (the wgmma accumulator: rows g and
// g + 8 of the thread's warp) over the quad's 4 threads, in log2 units.
template <int kN>
__device__ __forceinline__ void seq_band_row_max(const float (&sc)[kN], float sl2, float (&mx)[2]) {
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(sc[4 * j], sc[4 * j + 1]));
        mx[1] = fmaxf(mx[1], fmaxf(sc[4 * j + 2], sc[4 * j + 3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mx[r] *= sl2;
    }
}

// P = exp2(S sl2 - m) rounded to T as the A fragments of P V's k-steps (k-step
// k from column tiles 2 k (a0: row g, a1: row g + 8) and 2 k + 1 (a2, a3)),
// its row sums added to l.
template <typename T, int kN>
__device__ __forceinline__ void seq_band_softmax_pack(const float (&sc)[kN], float sl2, const float (&m)[2],
                                                      uint32_t (&pa)[kN / 8][4], float (&l)[2]) {
    const float mr[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
        float e[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) e[q] = fast_exp2(fmaf(sc[4 * j + q], sl2, -mr[q >> 1]));
        sum[0] += e[0] + e[1];
        sum[1] += e[2] + e[3];
        pa[j >> 1][(j & 1) * 2] = TypeTraits<T>::pack(e[0], e[1]);
        pa[j >> 1][(j & 1) * 2 + 1] = TypeTraits<T>::pack(e[2], e[3]);
    }
    l[0] += sum[0];
    l[1] += sum[1];
}

// The global keys of a mask Local | Global (Longformer's) or Dilated | Global:
// their K and V rows (the document's, one head; each residue's band sees
// them at their token positions) copied into this consumer's shared rows
// `kv` (RowTile<64> layout: K rows, then V rows at kSeqMaxGlobal) by its 128
// threads, where the item's document or head differs from the copy's
// (`copied`: its document's first token and head, in shared memory: two
// registers fewer across the tile loop, where dilated + global spilled).
// Slots past the document's keys repeat its last key (finite values under
// P = 0). Returns the document's number of global keys.
__device__ __forceinline__ int seq_band_global_rows(const SeqFwdParams& p, int32_t doc, int32_t doc_len, int head,
                                                    uint32_t kv, int32_t* copied, int c) {
    const SeqMask& mk = p.mask;
    const int nvalid = seq_global_count(mk, doc_len);   // the document's global keys
    if (nvalid == 0 || (doc == copied[0] && head == copied[1])) return nvalid;
    const int rows = (nvalid + 15) & ~15;
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");   // every warp done with the old copy (and read `copied`)
    if ((threadIdx.x & 127) == 0) copied[0] = doc, copied[1] = head;
    const int tid = threadIdx.x & 127;
    for (int i = tid; i < 2 * rows * 8; i += 128) {   // 16-byte chunks: (tensor, row, chunk)
        const int ch = i & 7, row = (i >> 3) % rows, which = (i >> 3) / rows;
        const int64_t tok = doc + mk.global_idx[min(row, nvalid - 1)];
        const uint16_t* src = which == 0
            ? reinterpret_cast<const uint16_t*>(p.k_ptr) + tok * p.k_row_stride + head * p.k_head_stride
            : reinterpret_cast<const uint16_t*>(p.v_ptr) + tok * p.v_row_stride + head * p.v_head_stride;
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + ch);
        const uint32_t dst = kv + RowTile<64>::at(which * kSeqMaxGlobal + row, 8 * ch);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                     : "memory");
    }
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
    return nvalid;
}

// The global keys for one consumer warp's 16 queries, before its band's
// tiles: chunks of 16 global keys by mma.sync (m16n8k16), whose C layout is
// the wgmma accumulator's for the warp's rows, so the scores and O continue
// in the same registers. Q from its shared-memory slice (swizzled:
// Sw128Tile), K and V from the rows seq_band_global_rows copied (ldmatrix).
// A global key that the band gives the query counts once (the band's):
// where it is a position of the warp's residue (kResidues, a dilated
// window: seq_band_position) and inside the query's window.
template <typename T, bool kResidues>
__device__ __forceinline__ void seq_band_global_keys(const SeqFwdParams& p, int nvalid, uint32_t q_slice, uint32_t kv,
                                                     int32_t row_a, int32_t rho, int32_t left, uint32_t width,
                                                     float sl2, int lane, float (&o)[32], float (&m)[2], float (&l)[2]) {
    using Rows = RowTile<64>;
    const SeqMask& mk = p.mask;
    const int t4 = lane & 3;
    uint32_t qa[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) Sw128Tile::a_frag(qa[ks], q_slice, ks, lane);
    for (int n0 = 0; n0 < nvalid; n0 += 16) {
        // S [16, 16] = Q K_g^T: n-tile nt holds global slots n0 + 8 nt ..
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            uint32_t b[4];
            Rows::bt_frags(b, kv + Rows::at(n0, 0), ks, lane);
            mma_16816<T>(s[0], qa[ks], b[0], b[1]);
            mma_16816<T>(s[1], qa[ks], b[2], b[3]);
        }
        // mask: slots past the document's keys, keys the band gives
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int slot = n0 + 8 * nt + 2 * t4 + e;
                int32_t j = 0;
                const bool in_residue =
                    slot < nvalid && seq_band_position(mk.global_idx[slot], rho, kResidues ? mk.row_stride : 1, j);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (slot >= nvalid || (in_residue && seq_band_gives(j, row_a + 8 * r, left, width))) {
                        s[nt][2 * r + e] = -INFINITY;
                    }
                }
            }
        }
        float mx[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            mx[r] *= sl2;
        }
        seq_band_move_reference(mx, m, l, o);
        const float mr[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int q = 0; q < 4; ++q) s[nt][q] = fast_exp2(fmaf(s[nt][q], sl2, -mr[q >> 1]));
            l[0] += s[nt][0] + s[nt][1];
            l[1] += s[nt][2] + s[nt][3];
        }
        // O += P V_g: P as the A fragment (k = the chunk's 16 slots)
        const uint32_t pa[4] = {TypeTraits<T>::pack(s[0][0], s[0][1]), TypeTraits<T>::pack(s[0][2], s[0][3]),
                                TypeTraits<T>::pack(s[1][0], s[1][1]), TypeTraits<T>::pack(s[1][2], s[1][3])};
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            uint32_t b[4];
            Rows::b_frags(b, kv + Rows::at(kSeqMaxGlobal + n0, 0), jj, lane);
            mma_16816<T>(*reinterpret_cast<float(*)[4]>(&o[8 * jj]), pa, b[0], b[1]);
            mma_16816<T>(*reinterpret_cast<float(*)[4]>(&o[8 * jj + 4]), pa, b[2], b[3]);
        }
    }
}

// __launch_bounds__ tells the host which code the device got (as
// seq_bwd_keys_kernel: 32 threads where sm_90a was not built).
//
// Persistent: block b runs the work items b, b + gridDim.x, ... (an item is
// a group and a head), so that the producer copies the next item's Q and
// first key tiles while the consumers finish the current one and write its
// output; the Q tiles have two buffers for that ("q_full" / "q_empty"), and
// the key tiles' ring runs on across items. The producer finds each item's
// group and publishes it beside its Q tiles (SeqBandItem); the consumers
// read the record (no search of their own) and stop at one without an item.
//
// kResidues: a dilated window (rate > 1): its residues' positions, and the
// global keys' residue test. The rate-1 instances compile to the local
// window's code alone (the rate-general code's registers and divisions in
// Longformer's cost it 5-8% at 4M tokens).
template <typename T, bool kGlobal, bool kResidues, bool kRandom>
__global__ void __launch_bounds__(GT_WGMMA ? SeqBandConfig::kThreads : 32, 1)
seq_band_fwd_kernel(const __grid_constant__ SeqFwdParams p, const __grid_constant__ SeqBandMaps maps,
                    int64_t num_slots) {
#if GT_WGMMA
    using Cfg = SeqBandConfig;
    constexpr int kKeys = Cfg::kKeys, kStages = Cfg::kStages;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ alignas(8) uint64_t full_bar[kStages], empty_bar[kStages], q_full[2], q_empty[2];
    __shared__ int32_t global_copied[Cfg::kConsumers][2];   // seq_band_global_rows' (document, head)
    __shared__ SeqBandItem published[2];                     // the item of each Q buffer
    __shared__ SeqBandNote notes[kRandom ? kStages : 1];     // each stage's random tile (kRandom)

    const int32_t left = p.mask.parts[0].a, right = p.mask.parts[0].b, rate = kResidues ? p.mask.row_stride : 1;
    static_assert(!(kRandom && kResidues), "random blocks with a local window only (rate 1)");
    const int64_t num_items = num_slots * p.num_heads;
    const int wg = threadIdx.x >> 7;

    const uint32_t smem0 = (smem_addr(smem) + 1023u) & ~1023u;
    auto q_tiles = [&](int b) { return smem0 + static_cast<uint32_t>(b) * Cfg::kQBytes; };
    auto k_tile = [&](int s) { return smem0 + 2 * Cfg::kQBytes + static_cast<uint32_t>(s) * 2u * Cfg::kTileBytes; };
    auto v_tile = [&](int s) { return k_tile(s) + Cfg::kTileBytes; };
    if (threadIdx.x == 0) {
#pragma unroll
        for (int c = 0; c < Cfg::kConsumers; ++c) global_copied[c][0] = global_copied[c][1] = -1;
        mbar_init_ring(q_full, q_empty, 4 * Cfg::kConsumers);   // every consumer warp
        mbar_init_ring(full_bar, empty_bar, 4 * Cfg::kConsumers);
    }
    __syncthreads();

    if (wg == 0) {   // the producer
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (threadIdx.x != 0) return;
        uint32_t tiles = 0, items = 0;   // copied so far (the rings' positions)
        for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
            SeqBandGroup grp;
            if (!grp.find(p, seq_band_group(item / p.num_heads, num_slots, rate), left, right, kKeys, rate)) continue;
            const int head = static_cast<int>(item % p.num_heads);
            if constexpr (kRandom) grp.find_random(p.mask.parts[p.mask.num_parts - 1]);
            const int qb = mbar_take_slot(q_empty, items);
            const uint32_t qbar = smem_addr(&q_full[qb]);
            published[qb].set(grp, head, kRandom);   // (released by the arrival below)
            mbar_expect_tx(qbar, kTmaTileBytes * (grp.has[0] + grp.has[1] + grp.has[2]));
#pragma unroll
            for (int c = 0; c < Cfg::kConsumers; ++c) {
                if (grp.has[c]) {
                    int32_t residue, row;
                    seq_band_map_coords(grp.win[c].first, grp.win[c].base, rate, residue, row);
                    const int m = seq_band_map_of(maps.split, residue);
                    tma_load_rate_rows(q_tiles(qb) + c * kTmaTileBytes, maps.q[m], head, residue, row, qbar);
                }
            }
            // the next tile's keys first .. first + 127 (positions of its
            // residue from the token `first`) into the next stage
            auto copy_tile = [&](int32_t first, int32_t key, auto note) {
                const int s = tiles % kStages;
                if (tiles >= kStages) mbar_wait(smem_addr(&empty_bar[s]), ((tiles / kStages) - 1) & 1);
                if constexpr (kRandom) notes[s] = note;
                int32_t residue, row;
                seq_band_map_coords(first, key, rate, residue, row);
                const int m = seq_band_map_of(maps.split, residue);
                const uint32_t bar = smem_addr(&full_bar[s]);
                mbar_expect_tx(bar, 2 * Cfg::kTileBytes);
#pragma unroll
                for (int b = 0; b < kKeys / 64; ++b) {
                    tma_load_rate_rows(k_tile(s) + b * kTmaTileBytes, maps.k[m], head, residue, row + 64 * b, bar);
                    tma_load_rate_rows(v_tile(s) + b * kTmaTileBytes, maps.v[m], head, residue, row + 64 * b, bar);
                }
                ++tiles;
            };
            for (int t = 0; t < grp.ntiles; ++t) {
                const int ps = grp.pass_at(t);
                copy_tile(grp.first(ps), grp.tile_key(t, ps, kKeys), SeqBandNote{});
            }
            if constexpr (kRandom) {
                grp.for_random_tiles(p.mask, p.mask.parts[p.mask.num_parts - 1],
                                     [&](int32_t first, int32_t key, int slot, bool global) {
                                         copy_tile(first, key, SeqBandNote{key, slot, global});
                                     });
            }
            ++items;
        }
        mbar_publish_end(published, q_full, q_empty, items);
        return;
    }

    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int c = wg - 1;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const uint32_t width = static_cast<uint32_t>(left) + static_cast<uint32_t>(right);
    const float sl2 = p.scale_log2;
    const uint32_t desc_lo = wgmma_desc_sw128_lo(smem0);
    // this consumer's copy of the global keys' rows (kGlobal), of the document and head last copied
    const uint32_t global_kv = k_tile(kStages) + static_cast<uint32_t>(c) * Cfg::kGlobalBytes;
    uint32_t tiles = 0;   // as the producer's
    for (uint32_t items = 0;; ++items) {
        const int qb = items & 1;
        mbar_wait(smem_addr(&q_full[qb]), (items >> 1) & 1);
        const SeqBandItem& rec = published[qb];
        const int head = rec.head;
        if (head < 0) break;
        const int ntiles = rec.ntiles, end0 = rec.end0, end1 = rec.end1;
        const int32_t kb[3] = {rec.kbeg[0], rec.kbeg[1], rec.kbeg[2]};
        // this warpgroup's row block
        const SeqBandWindow w = rec.win[c];
        const int my_pass = rec.pass_of[c], my_list = rec.list_of[c];
        const int32_t my_kb = rec.wkb[c], my_ke = rec.wke[c];
        const int last_tile = ntiles + (kRandom ? rec.nrandom : 0);   // the passes' tiles, then the random ones
        const int32_t cr0 = w.base, crows = my_pass >= 0 ? w.rows : 0;   // this warpgroup's queries [cr0, cr0 + crows)
        const int32_t row_a = cr0 + 16 * warp + g;                 // the thread's rows: row_a, row_a + 8

        float o[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) o[i] = 0.f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
        const uint32_t q_off = q_tiles(qb) - smem0 + c * kTmaTileBytes;
        if constexpr (kGlobal) {   // Local | Global: the global keys first (warpgroup-uniform)
            if (crows > 0) {
                // (rate 1: the residue is the document; fewer live registers)
                const int32_t rho = kResidues ? w.rho : 0, doc_len = kResidues ? w.doc_len : w.len;
                const int nvalid = seq_band_global_rows(p, w.first - rho, doc_len, head, global_kv, global_copied[c], c);
                if (nvalid > 0) {
                    seq_band_global_keys<T, kResidues>(p, nvalid, q_tiles(qb) + c * kTmaTileBytes + 2048 * warp,
                                                       global_kv, row_a, rho, left, width, sl2, lane, o, m, l);
                }
            }
        }

        for (int t = 0; t < last_tile; ++t, ++tiles) {
            const int s = tiles % kStages;
            // the tile's first key (a position of the residue) and whether
            // this warpgroup computes it (warpgroup-uniform): a pass's, or a
            // random tile (after the passes': its note, read once the stage
            // is full)
            const bool pass_tile = !kRandom || t < ntiles;
            int32_t ks = 0;
            bool mine = false, rnd_tile = false, has_global = false;
            if (pass_tile) {
                const int ps = seq_band_pass_at(t, end0, end1);
                ks = seq_band_tile_key(kb, end0, end1, t, ps, kKeys);
                mine = my_pass == ps;
            }
            mbar_wait(smem_addr(&full_bar[s]), (tiles / kStages) & 1);
            if (!pass_tile) {
                const SeqBandNote note = notes[s];
                ks = note.key;
                rnd_tile = true;
                has_global = note.global != 0;
                mine = note.slot == my_list && ks < w.len;
            }
            // One step over kN keys of the stage from its 64-row box `box`
            // of K and V (the producer's boxes: 0, or 1 for a tile's upper
            // half alone), whose first key is k0.
            auto compute = [&](auto keys, int box) {
                constexpr int kN = decltype(keys)::value;
                const int32_t k0 = ks + kTmaRows * box;
                const uint32_t k_off = k_tile(s) - smem0 + box * kTmaTileBytes;
                const uint32_t v_off = v_tile(s) - smem0 + box * kTmaTileBytes;
                float sc[kN / 2];
                wgmma_fence();
#pragma unroll
                for (int k16 = 0; k16 < 4; ++k16) {
                    const uint64_t qd = wgmma_desc_sw128_at(desc_lo, q_off + 32 * k16);
                    const uint64_t kd = wgmma_desc_sw128_at(desc_lo, k_off + 32 * k16);
                    if constexpr (kN == 128) wgmma_m64n128k16_ss<T>(sc, qd, kd, k16 > 0);
                    else wgmma_m64n64k16_ss<T>(sc, qd, kd, k16 > 0);
                }
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_operands(sc);
                // no mask: a pass's keys inside the band for all 64 rows and
                // the document; a random tile away from the band's keys, the
                // document's end and the global keys
                const bool inside = rnd_tile ? seq_band_random_inside(crows, k0, my_kb, my_ke, w.len, has_global)
                                             : crows == 64 && k0 >= cr0 + 63 - left &&
                                                   int64_t(k0) + kN - 1 <= int64_t(cr0) + right && k0 + kN <= w.len;
                if (!inside) {
                    // a pass's tile: the keys the band gives; a random one:
                    // those it does not give (counted there), nor the global part
                    const uint32_t gcols =
                        kRandom && has_global ? seq_band_global_columns(p.mask, seq_global_count(p.mask, w.len), k0, t4) : 0u;
#pragma unroll
                    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int32_t key = k0 + 8 * j + 2 * t4 + e;
                            const bool kin = key < w.len && !((gcols >> (2 * j + e)) & 1u);
                            // key - row + left in [0, left + right] (mod 2^32)
                            const uint32_t d = static_cast<uint32_t>(key - row_a) + static_cast<uint32_t>(left);
                            if (!(kin && (d <= width) != rnd_tile)) sc[4 * j + e] = -INFINITY;
                            if (!(kin && (d - 8u <= width) != rnd_tile)) sc[4 * j + 2 + e] = -INFINITY;
                        }
                    }
                }
                float mx[2];
                seq_band_row_max(sc, sl2, mx);
                seq_band_move_reference(mx, m, l, o);
                uint32_t pa[kN / 16][4];
                seq_band_softmax_pack<T>(sc, sl2, m, pa, l);
                wgmma_fence();
#pragma unroll
                for (int k16 = 0; k16 < kN / 16; ++k16) {
                    wgmma_m64n64k16<T, true>(o, pa[k16], wgmma_desc_sw128_at(desc_lo, v_off + 2048 * k16), true);
                }
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_operands(o);
                wgmma_fence_operands(pa);
            };
            if (mine && (rnd_tile || (ks < my_ke && ks + kKeys > my_kb))) {
                // Where this block's keys [my_kb, my_ke) reach one half of a
                // pass's tile (its first or last), that half alone: half the
                // products and exponentials. The group's three blocks start
                // 64 keys apart, so without halves the middle one computes a
                // tile more than the others at most band widths (23 against
                // 22 at 2,721 keys a query, 14 against 13 at 1,601), and the
                // ring keeps the others waiting for it.
                constexpr int kHalf = kTmaRows;
                static_assert(kKeys == 2 * kHalf, "a tile: the producer's two 64-row boxes");
                const int half = rnd_tile ? -1 : my_ke <= ks + kHalf ? 0 : my_kb >= ks + kHalf ? 1 : -1;
                if (half < 0) compute(std::integral_constant<int, kKeys>{}, 0);
                else compute(std::integral_constant<int, kHalf>{}, half);
            }
            if (lane == 0) mbar_arrive(smem_addr(&empty_bar[s]));
        }
        if (lane == 0) mbar_arrive(smem_addr(&q_empty[qb]));   // this item's Q and record read: the buffer is free

        // O in the C layout: row g (o[4j], o[4j + 1]) and g + 8 (o[4j + 2], o[4j + 3]), dims 8j + 2 t4, + 1
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
            const int32_t row = row_a + 8 * r;
            if (row - cr0 >= crows) continue;
            const float inv = l[r] != 0.f ? 1.f / l[r] : 0.f;
            const int64_t tok = w.first + int64_t(rate) * row;
            uint32_t* dst = reinterpret_cast<uint32_t*>(reinterpret_cast<uint16_t*>(p.o_ptr) + tok * p.o_row_stride +
                                                        head * p.o_head_stride + 2 * t4);
#pragma unroll
            for (int j = 0; j < 8; ++j) dst[4 * j] = TypeTraits<T>::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            if (t4 == 0) {
                p.lse_ptr[tok * p.lse_row_stride + head * p.lse_head_stride] =
                    l[r] != 0.f ? (m[r] + __log2f(l[r])) * 0.69314718055994531f : -INFINITY;
            }
        }
    }
#else
    __trap();
#endif
}

// Whether this device runs the kernel (compiled for sm_90a: its launch
// bound). Asked once per process and dtype; no device work.
template <typename T>
bool seq_band_ready() {
    static const bool ready = wgmma_kernel_runs(seq_band_fwd_kernel<T, false, false, false>, SeqBandConfig::kThreads);
    return ready;
}

// The forward of p by the band kernel where it serves it (head dim 64
// checked by the caller; seq_band_takes' masks, the forward's 64-query row
// blocks, q, k, v as TMA describes them at the mask's rate: for a dilated
// window, at least as many tokens as the rate; sm_90a): true when launched
// (or nothing to do), false where the caller runs another. As many blocks
// as p.num_sms (the caller's count of the device's SMs; 0: the sequence
// kernel's instances run) less p.free_sms.
template <typename T>
bool run_seq_band_fwd(const SeqFwdParams& p, cudaStream_t stream) {
    using Cfg = SeqBandConfig;
    const SeqMask& mk = p.mask;
    const bool global = seq_band_global_part(mk) > 0, random = seq_band_random_part(mk) > 0;
    // A/B experiments: "0" runs the sequence kernel's instances, "g" this kernel with a block an item
    const char* env = std::getenv("GT_FUSED3S_SEQ_BAND");
    if ((env != nullptr && env[0] == '0') || !seq_band_takes(mk) || p.block_rows != 64 || p.num_sms <= 0 ||
        !seq_band_ready<T>()) {
        return false;
    }
    SeqBandMaps maps{};
    const int64_t tokens = p.num_tokens, H = p.num_heads, rate = mk.row_stride, split = tokens % rate;
    maps.split = static_cast<int32_t>(split);
    auto encode = [&](int m, int64_t first, int64_t count) {   // maps m of residues first .. first + count - 1
        return tma_encode_rate_rows(&maps.q[m], p.q_ptr, tokens, H, p.q_row_stride, p.q_head_stride, rate, first, count) &&
               tma_encode_rate_rows(&maps.k[m], p.k_ptr, tokens, H, p.k_row_stride, p.k_head_stride, rate, first, count) &&
               tma_encode_rate_rows(&maps.v[m], p.v_ptr, tokens, H, p.v_row_stride, p.v_head_stride, rate, first, count);
    };
    // (fewer tokens than the rate: some residues have none, a map none; the instances take it)
    if (tokens < rate || (split > 0 && !encode(0, 0, split)) || !encode(1, split, rate - split)) return false;
    if (p.num_windows <= 0 || p.num_heads <= 0) return true;
    const int64_t groups = (p.num_windows + SeqBandGroup::kRows - 1) / SeqBandGroup::kRows;
    const int64_t slots = seq_band_slots(groups, static_cast<int32_t>(rate)), items = slots * p.num_heads;
    // one block an SM (but the SMs left to the global rows), each walking
    // items; "g": a block an item (A/B experiments)
    const int64_t sms = std::max(1, p.num_sms - std::max(0, p.free_sms));
    const int64_t blocks = env != nullptr && env[0] == 'g' ? items : std::min<int64_t>(items, sms);
    auto launch = [&](auto global_keys, auto residues, auto random_blocks) {
        constexpr bool kGlobal = decltype(global_keys)::value, kRandom = decltype(random_blocks)::value;
        constexpr auto kernel = seq_band_fwd_kernel<T, kGlobal, decltype(residues)::value, kRandom>;
        constexpr int smem = Cfg::smem_bytes(kGlobal);
        set_max_dynamic_smem<kernel>(smem);   // (an error shows at the launch)
        kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, smem, stream>>>(p, maps, slots);
    };
    const std::false_type no;
    const std::true_type yes;
    if (rate > 1) {   // (seq_band_takes: no random part)
        global ? launch(yes, yes, no) : launch(no, yes, no);
    } else if (random) {
        global ? launch(yes, no, yes) : launch(no, no, yes);
    } else {
        global ? launch(yes, no, no) : launch(no, no, no);
    }
    return true;
}

}  // namespace gt_fused3s
