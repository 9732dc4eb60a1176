// Runs the kernel's key-set policy (csrc/kernels/seq_mask.cuh) on the CPU, as
// the kernel walks it (row blocks, 64-key tiles, each warp's pairs), and
// prints every (query token, key token) it gives, one per line, so that
// tests/test_sequence.py can compare it with the masks' dense truth.
// stdin: line 1 the mask code (masks.py kernel_code), line 2 the document
// lengths, line 3 the queries per row block, line 4 (optional) 1 for the
// backward's transposed walk (keys as rows), 2 for the walk of the backward
// by key blocks (seq_bwd_keys_kernel.cuh: the forward's walk over the
// transposed mask, seq_mask_transpose; printed as (query, key) all the same),
// 3 for the band kernel's schedule (band_walk), 4 for the band backward's
// (band_bwd_walk). Built by the test with nvcc
// (the headers are host + device code).
// stderr: counts of the forward walk's tiles (per warp pair: computed, full;
// per block tile: full, and where the walk's per-segment interval,
// seq_cursor_full, disagreed with seq_tile_full; per warp tile: those a
// band's closed form gives, seq_band_tile_bits, and its bits that differ
// from the per-pair tests' or lie in a pair it skips; lanes of a warp whose
// computed pairs differ: mma.sync needs them warp-uniform).
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "seq_band_bwd.cuh"
#include "seq_band_fwd.cuh"
#include "seq_mask.cuh"

using namespace gt_fused3s;

