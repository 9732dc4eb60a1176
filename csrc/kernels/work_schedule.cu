// The work schedule on the GPU (work_schedule.h): what schedule.py's
// work_schedule_from_counts computes in about 80 aten ops (most of them a
// launch: 1.3-2.8 ms of host time per schedule in an eager plan build on the
// H100 machine's host), as three small kernels, two scans and one sort.
//
//   window_chunks   per window p (heaviest first): its chunk count and length
//   scans           ends = inclusive sum of the chunk counts (item i belongs to
//                   the window p = #(ends <= i)); a split window's first slot
//   make_items      per item: its window, TCB range, slot and work (its key);
//                   a split window's slot rows
//   sort            items by work, descending, stable (equal work keeps the
//                   windows' order, as torch.sort(stable=True) does), then a
//                   gather of the rows in that order
#include "work_schedule.h"
#include "build_scratch.h"

#include <algorithm>

#include <cub/cub.cuh>

namespace gt_fused3s {
namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads)); }

// A chunk holds at most max(threshold, C) = threshold TCBs (a window of at
// most `threshold` is one chunk; a split one's chunks hold ceil(cnt / nch)
// <= C rounded up to even, and C is even), so the sort key work + 1 lies in
// [0, threshold + 1] (work -1: an unused item) and needs this many bits.
inline int work_key_bits(int32_t threshold) {
    int bits = 1;
    while (bits < 32 && ((static_cast<uint32_t>(threshold) + 1) >> bits) != 0) ++bits;
    return bits;
}

struct Layout {
    size_t nch, length, split_n, ends, split_first, rows, keys_in, keys_out, vals_in, vals_out, temp, temp_bytes, total;
};

Layout make_layout(int32_t R, int32_t I) {
    size_t scan_bytes = 0, sort_bytes = 0;
    cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), R);
    size_t escan_bytes = 0;
    cub::DeviceScan::ExclusiveSum(nullptr, escan_bytes, static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), R);
    cub::DeviceRadixSort::SortPairsDescending(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                              static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                              static_cast<int32_t*>(nullptr), I);
    Layout l{};
    ScratchLayout c;
    l.nch = c.take(sizeof(int32_t) * R);
    l.length = c.take(sizeof(int32_t) * R);
    l.split_n = c.take(sizeof(int32_t) * R);
    l.ends = c.take(sizeof(int32_t) * R);
    l.split_first = c.take(sizeof(int32_t) * R);
    l.rows = c.take(sizeof(int4) * I);
    l.keys_in = c.take(sizeof(uint32_t) * I);
    l.keys_out = c.take(sizeof(uint32_t) * I);
    l.vals_in = c.take(sizeof(int32_t) * I);
    l.vals_out = c.take(sizeof(int32_t) * I);
    l.temp_bytes = std::max({scan_bytes, escan_bytes, sort_bytes, size_t(1)});
    l.temp = c.take(l.temp_bytes);
    l.total = c.bytes;
    return l;
}

// schedule.py: nch = ceil(cnt / C) where cnt > threshold, else 1; the chunk
// length that count gives, rounded up to even; nch again from that length.
__global__ void window_chunks(const WorkScheduleParams p, int32_t* __restrict__ nch, int32_t* __restrict__ length,
                              int32_t* __restrict__ split_n) {
    const int64_t w = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    if (w >= p.num_windows) return;
    const int32_t win = p.window_order[w];
    const int64_t cnt = p.rw_offset[win + 1] - p.rw_offset[win];
    int64_t n = cnt > p.threshold ? (cnt + p.chunk - 1) / p.chunk : 1;
    const int64_t len = ((cnt + n - 1) / n + 1) / 2 * 2;
    n = cnt > 0 ? (cnt + len - 1) / (len > 0 ? len : 1) : 1;
    nch[w] = static_cast<int32_t>(n);
    length[w] = static_cast<int32_t>(len);
    split_n[w] = n > 1 ? static_cast<int32_t>(n) : 0;
}

