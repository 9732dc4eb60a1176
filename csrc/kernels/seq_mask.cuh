// The implicit key-set policy of sequence attention: a block's keys, tile by
// tile, computed from the mask's parameters (seq_params.h), never stored.
//
// Positions are document-local (0 .. len-1). A row block holds up to 64 or
// 128 queries i_r = base + stride * r (i_r < len), in m-tiles of 16 rows (a
// sub-window each). Each mask part gives the block one or more key
// segments: keys start + step * n, n < count (the global part: the listed
// positions). A segment is walked in tiles of 64 keys (four pairs of 8-column
// TCBs, the shape of the graph kernel's tiles); per pair and warp,
// seq_pair_bits gives each thread its 8 mask bits (online_softmax.cuh). A key
// counts once: a part masks out what an earlier part gave the query, tested
// per pair first (ranges) and per entry only where they overlap.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "seq_params.h"

namespace gt_fused3s {

// Host and device: tests/seq_mask_host.cu runs the same key-set code on the CPU.
#define GT_SEQ_HD __host__ __device__ __forceinline__

GT_SEQ_HD int32_t seq_min(int32_t a, int32_t b) { return a < b ? a : b; }
GT_SEQ_HD int32_t seq_max(int32_t a, int32_t b) { return a > b ? a : b; }
GT_SEQ_HD int64_t seq_min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The global positions inside a document of L tokens (global_idx is sorted).
GT_SEQ_HD int32_t seq_global_count(const SeqMask& mk, int32_t L) {
    int32_t n = 0;
    while (n < mk.num_global && mk.global_idx[n] < L) ++n;
    return n;
}

// murmur3's 32-bit finaliser (masks.py: _fmix32).
GT_SEQ_HD uint32_t seq_mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

GT_SEQ_HD int32_t seq_gcd(int32_t a, int32_t b) {
    while (b != 0) {
        const int32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

struct SeqWindow {
    int64_t doc_start;   // token index of position 0 of the document
    int32_t len;         // document length
    int32_t base, stride;
    int32_t rows;        // valid queries (0 .. 64 in a block, 0 .. 16 in a warp's sub-window)
    int32_t rmin, rmax;  // first and last valid query position
};

constexpr int kSeqTileKeys = 64;    // keys per tile (4 pairs of 16)

// Row block wl (document-local index, `rows` queries per block) of a document
// of `len` tokens.
GT_SEQ_HD SeqWindow seq_window_in(int64_t doc_start, int32_t len, int32_t wl, int32_t s, int32_t rows) {
    SeqWindow win;
    win.doc_start = doc_start;
    win.len = len;
    const int32_t per_residue = ((len + s - 1) / s + rows - 1) / rows;
    const int32_t c = wl / per_residue, m = wl - c * per_residue;
    win.base = c + s * rows * m;
    win.stride = s;
    const int32_t left = len - win.base;   // positions from base on
    win.rows = left <= 0 ? 0 : seq_min(rows, (left + s - 1) / s);
    win.rmin = win.base;
    win.rmax = win.base + s * (win.rows - 1);
    return win;
}

// The 16 rows of m-tile m of a block (rows 16m .. 16m+15).
GT_SEQ_HD SeqWindow seq_sub_window(const SeqWindow& blk, int m) {
    SeqWindow win = blk;
    win.base = blk.base + blk.stride * 16 * m;
    win.rows = seq_max(0, seq_min(16, blk.rows - 16 * m));
    win.rmin = win.base;
    win.rmax = win.base + win.stride * (win.rows - 1);
    return win;
}

// A read of the documents' offsets: through the read-only cache on the
// device, plain on the host (tests/seq_mask_host.cu).
GT_SEQ_HD int32_t seq_ld(const int32_t* at) {
#ifdef __CUDA_ARCH__
    return __ldg(at);
#else
    return *at;
#endif
}

// The document of row block w (w below cu_windows[num_docs]): the largest
// doc with cu_windows[doc] <= w.
GT_SEQ_HD int seq_window_doc(const SeqFwdParams& p, int64_t w) {
    int lo = 0, hi = p.num_docs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seq_ld(p.cu_windows + mid) <= w) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The row block of global index w (false: past the last block).
GT_SEQ_HD bool seq_window(const SeqFwdParams& p, int64_t w, SeqWindow& win) {
    if (w >= seq_ld(p.cu_windows + p.num_docs)) return false;
    const int lo = seq_window_doc(p, w);
    const int64_t start = seq_ld(p.cu_seqlens + lo);
    win = seq_window_in(start, seq_ld(p.cu_seqlens + lo + 1) - static_cast<int32_t>(start),
                        static_cast<int32_t>(w - seq_ld(p.cu_windows + lo)), p.mask.row_stride, p.block_rows);
    return true;
}

// One key segment: keys start + step * n, n < count; step 0: the global list.
// qb: the query block a random block belongs to (its queries only), else -1.
struct KeySeg {
    int32_t start, step, count, qb;
};

// A mask of local windows only: the kernels' instances with the band's own
// loop (seq_walk.cuh: kBulkRuns) serve it.
GT_SEQ_HD bool seq_mask_local_only(const SeqMask& mk) {
    bool local = mk.num_parts > 0;
    for (int i = 0; i < mk.num_parts; ++i) local = local && mk.parts[i].kind == kSeqLocal;
    return local;
}

// Number of segments part `pt` gives the window (random blocks: one per key
// block of each query block the window's rows meet).
GT_SEQ_HD int32_t seq_num_segs(const SeqMaskPart& pt, const SeqWindow& win) {
    if (pt.kind != kSeqRandom) return 1;
    const int32_t nb = (win.len + pt.a - 1) / pt.a;
    return seq_min(pt.b, nb) * (win.rmax / pt.a - win.rmin / pt.a + 1);
}

// Random blocks: first block and step (coprime with nb) of query block qb.
GT_SEQ_HD void seq_random_walk(const SeqMaskPart& pt, int32_t qb, int32_t nb, int32_t& start,
                                                int32_t& step) {
    const uint32_t seed = static_cast<uint32_t>(pt.c);
    start = static_cast<int32_t>(seq_mix32(seq_mix32(seed ^ 0x2545F491u) + static_cast<uint32_t>(qb)) %
                                 static_cast<uint32_t>(nb));
    step = 1;
    if (nb > 2) {
        step = 1 + static_cast<int32_t>(seq_mix32(seq_mix32(seed ^ 0x9E3779B9u) + static_cast<uint32_t>(qb)) %
                                        static_cast<uint32_t>(nb - 1));
        while (seq_gcd(step, nb) != 1) step = step % (nb - 1) + 1;
    }
}

// Segment `sg` of part `pt` for the window (count 0: nothing). Random
// blocks: also the query block's step (random_step, where given).
GT_SEQ_HD KeySeg seq_segment(const SeqMask& mk, const SeqMaskPart& pt, int32_t sg,
                                              const SeqWindow& win, int32_t* random_step = nullptr) {
    KeySeg ks{0, 1, 0, -1};
    if (win.rows == 0) return ks;
    const int32_t L = win.len;
    switch (pt.kind) {
        case kSeqLocal: {
            const int32_t lo = seq_max(0, win.rmin - pt.a), hi = seq_min(L - 1, win.rmax + pt.b);
            ks.start = lo;
            ks.count = hi >= lo ? hi - lo + 1 : 0;
            break;
        }
        case kSeqDilated: {
            const int32_t r = pt.c;
            // Same residue as the queries when the window is compacted
            // (stride == rate); otherwise every position of the span.
            const int32_t step = win.stride == r ? r : 1;
            int32_t lo = win.rmin - pt.a * r;
            if (lo < 0) lo += ((-lo + step - 1) / step) * step;
            const int32_t hi = seq_min(L - 1, win.rmax + pt.b * r);
            ks.start = lo;
            ks.step = step;
            ks.count = hi >= lo ? (hi - lo) / step + 1 : 0;
            break;
        }
        case kSeqBlockDilated: {
            const int32_t seg = pt.a, r = pt.b, off = pt.c;
            const int32_t lo = (win.rmin / seg) * seg + off;
            const int32_t hi = seq_min(L - 1, (win.rmax / seg + 1) * seg - 1);
            ks.start = lo;
            ks.step = r;
            ks.count = hi >= lo ? (hi - lo) / r + 1 : 0;
            break;
        }
        case kSeqGlobal: {
            ks.step = 0;
            ks.count = seq_global_count(mk, L);
            break;
        }
        case kSeqRandom: {
            const int32_t nb = (L + pt.a - 1) / pt.a, per = seq_min(pt.b, nb);
            ks.qb = win.rmin / pt.a + sg / per;
            int32_t start, step;
            seq_random_walk(pt, ks.qb, nb, start, step);
            if (random_step != nullptr) *random_step = step;
            const int32_t kb =
                static_cast<int32_t>((static_cast<int64_t>(start) + static_cast<int64_t>(sg % per) * step) % nb);
            ks.start = kb * pt.a;
            ks.count = seq_min(L, ks.start + pt.a) - ks.start;
            break;
        }
        default: break;
    }
    return ks;
}

GT_SEQ_HD int32_t seg_key(const SeqMask& mk, const KeySeg& ks, int32_t n) {
    return ks.step == 0 ? mk.global_idx[n] : ks.start + ks.step * n;
}

// Does part pt give query i key j (positions in a document of length L)?
GT_SEQ_HD bool seq_part_allows(const SeqMask& mk, const SeqMaskPart& pt, int32_t i, int32_t j,
                                                int32_t L) {
    const int32_t d = j - i;
    switch (pt.kind) {
        case kSeqLocal: return d >= -pt.a && d <= pt.b;
        case kSeqDilated: return d % pt.c == 0 && d >= -pt.a * pt.c && d <= pt.b * pt.c;
        case kSeqBlockDilated:
            return i / pt.a == j / pt.a && (i % pt.a) % pt.b == pt.c && (j % pt.a) % pt.b == pt.c;
        case kSeqGlobal: {
            bool hit = false;
            for (int n = 0; n < mk.num_global; ++n) hit |= mk.global_idx[n] == j;
            return hit;
        }
        case kSeqRandom: {
            const int32_t nb = (L + pt.a - 1) / pt.a, kb = j / pt.a;
            int32_t start, step;
            seq_random_walk(pt, i / pt.a, nb, start, step);
            bool hit = false;
            for (int t = 0; t < seq_min(pt.b, nb); ++t)
                hit |= static_cast<int32_t>((static_cast<int64_t>(start) + static_cast<int64_t>(t) * step) % nb) == kb;
            return hit;
        }
        default: return false;
    }
}

// Could part pt give any query of the window a key in [jlo, jhi]? (A cheap
// superset test: false means no overlap.)
GT_SEQ_HD bool seq_part_may_reach(const SeqMask& mk, const SeqMaskPart& pt, const SeqWindow& win,
                                                   int32_t jlo, int32_t jhi) {
    switch (pt.kind) {
        case kSeqLocal: return jhi >= win.rmin - pt.a && jlo <= win.rmax + pt.b;
        case kSeqDilated: return jhi >= win.rmin - pt.a * pt.c && jlo <= win.rmax + pt.b * pt.c;
        case kSeqBlockDilated: return jhi >= (win.rmin / pt.a) * pt.a && jlo < (win.rmax / pt.a + 1) * pt.a;
        case kSeqGlobal: return mk.num_global > 0 && jhi >= mk.global_idx[0] && jlo <= mk.global_idx[mk.num_global - 1];
        default: return true;
    }
}

// Is every (query, key) of the tile given by its own part pt (before
// removing earlier parts)? Tiles of full windows only.
GT_SEQ_HD bool seq_part_covers(const SeqMaskPart& pt, const SeqWindow& win, const KeySeg& ks,
                                                int32_t jlo, int32_t jhi) {
    switch (pt.kind) {
        case kSeqLocal: return jlo - win.rmax >= -pt.a && jhi - win.rmin <= pt.b;
        case kSeqDilated:
            return ks.step == pt.c && win.stride == pt.c && jlo - win.rmax >= -pt.a * pt.c && jhi - win.rmin <= pt.b * pt.c;
        case kSeqBlockDilated:
            return win.stride == pt.b && ks.step == pt.b && (win.rmin % pt.a) % pt.b == pt.c &&
                   win.rmin / pt.a == win.rmax / pt.a && jlo / pt.a == win.rmin / pt.a && jhi / pt.a == win.rmin / pt.a;
        case kSeqGlobal: return true;
        case kSeqRandom: return ks.qb == win.rmin / pt.a && ks.qb == win.rmax / pt.a;
        default: return false;
    }
}

// floor(a / (64 step)) for step >= 1: a shift for step 1 (a band), an int32
// division otherwise (64-bit divisions are long subroutines on the GPU). a
// is clamped to int32 first: the callers clamp the result to [0, count / 64],
// which a clamped a leaves unchanged (a document has fewer than 2^31 keys).
GT_SEQ_HD int32_t seq_floor_div_tiles(int64_t a, int32_t step) {
    const int32_t x = static_cast<int32_t>(a < INT32_MIN ? INT32_MIN : (a > INT32_MAX ? INT32_MAX : a));
    if (step == 1) return x >> 6;   // arithmetic shift: the floor for negative x too
    const int32_t span = step * kSeqTileKeys;
    return x >= 0 ? x / span : -static_cast<int32_t>((static_cast<int64_t>(-static_cast<int64_t>(x)) + span - 1) / span);
}

// The tiles of segment ks of part `part` that seq_tile_full (below) finds
// full for a complete window, as one interval [lo, hi] (empty: lo > hi),
// where that can be said once per segment: a band part (local, or dilated)
// that no earlier part may reach anywhere in the segment. Then a tile is
// full where its keys lie inside the band for every query (seq_part_covers)
// and it has 64 keys. False: ask seq_tile_full tile by tile. (The walk's
// test per tile cost about 35 instructions a warp: a switch on the part's
// kind and the parts' parameters indexed in the parameter space.)
GT_SEQ_HD bool seq_full_tile_range(const SeqMask& mk, const SeqWindow& win, int part, const KeySeg& ks, int32_t& lo,
                                   int32_t& hi) {
    const SeqMaskPart& pt = mk.parts[part];
    if (ks.step <= 0 || ks.count <= 0 || (pt.kind != kSeqLocal && pt.kind != kSeqDilated)) return false;
    const int32_t first = ks.start, last = ks.start + ks.step * (ks.count - 1);
    for (int q = 0; q < part; ++q) {
        if (seq_part_may_reach(mk, mk.parts[q], win, first, last)) return false;
    }
    lo = 1;
    hi = 0;
    int64_t a = pt.a, b = pt.b;
    if (pt.kind == kSeqDilated) {
        if (ks.step != pt.c || win.stride != pt.c) return true;   // not compacted: no tile covered
        a *= pt.c;
        b *= pt.c;
    }
    // keys start + step n, n = 64 t .. 64 t + 63: the first >= rmax - a, the
    // last <= rmin + b, and all 64 in the segment
    const int32_t t_lo = -seq_floor_div_tiles(-(win.rmax - a - ks.start), ks.step);   // a ceiling
    const int32_t t_hi = seq_min(seq_floor_div_tiles(win.rmin + b - ks.start - static_cast<int64_t>(ks.step) * (kSeqTileKeys - 1), ks.step),
                                 ks.count / kSeqTileKeys - 1);
    if (t_hi >= 0 && t_lo <= t_hi) {
        lo = seq_max(t_lo, 0);
        hi = t_hi;
    }
    return true;
}

// One tile of the walk: keys tile * 64 .. of segment ks of part `part`.
struct SeqTile {
    int32_t part, tile;
    KeySeg ks;
};

// Walks the tiles of a block: part by part, segment by segment, 64 keys at a
// time. Uniform across the block.
//
// A random part's next block of the same query block is one addition modulo
// nb (its walk: start + t step mod nb), not seq_segment's: that one hashes
// the query block, loops a gcd to a coprime step and takes a 64-bit
// remainder, which per segment of one tile was a cost of the same order as
// the tile's MMAs and softmax (H100, BigBird 4M forward kernel: 28.0 -> 19.6 ms).
// The cursor keeps the step only (registers: the walk holds two cursors).
struct SeqTileCursor {
    int32_t part, seg, nseg, tile, ntiles;
    KeySeg ks;
    bool full_known;            // seq_full_tile_range's interval holds for this segment
    int32_t full_lo, full_hi;
    int32_t rnd_step;           // random part: the step of this query block's walk

    GT_SEQ_HD bool load_part(const SeqMask& mk, const SeqWindow& win) {
        for (; part < mk.num_parts; ++part) {
            nseg = seq_num_segs(mk.parts[part], win);
            for (; seg < nseg; ++seg) {
                ks = seq_segment(mk, mk.parts[part], seg, win, &rnd_step);
                ntiles = (ks.count + kSeqTileKeys - 1) / kSeqTileKeys;
                if (ntiles > 0) {
                    full_known = seq_full_tile_range(mk, win, part, ks, full_lo, full_hi);
                    return true;
                }
            }
            seg = 0;
        }
        return false;
    }
    GT_SEQ_HD SeqTile at() const { return SeqTile{part, tile, ks}; }
    GT_SEQ_HD bool first(const SeqMask& mk, const SeqWindow& win) {
        part = seg = tile = 0;
        return load_part(mk, win);
    }
    // kRandomSteps false: every segment from seq_segment (the same keys; the
    // walk's instances for local masks leave the random steps' code out)
    template <bool kRandomSteps = true>
    GT_SEQ_HD bool next(const SeqMask& mk, const SeqWindow& win) {
        if (++tile < ntiles) return true;
        tile = 0;
        ++seg;
        const SeqMaskPart& pt = mk.parts[part];
        if (kRandomSteps && pt.kind == kSeqRandom && seg < nseg) {
            const int32_t nb = (win.len + pt.a - 1) / pt.a;
            if (seg % seq_min(pt.b, nb) != 0) {   // the same query block's next block (seq_segment's, without its walk)
                int32_t kb = ks.start / pt.a + rnd_step;
                if (kb >= nb) kb -= nb;
                ks.start = kb * pt.a;
                ks.count = seq_min(win.len, ks.start + pt.a) - ks.start;   // >= 1: kb < nb
                ntiles = (ks.count + kSeqTileKeys - 1) / kSeqTileKeys;
                full_known = false;   // (seq_full_tile_range: bands only)
                return true;
            }
        }
        return load_part(mk, win);
    }
};

// Element e = 4b + i of this thread in a pair's tile: key kc of the pair and
// the query's position `row`; false when the key is past the segment's end
// (kc >= valid) or the query past the sub-window. Forward: keys by column
// (8b + 2t + (i & 1)), queries g, g + 8 by row; kKeyRows: keys g, g + 8 by
// row, queries by column.
template <bool kKeyRows>
GT_SEQ_HD bool seq_pair_elem(const SeqWindow& win, int lane, int e, int32_t valid, int& kc, int32_t& row) {
    const int g = lane >> 2, t = lane & 3, b = e >> 2, i = e & 3;
    const int across = 8 * b + 2 * t + (i & 1), down = (i < 2) ? g : g + 8;
    kc = kKeyRows ? down : across;
    const int qr = kKeyRows ? across : down;
    row = win.base + win.stride * qr;
    return kc < valid && qr < win.rows;
}

// Is part `own` a band over this segment: a local part, or a dilated one
// whose rows and keys are compacted to one residue (row stride and key step
// both the rate), so that j - i is a multiple of the rate by construction?
// Its offsets j - i then lie in [lo, hi].
GT_SEQ_HD bool seq_part_band(const SeqMaskPart& own, const SeqWindow& win, const KeySeg& ks, int32_t& lo, int32_t& hi) {
    if (own.kind == kSeqLocal) {
        lo = -own.a;
        hi = own.b;
        return true;
    }
    if (own.kind == kSeqDilated && ks.step == own.c && win.stride == own.c) {
        lo = -own.a * own.c;
        hi = own.b * own.c;
        return true;
    }
    return false;
}

// The 8 bits of a pair of a band part (seq_part_band: offsets in [lo, hi])
// with no earlier part near it (the edge of a band: most masked pairs): one
// range test per element. A band's keys are a progression (step >= 1, never
// the global list), so key - row is one base plus the element's multiples
// of the step and the row stride (the global list's lookup, in seg_key, is
// left out of the composite masks' hottest loop).
template <bool kKeyRows>
GT_SEQ_HD uint32_t seq_band_pair_bits(const SeqWindow& win, int32_t lo, int32_t hi, const KeySeg& ks, int32_t n0,
                                      int32_t valid, int lane) {
    const int32_t base = ks.start + ks.step * n0 - win.base;
    uint32_t bits = 0u;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        int kc;
        int32_t row;
        const bool in = seq_pair_elem<kKeyRows>(win, lane, e, valid, kc, row);
        const int32_t d = base + ks.step * kc - (row - win.base);
        bits |= static_cast<uint32_t>(in && d >= lo && d <= hi) << e;
    }
    return bits;
}

// This thread's 8 mask bits (online_softmax.cuh: bit 4b + i, b: TCB of
// keys n0 .. n0+7 or n0+8 .. n0+15, i: rows g (0, 1), g + 8 (2, 3)) for the
// pair of keys n0 .. n0+15 of segment ks of part `part`, over the queries of
// sub-window win. Returns false (and no bits) when no query of win can have
// one of the pair's keys: the warp skips the pair. kKeyRows: the transposed
// tile of the backward (S^T = K Q^T: the pair's keys are the rows g, g + 8,
// the sub-window's queries the columns: b: queries 0 .. 7 or 8 .. 15, i & 1:
// query 8b + 2t + (i & 1)); the pair-level tests are the same.
template <bool kKeyRows = false>
GT_SEQ_HD bool seq_pair_bits(const SeqMask& mk, const SeqWindow& win, int part, const KeySeg& ks, int32_t n0,
                             int lane, uint32_t& bits) {
    bits = 0u;
    const int32_t valid = seq_min(16, ks.count - n0);   // keys in this pair
    if (valid <= 0 || win.rows <= 0) return false;
    const int32_t jlo = seg_key(mk, ks, n0), jhi = seg_key(mk, ks, n0 + valid - 1);
    const SeqMaskPart& own = mk.parts[part];
    if (!seq_part_may_reach(mk, own, win, jlo, jhi)) return false;
    // a random block serves the queries of its query block (16-row
    // sub-windows lie in one: blocks are multiples of 16 tokens, stride 1)
    if (own.kind == kSeqRandom && ks.qb != win.rmin / own.a) return false;
    bool overlap = false;   // could an earlier part give one of these keys?
    for (int q = 0; q < part; ++q) overlap |= seq_part_may_reach(mk, mk.parts[q], win, jlo, jhi);
    if (!overlap && win.rows == 16 && valid == 16 && seq_part_covers(own, win, ks, jlo, jhi)) {
        bits = 0xFFu;
        return true;
    }
    int32_t lo, hi;
    if (!overlap && seq_part_band(own, win, ks, lo, hi)) {
        bits = seq_band_pair_bits<kKeyRows>(win, lo, hi, ks, n0, valid, lane);
        return true;
    }
    // Everything else, element by element (a loop: unrolled, the switches of
    // the part tests would be eight copies in the instruction cache).
#pragma unroll 1
    for (int e = 0; e < 8; ++e) {
        int kc;
        int32_t row;
        bool on = seq_pair_elem<kKeyRows>(win, lane, e, valid, kc, row);
        const int32_t j = on ? seg_key(mk, ks, n0 + kc) : -1;
        // the own part: by construction for global and random segments
        if (on && own.kind != kSeqGlobal && own.kind != kSeqRandom) on = seq_part_allows(mk, own, row, j, win.len);
        for (int q = 0; on && q < part; ++q) on = !seq_part_allows(mk, mk.parts[q], row, j, win.len);
        bits |= static_cast<uint32_t>(on) << e;
    }
    return true;
}

// The bits of a tile's pairs by pair tests (band edges, overlapping parts,
// short segments): kept out of line, so that the kernel's loop over the
// inside of a band stays small in the instruction cache. Returned in one
// register pair (no array through local memory): pair sl's bits at bit
// 8 sl of the low word, the pairs the warp computes at bit sl of the high.
// The window and the segment come by value: by reference, the caller's copies
// (the tile cursor) would live in local memory for the whole walk.
static __host__ __device__ __noinline__ uint64_t seq_tile_bits_slow(const SeqMask& mk, const SeqWindow win, int part,
                                                                    const KeySeg ks, int32_t n0, int lane) {
    uint32_t on = 0u, packed = 0u;
#pragma unroll 1
    for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
        uint32_t b;
        if (seq_pair_bits(mk, win, part, ks, n0 + 16 * sl, lane, b)) {
            on |= 1u << sl;
            packed |= b << (8 * sl);
        }
    }
    return (static_cast<uint64_t>(on) << 32) | packed;
}

// Does part `part` alone give every query of `win` (all `rows` of it valid)
// every key of the tile n0 .. n0+63, with no earlier part near it? Then
// the tile needs no mask bits: the inside of a band. Uniform across the
// threads that share win (a warp's sub-window, or a whole row block).
GT_SEQ_HD bool seq_tile_full(const SeqMask& mk, const SeqWindow& win, int32_t rows, int part, const KeySeg& ks,
                             int32_t n0) {
    if (win.rows != rows || ks.count - n0 < kSeqTileKeys) return false;
    const int32_t jlo = seg_key(mk, ks, n0), jhi = seg_key(mk, ks, n0 + kSeqTileKeys - 1);
    for (int q = 0; q < part; ++q) {
        if (seq_part_may_reach(mk, mk.parts[q], win, jlo, jhi)) return false;
    }
    return seq_part_covers(mk.parts[part], win, ks, jlo, jhi);
}

// seq_tile_full of the cursor's tile for the block `win` of `rows` queries,
// from the segment's interval where the cursor has one.
GT_SEQ_HD bool seq_cursor_full(const SeqMask& mk, const SeqWindow& win, int32_t rows, const SeqTileCursor& c) {
    if (c.full_known) return win.rows == rows && c.tile >= c.full_lo && c.tile <= c.full_hi;
    return seq_tile_full(mk, win, rows, c.part, c.ks, c.tile * kSeqTileKeys);
}

// The bits of a whole tile (keys n0 .. n0+63, all in the segment) of the
// mask's first part where that part is a band (seq_part_band: offsets in
// [lo, hi], keys and rows both s apart), for a sub-window of 16 valid rows:
// an unsigned range test per element on the offsets' progression, key - row
// = ks.start - win.base + s (n0 + 16 sl + 8b + 2t + (i & 1) - g - 8 (i >> 1))
// for bit 4b + i of pair sl, with no per-part tests; `on`: the pairs whose
// offsets can reach [lo, hi] (warp-uniform: mma.sync skips the others).
// False (no bits) for any other tile. Probed on an H100 (every mask bit set,
// the output then wrong), the per-part tests took 10% of the local 1M
// forward (1.179 -> 1.065 ms) and a third of a 65-key band's (README).
GT_SEQ_HD bool seq_band_tile_bits(const SeqMask& mk, const SeqWindow& win, int part, const KeySeg& ks, int32_t n0,
                                  int lane, uint32_t (&bits)[kSeqTileKeys / 16], uint32_t& on) {
    int32_t lo, hi;
    if (part != 0 || win.rows != 16 || ks.count - n0 < kSeqTileKeys || ks.step != win.stride ||
        !seq_part_band(mk.parts[0], win, ks, lo, hi)) {
        return false;
    }
    const int g = lane >> 2, t = lane & 3;
    const int32_t s = ks.step;
    const int32_t c0 = ks.start - win.base - lo + s * n0;   // (key - row) - lo of key n0, row 0
    const int32_t x0 = c0 + s * (2 * t - g);                 // of this thread's bit 0, pair 0
    const uint32_t width = static_cast<uint32_t>(hi - lo);
    on = 0u;
#pragma unroll
    for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
        // a pair's offsets: c0 + s (16 sl + column - row), column and row in 0 .. 15
        on |= static_cast<uint32_t>(c0 + s * (16 * sl + 15) >= 0 &&
                                    c0 + s * (16 * sl - 15) <= static_cast<int32_t>(width)) << sl;
        uint32_t b = 0u;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int off = 16 * sl + 8 * (e >> 2) + (e & 1) - 8 * ((e >> 1) & 1);
            b |= static_cast<uint32_t>(static_cast<uint32_t>(x0 + s * off) <= width) << e;
        }
        bits[sl] = b;
    }
    return true;
}

