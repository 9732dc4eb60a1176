// Runs the kernel's key-set policy (csrc/kernels/seq_mask.cuh) on the CPU and
// prints every (query token, key token) it gives, one per line, so that
// tests/test_sequence.py can compare it with the masks' dense truth.
// stdin: line 1 the mask code (masks.py kernel_code), line 2 the document
// lengths. Built by the test with nvcc (the header is host + device code).
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "seq_mask.cuh"

using namespace gt_fused3s;

int main() {
    std::string line;
    std::vector<long long> code, lens;
    std::getline(std::cin, line);
    for (std::istringstream in(line); in;) { long long x; if (in >> x) code.push_back(x); }
    std::getline(std::cin, line);
    for (std::istringstream in(line); in;) { long long x; if (in >> x) lens.push_back(x); }
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

    long long start = 0, full_tiles = 0, tiles = 0;
    for (long long len : lens) {
        const int s = mk.row_stride;
        const int windows = s * (((len + s - 1) / s + 15) / 16);
        for (int wl = 0; wl < windows; ++wl) {
            const SeqWindow win = seq_window_in(start, static_cast<int32_t>(len), wl, s);
            if (win.rows == 0) continue;
            SeqTileCursor cur;
            for (bool more = cur.first(mk, win); more; more = cur.next(mk, win)) {
                ++tiles;
                bool full = true;
                for (int lane = 0; lane < 32; ++lane) {
                    const PairMeta m = seq_pair_meta(mk, win, cur, lane);
                    full &= m.mask == 0xFFu;
                    const int g = lane >> 2;
                    for (int b = 0; b < 2; ++b) {
                        for (int i = 0; i < 4; ++i) {
                            if (!((m.mask >> (4 * b + i)) & 1u)) continue;
                            const long long row = start + win.base + static_cast<long long>(s) * (g + 8 * (i >> 1));
                            const int key = m.colv[2 * b + (i & 1)];
                            std::printf("%lld %d\n", row, key);
                        }
                    }
                }
                full_tiles += full;
            }
        }
        start += len;
    }
    std::fprintf(stderr, "tiles %lld full %lld\n", tiles, full_tiles);
    return 0;
}
