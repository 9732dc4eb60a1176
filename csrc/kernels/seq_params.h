// Parameter block of sparse attention over sequences with a structured mask
// computed inside the kernel (local, dilated, block-dilated, global columns,
// random blocks, and unions of them; gt_fused3s/sequence/masks.py holds the
// same definitions in Python). No torch header here.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gt_fused3s {

// Part kinds, in the order the kernel visits them (each key counts once: a
// part skips the keys an earlier part already gave a query).
enum SeqPartKind : int32_t {
    kSeqLocal = 1,          // a = left, b = right:            -a <= j - i <= b
    kSeqDilated = 2,        // a = left, b = right, c = rate:  j - i = k c, -a <= k <= b
    kSeqBlockDilated = 3,   // a = segment, b = rate, c = offset (LongNet)
    kSeqGlobal = 4,         // the key columns of SeqMask::global_idx (global rows: outside the kernel)
    kSeqRandom = 5,         // a = block (a multiple of 16), b = blocks per query block, c = seed (BigBird)
};

constexpr int kSeqMaxParts = 5;
constexpr int kSeqMaxGlobal = 32;

struct SeqMaskPart {
    int32_t kind, a, b, c, d;
};

struct SeqMask {
    // Row blocks hold queries base + row_stride * r (row_stride > 1: the
    // queries of one residue of a dilated mask, whose keys are then
    // consecutive in the same strided order: dense tiles).
    int32_t row_stride;
    int32_t num_parts;
    SeqMaskPart parts[kSeqMaxParts];
    int32_t num_global;
    int32_t global_idx[kSeqMaxGlobal];   // sorted positions within a document
};

struct SeqFwdParams {
    // q, k, v, out: [T, H, D] (T tokens of all documents), last dim
    // contiguous, 16-byte aligned rows; strides in elements.
    const void* q_ptr;
    const void* k_ptr;
    const void* v_ptr;
    void* o_ptr;
    int64_t q_row_stride, q_head_stride;
    int64_t k_row_stride, k_head_stride;
    int64_t v_row_stride, v_head_stride;
    int64_t o_row_stride, o_head_stride;
    float* lse_ptr;   // [T, H] fp32, natural log; -inf for a query without keys
    int64_t lse_row_stride, lse_head_stride;

    // Documents: tokens cu_seqlens[d] .. cu_seqlens[d+1]-1, and row blocks of
    // block_rows queries cu_windows[d] .. cu_windows[d+1]-1 (row_stride *
    // ceil(ceil(len / row_stride) / block_rows) each). num_windows: the
    // launch's upper bound on cu_windows[num_docs] (one thread block each).
    // block_rows: seq_block_rows(head dim).
    const int32_t* cu_seqlens;
    const int32_t* cu_windows;
    int64_t num_tokens;   // T (the TMA's tensor maps describe q, k, v's full extent)
    int32_t num_docs;
    int64_t num_windows;
    int32_t block_rows;

    int32_t num_heads;
    float scale_log2;   // scale * log2(e)
    SeqMask mask;
    // The device's SMs (the caller asks once: the band kernel is persistent),
    // and those it leaves to the global rows' kernels running beside it on
    // another stream (0: it takes every SM).
    int32_t num_sms, free_sms;
};

// The backward (seq_bwd_kernel.cuh): the forward's parameters (q, k, v, the
// documents, the mask and scale_log2; lse_ptr: the forward's log-sum-exp,
// read; o_ptr unused) and the gradients' operands.
struct SeqBwdParams {
    SeqFwdParams fwd;
    const void* do_ptr;   // dO [T, H, D], the dtype of q
    int64_t do_row_stride, do_head_stride;
    // (lse log2(e), rowsum(dO * O)) of query t, head h at ld_ptr[h * ld_head_stride + 2 t] (seq_bwd_prep)
    const float* ld_ptr;
    int64_t ld_head_stride;
    // dQ, dK, dV: [T, H, D], one set of strides. dK and dV (fp32) are added
    // to with atomics: the caller zeroes them. dQ is written once a query, in
    // q's dtype (no fp32 buffer and cast after: 1.5 bytes of traffic a byte
    // of dQ fewer).
    void* dq_ptr;
    float* dk_ptr;
    float* dv_ptr;
    int64_t grad_row_stride, grad_head_stride;
    float scale;
};