// The bits of a tile of the global list's keys that no earlier part can
// reach for the sub-window's rows (most row blocks: the global keys lie far
// from their band): every valid entry, key n0 + kc < count and row < rows,
// since the global part gives its keys to every query. `on`: the pairs with
// keys (warp-uniform). False (no bits) for any other tile, which then takes
// the per-entry tests of the earlier parts.
GT_SEQ_HD bool seq_global_tile_bits(const SeqMask& mk, const SeqWindow& win, int part, const KeySeg& ks, int32_t n0,
                                    int lane, uint32_t (&bits)[kSeqTileKeys / 16], uint32_t& on) {
    const int32_t valid = seq_min(kSeqTileKeys, ks.count - n0);
    if (ks.step != 0 || win.rows <= 0 || valid <= 0) return false;   // step 0: the global list's segment
    const int32_t jlo = mk.global_idx[n0], jhi = mk.global_idx[n0 + valid - 1];   // (sorted)
    for (int q = 0; q < part; ++q) {
        if (seq_part_may_reach(mk, mk.parts[q], win, jlo, jhi)) return false;
    }
    const int g = lane >> 2, t = lane & 3;
    on = 0u;
#pragma unroll
    for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
        const int32_t keys = valid - 16 * sl;   // of this pair
        on |= static_cast<uint32_t>(keys > 0) << sl;
        uint32_t b = 0u;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int kc = 8 * (e >> 2) + 2 * t + (e & 1), qr = g + 8 * ((e >> 1) & 1);
            b |= static_cast<uint32_t>(kc < keys && qr < win.rows) << e;
        }
        bits[sl] = b;
    }
    return true;
}