// Line 4 = 3: the band kernel's schedule (seq_band_fwd.cuh: groups of three
// 64-query row blocks found by SeqBandGroup, their passes over 128-key
// tiles of a residue's positions, each consumer's tiles, the band's and the
// global keys' tests: seq_band_gives and seq_band_position, the kernel's own
// code; the band tiles' loop writes the same test inline): prints the pairs
// its consumers compute; with a random part, then its random tiles as
// the producer walks them (SeqBandGroup::for_random_tiles) and each
// consumer's test of them. stderr: "band 1" where the kernel takes the mask
// (seq_band_takes: one local window, or a dilated one at its rate, alone or
// with global keys, or a local window with random blocks of a multiple of
// 128 keys, and at least as many tokens as the rate: the launch's rule),
// else "band 0" and no pairs; "lost" counts row blocks
// with queries in groups that find none. A pair's tokens are those the
// producer's TMA maps bring (seq_band_map_coords, seq_band_map_of, the
// bounds tma_encode_rate_rows gives each map), -1 where a map's row lies
// past its bounds (the TMA's zeros).
static int band_walk(const SeqMask& mk, const std::vector<long long>& lens) {
    const int32_t rate = mk.row_stride;
    std::vector<int32_t> cu{0}, cw{0};
    for (long long len : lens) {   // (ops.seq_windows)
        cu.push_back(cu.back() + static_cast<int32_t>(len));
        cw.push_back(cw.back() + static_cast<int32_t>(rate * (((len + rate - 1) / rate + 63) / 64)));
    }
    const bool takes = seq_band_takes(mk) && cu.back() >= rate;
    std::fprintf(stderr, "band %d ", takes ? 1 : 0);
    if (!takes) return 0;
    const bool global = seq_band_global_part(mk) > 0;
    const int random_part = seq_band_random_part(mk);
    const int64_t tokens = cu.back();
    const int32_t split = static_cast<int32_t>(tokens % rate);
    // the token of position x of a tile (or Q block) at position x0 of the pass starting at token `first`
    auto map_token = [&](int32_t first, int32_t x0, int32_t x) -> long long {
        int32_t residue = 0, row = 0;
        seq_band_map_coords(first, x0, rate, residue, row);
        const int m = seq_band_map_of(split, residue);
        const int64_t first_residue = m ? split : 0, count = m ? rate - split : split;
        const int64_t positions = (tokens - first_residue + rate - 1) / rate, r = row + (x - x0);
        return residue < count && r < positions ? first_residue + residue + static_cast<int64_t>(rate) * r : -1;
    };
    SeqFwdParams p{};
    p.cu_seqlens = cu.data();
    p.cu_windows = cw.data();
    p.num_docs = static_cast<int32_t>(lens.size());
    p.block_rows = 64;
    p.mask = mk;
    const int32_t left = mk.parts[0].a, right = mk.parts[0].b;
    const uint32_t width = static_cast<uint32_t>(left) + static_cast<uint32_t>(right);
    constexpr int kKeys = SeqBandConfig::kKeys;
    const int64_t groups = (cw.back() + SeqBandGroup::kRows - 1) / SeqBandGroup::kRows;
    const int64_t slots = seq_band_slots(groups, rate);
    long long lost = 0;
    for (int64_t t = 0; t < slots; ++t) {   // the kernel's order of the groups
        const int64_t g = seq_band_group(t, slots, rate);
        SeqBandGroup grp;
        if (!grp.find(p, g, left, right, kKeys, rate)) {   // lost: a block holds queries (seq_window, the general form)
            for (int c = 0; c < SeqBandGroup::kRows; ++c) {
                SeqWindow w{};
                lost += seq_window(p, SeqBandGroup::kRows * g + c, w) && w.rows > 0;
            }
            continue;
        }
        if (random_part > 0) grp.find_random(mk.parts[random_part]);
        for (int c = 0; c < SeqBandGroup::kRows; ++c) {
            SeqBandItem rec{};   // what the producer publishes; the consumers read only this
            rec.set(grp, 0, random_part > 0);
            if (rec.pass_of[c] < 0) continue;
            const SeqBandWindow& w = rec.win[c];
            const int32_t kb[3] = {rec.kbeg[0], rec.kbeg[1], rec.kbeg[2]};
            auto token = [&](int32_t row) { return map_token(w.first, w.base, row); };   // a query's, by the Q map
            for (int t = 0; t < rec.ntiles; ++t) {   // the consumer's loop
                const int ps = rec.pass_at(t);
                const int32_t ks = seq_band_tile_key(kb, rec.end0, rec.end1, t, ps, kKeys);
                if (!(rec.pass_of[c] == ps && ks < rec.wke[c] && ks + kKeys > rec.wkb[c])) continue;
                for (int32_t row = w.base; row < w.base + w.rows; ++row) {
                    for (int32_t key = ks; key < ks + kKeys; ++key) {
                        if (key < w.len && seq_band_gives(key, row, left, width)) {
                            std::printf("%lld %lld\n", token(row), map_token(w.first, ks, key));
                        }
                    }
                }
            }
            if (random_part > 0) {   // the producer's random tiles (their notes), and this consumer's test
                const int nglobal = seq_global_count(mk, w.len);
                grp.for_random_tiles(mk, mk.parts[random_part], [&](int32_t first, int32_t ks, int slot, bool has_global) {
                    if (!(slot == rec.list_of[c] && ks < w.len)) return;
                    if (seq_band_random_inside(w.rows, ks, rec.wkb[c], rec.wke[c], w.len, has_global)) {   // no mask
                        for (int32_t row = w.base; row < w.base + w.rows; ++row) {
                            for (int32_t key = ks; key < ks + kKeys; ++key) {
                                std::printf("%lld %lld\n", token(row), map_token(first, ks, key));
                            }
                        }
                        return;
                    }
                    for (int t4 = 0; t4 < 4; ++t4) {   // the kernel's per-thread columns 8 j + 2 t4 + e
                        const uint32_t gcols = has_global ? seq_band_global_columns(mk, nglobal, ks, t4) : 0u;
                        for (int j = 0; j < kKeys / 8; ++j) {
                            for (int e = 0; e < 2; ++e) {
                                const int32_t key = ks + 8 * j + 2 * t4 + e;
                                if (!(key < w.len && !((gcols >> (2 * j + e)) & 1u))) continue;
                                for (int32_t row = w.base; row < w.base + w.rows; ++row) {
                                    if (!seq_band_gives(key, row, left, width)) {
                                        std::printf("%lld %lld\n", token(row), map_token(first, ks, key));
                                    }
                                }
                            }
                        }
                    }
                });
            }
            if (!global) continue;
            const long long doc = static_cast<long long>(w.first) - w.rho;
            for (int slot = 0; slot < seq_global_count(mk, w.doc_len); ++slot) {
                const int32_t j = mk.global_idx[slot];
                int32_t pos = 0;
                const bool in_residue = seq_band_position(j, w.rho, rate, pos);
                for (int32_t row = w.base; row < w.base + w.rows; ++row) {
                    if (!(in_residue && seq_band_gives(pos, row, left, width))) std::printf("%lld %lld\n", token(row), doc + j);
                }
            }
        }
    }
    std::fprintf(stderr, "lost %lld ", lost);
    return 0;
}