// The backward by key blocks (seq_bwd_keys_kernel.cuh, sm_90a, D = 64): fwd
// holds q, k, v, the documents, the key blocks (the forward's row blocks of
// 64, applied to keys) and the transposed mask (seq_mask_transpose); the
// gradients' operands follow.
struct SeqBwdKeysParams {
    SeqFwdParams fwd;
    const void* do_ptr;   // dO [T, H, D], the dtype of q
    int64_t do_row_stride, do_head_stride;
    const float* ld_ptr;   // (lse log2(e), rowsum(dO * O)) per query, as in SeqBwdParams
    int64_t ld_head_stride;
    // dQ [T, H, D] fp32, added to with atomics (the caller zeroes it); dK and
    // dV [T, H, D] in q's dtype, written. One set of strides.
    float* dq_ptr;
    void* dk_ptr;
    void* dv_ptr;
    int64_t grad_row_stride, grad_head_stride;
    float scale;
    // The band backward's next work item (seq_band_bwd.cuh), 0 at the
    // launch (seq_bwd_prep zeroes it); null: each block strides the items.
    unsigned long long* item_counter;
};

// The mask of the transposed pattern (rows: keys, columns: queries), where it
// is one: local and dilated parts with their sides swapped, block-dilated
// ones as they are. False for global and random parts (their transposes are
// not of the kinds the walk knows).
inline bool seq_mask_transpose(const SeqMask& mask, SeqMask& out) {
    out = mask;
    for (int i = 0; i < mask.num_parts; ++i) {
        SeqMaskPart& pt = out.parts[i];
        if (pt.kind == kSeqLocal || pt.kind == kSeqDilated) {
            const int32_t a = pt.a;
            pt.a = pt.b;
            pt.b = a;
        } else if (pt.kind != kSeqBlockDilated) {
            return false;
        }
    }
    return mask.num_global == 0;
}

// Per (token, head) of the backward's queries: (lse log2(e), rowsum(dO * O)),
// head-major (a head's pairs consecutive by token: one TMA box per key tile
// of the backward by key blocks). ld_head_stride: 2 T rounded up to a
// multiple of 4 floats (16-byte aligned heads).
struct SeqBwdPrepParams {
    const void* do_ptr;
    const void* o_ptr;
    int64_t do_row_stride, do_head_stride, o_row_stride, o_head_stride;
    const float* lse_ptr;   // [T, H] fp32 contiguous
    float* ld_ptr;          // [H, ld_head_stride] fp32
    int64_t ld_head_stride;
    int64_t num_tokens;
    int32_t num_heads;
    unsigned long long* counter;   // set to 0 here (the band backward's item counter); null: none
};

// Queries per thread block: 4 warps of one m-tile of 16 (two per warp for
// D <= 64 measured slower on an H100). gt_fused3s/sequence/attention.py
// computes cu_windows with the same rule.
constexpr int seq_block_rows(int /* head_dim */) { return 64; }

// Launches the forward on `stream`. T: __half or __nv_bfloat16; HeadDim in
// {32, 64, 128}.
template <typename T, int HeadDim>
void run_seq_fwd(const SeqFwdParams& params, cudaStream_t stream);

// Queries per thread block of the backward: 128 for D <= 64 (twice the
// forward's: half the atomics on dK and dV), 64 for D = 128 (whose registers
// spill with two m-tiles of dQ per warp). Its cu_windows are computed with
// this size (gt_fused3s/sequence/attention.py: _bwd_block_rows).
constexpr int seq_bwd_block_rows(int head_dim) { return head_dim <= 64 ? 128 : 64; }

// Launches the backward on `stream` (same types and head dims).
template <typename T, int HeadDim>
void run_seq_bwd(const SeqBwdParams& params, cudaStream_t stream);
template <typename T, int HeadDim>
void run_seq_bwd_prep(const SeqBwdPrepParams& params, cudaStream_t stream);
// The backward by key blocks (T: __half or __nv_bfloat16, D = 64), and
// whether this process's device runs it (a Hopper GPU, code built for sm_90a).
template <typename T>
void run_seq_bwd_keys(const SeqBwdKeysParams& params, cudaStream_t stream);
template <typename T>
bool seq_bwd_keys_ready();

}  // namespace gt_fused3s