// The bits of the tile's four pairs (keys n0 .. n0+63) for sub-window win:
// bits[sl] of pair sl (0 for pairs the warp skips); returns the pairs the
// warp computes (bit sl). A full tile (seq_tile_full) takes one test instead
// of four.
GT_SEQ_HD uint32_t seq_tile_bits(const SeqMask& mk, const SeqWindow& win, int part, const KeySeg& ks, int32_t n0,
                                 int lane, uint32_t (&bits)[kSeqTileKeys / 16]) {
    constexpr int kPairs = kSeqTileKeys / 16;
    uint32_t on;
    if (seq_band_tile_bits(mk, win, part, ks, n0, lane, bits, on)) return on;
    if (seq_global_tile_bits(mk, win, part, ks, n0, lane, bits, on)) return on;
    if (seq_tile_full(mk, win, 16, part, ks, n0)) {
#pragma unroll
        for (int sl = 0; sl < kPairs; ++sl) bits[sl] = 0xFFu;
        return (1u << kPairs) - 1u;
    }
    // A band part's tile with no earlier part near it (a band's edge: every
    // masked tile of Longformer's and BigBird's windows, and of compacted
    // dilated ones) inline: the call to the slow path costs its registers'
    // saves and restores.
    const SeqMaskPart& own = mk.parts[part];
    const int32_t tile_valid = seq_min(kSeqTileKeys, ks.count - n0);
    int32_t lo, hi;
    if (win.rows > 0 && tile_valid > 0 && seq_part_band(own, win, ks, lo, hi)) {
        const int32_t jlo = seg_key(mk, ks, n0), jhi = seg_key(mk, ks, n0 + tile_valid - 1);
        bool overlap = false;
        for (int q = 0; q < part; ++q) overlap |= seq_part_may_reach(mk, mk.parts[q], win, jlo, jhi);
        if (!overlap) {
            uint32_t on = 0u;
#pragma unroll
            for (int sl = 0; sl < kPairs; ++sl) {
                const int32_t p0 = n0 + 16 * sl, valid = seq_min(16, ks.count - p0);
                bits[sl] = 0u;
                if (valid <= 0 || !seq_part_may_reach(mk, own, win, seg_key(mk, ks, p0), seg_key(mk, ks, p0 + valid - 1))) {
                    continue;   // warp-uniform
                }
                on |= 1u << sl;
                bits[sl] = seq_band_pair_bits<false>(win, lo, hi, ks, p0, valid, lane);
            }
            return on;
        }
    }
    const uint64_t r = seq_tile_bits_slow(mk, win, part, ks, n0, lane);
#pragma unroll
    for (int sl = 0; sl < kPairs; ++sl) bits[sl] = static_cast<uint32_t>(r >> (8 * sl)) & 0xFFu;
    return static_cast<uint32_t>(r >> 32);
}

}  // namespace gt_fused3s