// Line 4 = 4: the band backward's schedule (seq_band_bwd.cuh: pairs of
// 64-key blocks of the transposed mask found by SeqBandPair, their passes
// over 64-query tiles, each consumer's live tiles, full tiles and mask
// bits as every thread of it computes them: the kernel's own functions):
// prints the (query, key) pairs its consumers compute. stderr: "bandbwd 1"
// where the kernel takes the mask (seq_mask_transpose, seq_band_bwd_takes),
// else "bandbwd 0" and no pairs; "lost": key blocks with keys in pairs that
// find none; "full": full tiles computed (all 64 x 64 pairs).
static int band_bwd_walk(const SeqMask& mask, const std::vector<long long>& lens) {
    SeqMask mk{};
    const bool takes = seq_mask_transpose(mask, mk) && seq_band_bwd_takes(mk);
    std::fprintf(stderr, "bandbwd %d ", takes ? 1 : 0);
    if (!takes) return 0;
    std::vector<int32_t> cu{0}, cw{0};
    for (long long len : lens) {   // (ops.seq_windows, rate 1)
        cu.push_back(cu.back() + static_cast<int32_t>(len));
        cw.push_back(cw.back() + static_cast<int32_t>((len + 63) / 64));
    }
    SeqFwdParams p{};
    p.cu_seqlens = cu.data();
    p.cu_windows = cw.data();
    p.num_docs = static_cast<int32_t>(lens.size());
    p.num_windows = cw.back();
    const int32_t left = mk.parts[0].a, right = mk.parts[0].b;
    const uint32_t width = static_cast<uint32_t>(left) + static_cast<uint32_t>(right);
    long long lost = 0, full_tiles = 0;
    for (int64_t g = 0; g < (p.num_windows + 1) / 2; ++g) {
        SeqBandPair pr;
        if (!pr.find(p, g, left, right)) {
            for (int c = 0; c < 2; ++c) {
                SeqBandWindow w;
                lost += seq_band_window(p, 2 * g + c, 1, w);
            }
            continue;
        }
        SeqBandBwdItem rec;
        rec.set(pr, 0);
        for (int tt = 0; tt < rec.ntiles; ++tt) {   // as the consumers walk them
            const int ps = tt < rec.end0 ? 0 : 1;
            const int32_t ks = rec.kbeg[ps] + kSeqTileKeys * (tt - (ps ? rec.end0 : 0));
            for (int c = 0; c < 2; ++c) {
                if (!rec.live(c, ps, ks)) continue;
                const int32_t cr0 = rec.base[c], crows = rec.rows[c], len = rec.len[c];
                const long long doc = rec.first[ps];
                if (seq_band_bwd_full(crows, cr0, ks, left, right, len)) {
                    ++full_tiles;
                    for (int r = 0; r < 64; ++r) {
                        for (int n = 0; n < kSeqTileKeys; ++n) std::printf("%lld %lld\n", doc + ks + n, doc + cr0 + r);
                    }
                    continue;
                }
                for (int warp = 0; warp < 4; ++warp) {
                    for (int lane = 0; lane < 32; ++lane) {
                        const int g4 = lane >> 2, t = lane & 3;
                        const int32_t row_a = cr0 + 16 * warp + g4;
                        uint32_t bits[4];
                        seq_band_bwd_bits(ks, row_a, cr0 + crows, len, left, width, t, bits);
                        for (int j = 0; j < 8; ++j) {
                            for (int e = 0; e < 4; ++e) {
                                if ((bits[j >> 1] >> (4 * (j & 1) + e)) & 1u) {
                                    std::printf("%lld %lld\n", doc + ks + 8 * j + 2 * t + (e & 1), doc + row_a + 8 * (e >> 1));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    std::fprintf(stderr, "lost %lld full %lld ", lost, full_tiles);
    return 0;
}

int main() {
    std::string line;
    std::vector<long long> code, lens;
    std::getline(std::cin, line);
    for (std::istringstream in(line); in;) { long long x; if (in >> x) code.push_back(x); }
    std::getline(std::cin, line);
    for (std::istringstream in(line); in;) { long long x; if (in >> x) lens.push_back(x); }
    int block_rows = 64;   // line 3: queries per row block (64 or 128)
    if (std::getline(std::cin, line)) std::istringstream(line) >> block_rows;
    int key_rows = 0;      // line 4: 1 walks as the backward does (seq_bwd_kernel.cuh: seq_pair_bits<true>)
    if (std::getline(std::cin, line)) std::istringstream(line) >> key_rows;
    SeqMask mk{};
    size_t at = 0;
    mk.row_stride = static_cast<int32_t>(code[at++]);
    mk.num_parts = static_cast<int32_t>(code[at++]);
    for (int i = 0; i < mk.num_parts; ++i) {
        SeqMaskPart& p = mk.parts[i];
        p.kind = code[at]; p.a = code[at + 1]; p.b = code[at + 2]; p.c = code[at + 3]; p.d = code[at + 4];
        at += 5;
    }
    mk.num_global = static_cast<int32_t>(code[at++]);
    for (int i = 0; i < mk.num_global; ++i) mk.global_idx[i] = static_cast<int32_t>(code[at++]);
    if (key_rows == 3) return band_walk(mk, lens);
    if (key_rows == 4) return band_bwd_walk(mk, lens);
    const bool by_keys = key_rows == 2;
    if (by_keys) {
        SeqMask t{};
        const bool ok = seq_mask_transpose(mk, t);
        std::fprintf(stderr, "transposable %d ", ok ? 1 : 0);
        if (!ok) return 0;
        mk = t;
        key_rows = 0;
    }

    // tiles: pairs a warp computes (not skipped), full: those without per-entry tests
    long long start = 0, full_tiles = 0, tiles = 0, block_full = 0, block_full_mismatches = 0;
    long long band_tiles = 0, band_mismatches = 0;   // seq_band_tile_bits: warp tiles, and bits unlike seq_pair_bits
    long long global_tiles = 0;                      // seq_global_tile_bits' (their mismatches counted with the band's)
    long long nonuniform_pairs = 0;                  // lanes whose computed pairs differ from lane 0's
    for (long long len : lens) {
        const int s = mk.row_stride;
        const int blocks = s * (((len + s - 1) / s + block_rows - 1) / block_rows);
        for (int wl = 0; wl < blocks; ++wl) {
            const SeqWindow blk = seq_window_in(start, static_cast<int32_t>(len), wl, s, block_rows);
            if (blk.rows == 0) continue;
            SeqTileCursor cur;
            for (bool more = cur.first(mk, blk); more; more = cur.next(mk, blk)) {
                // the walk's block-level test from the segment's interval against the tile's own test
                const bool by_range = seq_cursor_full(mk, blk, block_rows, cur);
                const bool by_tile = seq_tile_full(mk, blk, block_rows, cur.part, cur.ks, cur.tile * kSeqTileKeys);
                block_full_mismatches += by_range != by_tile;
                block_full += by_tile;
                if (key_rows) {   // warp sl: the 16 keys of slice sl against every m-tile of queries
                    for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
                        const int32_t n0 = cur.tile * kSeqTileKeys + 16 * sl;
                        for (int m = 0; m < block_rows / 16; ++m) {
                            const SeqWindow win = seq_sub_window(blk, m);
                            for (int lane = 0; lane < 32; ++lane) {
                                uint32_t bits;
                                if (!seq_pair_bits<true>(mk, win, cur.part, cur.ks, n0, lane, bits)) continue;
                                const int g = lane >> 2, t = lane & 3;
                                for (int b = 0; b < 2; ++b) {
                                    for (int i = 0; i < 4; ++i) {
                                        if (!((bits >> (4 * b + i)) & 1u)) continue;
                                        const long long row = start + win.base + static_cast<long long>(s) * (8 * b + 2 * t + (i & 1));
                                        const long long key = start + seg_key(mk, cur.ks, n0 + g + 8 * (i >> 1));
                                        std::printf("%lld %lld\n", row, key);
                                    }
                                }
                            }
                        }
                    }
                    continue;
                }
                for (int w = 0; w < block_rows / 16; ++w) {
                    const SeqWindow win = seq_sub_window(blk, w);
                    // a band's or the global keys' tile by its closed form against the per-pair tests
                    for (int lane = 0; lane < 32; ++lane) {
                        uint32_t fast[kSeqTileKeys / 16], on;
                        const int32_t n0 = cur.tile * kSeqTileKeys;
                        if (seq_band_tile_bits(mk, win, cur.part, cur.ks, n0, lane, fast, on)) {
                            band_tiles += lane == 0;
                        } else if (seq_global_tile_bits(mk, win, cur.part, cur.ks, n0, lane, fast, on)) {
                            global_tiles += lane == 0;
                        } else {
                            break;
                        }
                        for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
                            uint32_t bits;
                            if (!seq_pair_bits(mk, win, cur.part, cur.ks, cur.tile * kSeqTileKeys + 16 * sl, lane, bits)) {
                                bits = 0u;
                            }
                            band_mismatches += bits != fast[sl] || (bits != 0u && !((on >> sl) & 1u));
                        }
                    }
                    for (int sl = 0; sl < kSeqTileKeys / 16; ++sl) {
                        const int32_t n0 = cur.tile * kSeqTileKeys + 16 * sl;
                        bool computed = false, full = true;
                        uint32_t on0 = 0u;
                        for (int lane = 0; lane < 32; ++lane) {
                            uint32_t tile_bits[kSeqTileKeys / 16];
                            const uint32_t on = seq_tile_bits(mk, win, cur.part, cur.ks, cur.tile * kSeqTileKeys, lane,
                                                              tile_bits);
                            if (lane == 0) on0 = on;
                            nonuniform_pairs += on != on0;   // mma.sync needs the warp's pairs uniform
                            if (!((on >> sl) & 1u)) continue;
                            const uint32_t bits = tile_bits[sl];
                            computed = true;
                            full &= bits == 0xFFu;
                            const int g = lane >> 2, t = lane & 3;
                            const int cols[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
                            for (int b = 0; b < 2; ++b) {
                                for (int i = 0; i < 4; ++i) {
                                    if (!((bits >> (4 * b + i)) & 1u)) continue;
                                    const long long row = start + win.base + static_cast<long long>(s) * (g + 8 * (i >> 1));
                                    const long long key = start + seg_key(mk, cur.ks, n0 + cols[2 * b + (i & 1)]);
                                    if (by_keys) std::printf("%lld %lld\n", key, row);   // (a query, a key)
                                    else std::printf("%lld %lld\n", row, key);
                                }
                            }
                        }
                        tiles += computed;
                        full_tiles += computed && full;
                    }
                }
            }
        }
        start += len;
    }
    std::fprintf(stderr, "tiles %lld full %lld block_full %lld block_full_mismatches %lld band_tiles %lld "
                 "band_mismatches %lld nonuniform_pairs %lld global_tiles %lld\n", tiles, full_tiles, block_full,
                 block_full_mismatches, band_tiles, band_mismatches, nonuniform_pairs, global_tiles);
    return 0;
}