__global__ void make_items(const WorkScheduleParams p, const int32_t* __restrict__ nch,
                           const int32_t* __restrict__ length, const int32_t* __restrict__ split_n,
                           const int32_t* __restrict__ ends, const int32_t* __restrict__ split_first,
                           int4* __restrict__ rows, uint32_t* __restrict__ keys, int32_t* __restrict__ vals,
                           uint32_t key_max) {
    const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    const int32_t R = p.num_windows;
    if (i == 0) {
        p.counts[0] = ends[R - 1];
        p.counts[1] = static_cast<int64_t>(split_first[R - 1]) + split_n[R - 1];
    }
    if (i >= p.num_items) return;
    int32_t lo = 0, hi = R;                         // the window: #(ends <= i)
    while (lo < hi) {
        const int32_t mid = (lo + hi) >> 1;
        if (ends[mid] <= i) lo = mid + 1;
        else hi = mid;
    }
    const bool used = lo < R;
    const int32_t w = used ? lo : R - 1;
    const int32_t chunk = static_cast<int32_t>(i - (ends[w] - nch[w]));
    const int32_t win = p.window_order[w];
    const int32_t begin = p.rw_offset[win] + chunk * length[w];
    const int32_t end = min(begin + length[w], p.rw_offset[win + 1]);
    const bool split = used && nch[w] > 1;
    const int32_t slot = split ? split_first[w] + chunk : -1;
    rows[i] = make_int4(used ? win : -1, used ? begin : 0, used ? end : 0, slot);
    keys[i] = min(static_cast<uint32_t>(used ? end - begin + 1 : 0), key_max);
    vals[i] = static_cast<int32_t>(i);
    if (split && slot < p.num_slots)
        reinterpret_cast<int4*>(p.slots)[slot] = make_int4(win, split_first[w], split_first[w] + nch[w], 0);
}

__global__ void gather_items(const WorkScheduleParams p, const int4* __restrict__ rows,
                             const int32_t* __restrict__ order) {
    const int64_t j = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    if (j < p.num_items) reinterpret_cast<int4*>(p.items)[j] = rows[order[j]];
}

}  // namespace

size_t work_schedule_workspace_bytes(int32_t num_windows, int32_t num_items) {
    return make_layout(num_windows, num_items).total;
}

cudaError_t run_work_schedule(const WorkScheduleParams& p, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
    const int32_t R = p.num_windows, I = p.num_items;
    const Layout l = make_layout(R, I);
    if (workspace_bytes < l.total || R <= 0 || p.chunk <= 0 || p.threshold < p.chunk) return cudaErrorInvalidValue;
    auto* base = static_cast<char*>(workspace);
    auto* nch = reinterpret_cast<int32_t*>(base + l.nch);
    auto* length = reinterpret_cast<int32_t*>(base + l.length);
    auto* split_n = reinterpret_cast<int32_t*>(base + l.split_n);
    auto* ends = reinterpret_cast<int32_t*>(base + l.ends);
    auto* split_first = reinterpret_cast<int32_t*>(base + l.split_first);
    auto* rows = reinterpret_cast<int4*>(base + l.rows);
    auto* keys_in = reinterpret_cast<uint32_t*>(base + l.keys_in);
    auto* keys_out = reinterpret_cast<uint32_t*>(base + l.keys_out);
    auto* vals_in = reinterpret_cast<int32_t*>(base + l.vals_in);
    auto* vals_out = reinterpret_cast<int32_t*>(base + l.vals_out);
    void* temp = base + l.temp;
    size_t temp_bytes = l.temp_bytes;
    const int bits = work_key_bits(p.threshold);

    GT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.slots, 0, sizeof(int32_t) * 4 * static_cast<size_t>(p.num_slots), stream));
    window_chunks<<<blocks_for(R), kThreads, 0, stream>>>(p, nch, length, split_n);
    GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    GT_CUDA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveSum(temp, temp_bytes, nch, ends, R, stream));
    temp_bytes = l.temp_bytes;
    GT_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, split_n, split_first, R, stream));
    make_items<<<blocks_for(I), kThreads, 0, stream>>>(p, nch, length, split_n, ends, split_first, rows, keys_in,
                                                       vals_in, (1u << bits) - 1u);
    GT_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (I == 0) return cudaSuccess;
    temp_bytes = l.temp_bytes;
    GT_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, keys_in, keys_out, vals_in,
                                                                      vals_out, I, 0, bits, stream));
    gather_items<<<blocks_for(I), kThreads, 0, stream>>>(p, rows, vals_out);
    return cudaGetLastError();
}

}  // namespace gt_fused3s
