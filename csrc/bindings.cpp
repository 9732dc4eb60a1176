// The only file that includes torch: input checks (each message names its
// input), device guard, current stream, params, dispatch on dtype x head dim,
// the CUDA implementations of the ops gt_fused3s/ops.py defines.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/bsb_build.h"
#include "kernels/dense_rows.h"
#include "kernels/edge_slots.h"
#include "kernels/work_schedule.h"
#include "kernels/edge_terms.h"
#include "kernels/fused3s_bwd_params.h"
#include "kernels/fused3s_params.h"
#include "kernels/gather_rows.h"
#include "kernels/head_project.h"
#include "kernels/rows8_params.h"
#include "kernels/seq_params.h"

namespace gt_fused3s {
namespace {

// torch's Python names (float64, not Double), as users see them.
const char* dtype_name(at::ScalarType t) {
    switch (t) {
        case at::kHalf: return "float16";
        case at::kBFloat16: return "bfloat16";
        case at::kFloat: return "float32";
        case at::kDouble: return "float64";
        case at::kInt: return "int32";
        case at::kLong: return "int64";
        case at::kShort: return "int16";
        case at::kChar: return "int8";
        case at::kByte: return "uint8";
        case at::kBool: return "bool";
        default: return c10::toString(t);
    }
}

// Numbers and shapes are formatted with snprintf / std::to_string, not through
// std::ostream: streaming numbers from this library crashed (SIGSEGV) on the
// device machine's torch build, strings and devices did not.
std::string num(int64_t x) { return std::to_string(x); }
std::string num(double x) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%g", x);
    return buf;
}
std::string shape(c10::IntArrayRef s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
}

// t itself if its last dim is contiguous, its row and head strides are
// multiples of 8 elements and it starts at a 16-byte aligned address (every
// row and head then starts 16-byte aligned), else a contiguous copy.
at::Tensor aligned_rows(const at::Tensor& t) {
    const bool ok = (t.size(2) <= 1 || t.stride(2) == 1) && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    return ok ? t : t.contiguous();
}

// q, k, v (and the backward's dO, O) as the kernels take them: the dtype
// and shape of q, last dim contiguous, rows and heads 16-byte aligned. A
// tensor that is not (a column slice of a wider projection, say) is copied
// here, where the check costs nothing next to the Python caller's.
at::Tensor kernel_input(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rows = -1) {
    TORCH_CHECK(t.defined(), name, " must be a tensor (got an undefined tensor)");
    TORCH_CHECK(t.device() == q.device(), name, " must be on the device of q (", q.device().str(), "), got ",
                t.device().str());
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name,
                " must be fp16 or bf16 (got ", dtype_name(t.scalar_type()), ")");
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have the dtype of q (",
                dtype_name(q.scalar_type()), "), got ", dtype_name(t.scalar_type()));
    TORCH_CHECK(t.dim() == 3, name, " must have shape [N, H, D] (got ", shape(t.sizes()), ")");
    if (rows < 0) {
        TORCH_CHECK(t.sizes() == q.sizes(), name, " must have the shape of q ", shape(q.sizes()), " (got ",
                    shape(t.sizes()), ")");
    } else {
        TORCH_CHECK(t.size(0) == rows && t.size(1) == q.size(1) && t.size(2) == q.size(2), name,
                    " must have shape ", shape({rows, q.size(1), q.size(2)}), " (got ", shape(t.sizes()), ")");
    }
    return aligned_rows(t);
}

// k and v: [N, H, D] with q's heads and head dim; N, the graph's node count,
// may exceed q's rows (a graph whose destinations are its first q.size(0)
// nodes: the rows of one rank's share of a partitioned graph, say).
std::pair<at::Tensor, at::Tensor> key_value_inputs(const at::Tensor& k_in, const at::Tensor& v_in,
                                                   const at::Tensor& q) {
    TORCH_CHECK(k_in.defined() && k_in.dim() == 3, "k must have shape [N, H, D]");
    const at::Tensor k = kernel_input(k_in, "k", q, k_in.size(0)), v = kernel_input(v_in, "v", q, k_in.size(0));
    TORCH_CHECK(q.size(0) <= k.size(0), "q has ", num(q.size(0)), " rows, more than the ", num(k.size(0)),
                " nodes of k and v");
    return {k, v};
}

// `q`: the tensor whose device t must share, named `q_name` in the message.
void check_index(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& q,
                 const char* q_name = "q") {
    TORCH_CHECK(t.defined(), name, " must be a tensor (got an undefined tensor)");
    TORCH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on the device of ", q_name, " (",
                q.device().str(), "), got ", t.device().str());
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype_name(dtype), " (got ",
                dtype_name(t.scalar_type()), ")");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// An [E, H] fp32 contiguous per-edge array on q's device, if given.
void check_edge_array(const std::optional<at::Tensor>& t, const char* name, int64_t E, const at::Tensor& q) {
    if (!t.has_value()) return;
    TORCH_CHECK(t->device() == q.device(), name, " must be on the device of q (", q.device().str(), "), got ",
                t->device().str());
    TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32 (got ", dtype_name(t->scalar_type()), ")");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == E && t->size(1) == q.size(1), name, " must have shape [E, H] = ",
                shape({E, q.size(1)}), " (got ", shape(t->sizes()), ")");
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
}

// The edge slots of one pass (nnz_offset [T + 1], slot_edge [E], int32;
// slot_pos [E] uint8), which every per-edge term needs. Returns whether given
// (then E = slot_edge's size).
bool check_slots(const std::optional<at::Tensor>& nnz_offset, const std::optional<at::Tensor>& slot_edge,
                 const std::optional<at::Tensor>& slot_pos, const at::Tensor& bitmap, const at::Tensor& q,
                 const char* which) {
    const std::string pre = which;
    TORCH_CHECK(nnz_offset.has_value() == slot_edge.has_value() && slot_edge.has_value() == slot_pos.has_value(), pre,
                "nnz_offset, slot_edge and slot_pos come together (GraphPlan.bias_args)");
    if (!slot_edge.has_value()) return false;
    check_index(*nnz_offset, (pre + "nnz_offset").c_str(), at::kInt, q);
    check_index(*slot_edge, (pre + "slot_edge").c_str(), at::kInt, q);
    check_index(*slot_pos, (pre + "slot_pos").c_str(), at::kByte, q);
    TORCH_CHECK(nnz_offset->dim() == 1 && nnz_offset->numel() == bitmap.size(0) + 1, pre, "nnz_offset must have T + 1 = ",
                num(bitmap.size(0) + 1), " entries (got ", num(nnz_offset->numel()), ")");
    TORCH_CHECK(slot_edge->dim() == 1, pre, "slot_edge must be 1-D");
    TORCH_CHECK(slot_pos->dim() == 1 && slot_pos->numel() == slot_edge->numel(), pre,
                "slot_pos must have one entry per non-zero, as slot_edge (", num(slot_edge->numel()), "; got ",
                num(slot_pos->numel()), ")");
    return true;
}

// The multiprocessors of CUDA device `dev`, and whether it is an sm_90
// (H100 / H200), each asked once per device (no driver call on a launch's
// path after the first).
int sm_count(int dev) {
    static int count[64] = {};
    int& n = count[dev & 63];
    if (n == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
}
bool is_sm90(int dev) {
    static int known[64] = {};   // 0 not asked, 1 no, 2 yes
    int& k = known[dev & 63];
    if (k == 0) {
        int major = 0, minor = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        k = major == 9 && minor == 0 ? 2 : 1;
    }
    return k == 2;
}

// The kernel instance: 0 no edge terms, 1 edge terms, 2 edge terms and dropout.
int edge_mode(bool has_edges, double dropout_p) { return has_edges ? (dropout_p > 0.0 ? 2 : 1) : 0; }

// Heads one warp of the kernels runs (fused3s_fwd_kernel.cuh and
// fused3s_bwd_kernel.cuh: head groups), at head dims 16 and 32: the most
// that fit a head dim of 64, divide H and leave the caller's per-edge arrays
// (`edge_arrays`, [E, H] fp32) aligned for one access per edge, where they
// were measured faster (H100, README "Head groups"): where a resident group
// walks at least 100 TCBs (the 200k power-law graph); where the windows are
// small and alike (molecule batches: at most 4 TCBs a window on average;
// with edge terms groups of at most 2 there, 4 measured slower on ZINC); and
// where an item has at least two groups and a resident group walks at least
// 10 TCBs (pubmed, github at 8 heads). Elsewhere a head a warp (cora at any
// heads; pubmed and github with the whole item's heads in one group: the
// group runs its longest item's heads in turn, which set those kernels'
// time). `tcbs` and `windows` are the pass's format's (a static plan's TCB
// capacity reads as more TCBs). GT_FUSED3S_HEAD_GROUP=g asks for up to g
// heads a warp wherever allowed (1: none), for experiments; it is read at
// every launch.
int head_group(int64_t heads, int64_t head_dim, int64_t tcbs, int64_t windows, const at::Tensor& on, bool edge_terms,
               std::initializer_list<const std::optional<at::Tensor>*> edge_arrays) {
    if (heads == 1) return 1;
    int g = max_head_group(static_cast<int>(head_dim));
    while (g > 1 && heads % g != 0) g /= 2;
    for (const auto* a : edge_arrays) {
        while (g > 1 && a->has_value() && reinterpret_cast<uintptr_t>((*a)->data_ptr()) % (4 * g) != 0) g /= 2;
    }
    if (const char* env = std::getenv("GT_FUSED3S_HEAD_GROUP")) {
        const int want = std::atoi(env);
        while (g > 1 && g > want) g /= 2;
        return g;
    }
    if (g == 1) return 1;
    const int sms = sm_count(on.get_device());
    const int64_t resident = static_cast<int64_t>(sms) * (g * head_dim <= 32 ? 16 : 12);   // groups an SM holds
    const int64_t per_group = tcbs * (heads / g);   // TCBs x groups: the work in group walks
    if (per_group >= 100 * resident || (heads / g >= 2 && per_group >= 10 * resident)) return g;
    if (tcbs <= 4 * windows) return edge_terms ? std::min(g, 2) : g;
    return 1;
}

void check_dropout(double p) {
    TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1) (got ", num(p), ")");
}

// Attention dropout of one pass, keyed by the caller's edge id of each
// non-zero (through slot_edge of this pass's BSB), so every pass draws the
// same mask.
// seed_t: the seed as an int64 tensor of one element on q's device instead
// of `seed` (drawn on the GPU inside a capture or a compiled region: the
// kernels read it there, so each replay's new seed is the one used).
void set_dropout(EdgeBiasArgs& eb, double p, int64_t seed, const std::optional<at::Tensor>& seed_t,
                 const at::Tensor& q) {
    const double t = std::floor(p * 4294967296.0 + 0.5);
    eb.drop_threshold = p > 0.0 ? static_cast<uint32_t>(std::min(t, 4294967295.0)) : 0u;
    eb.drop_scale = p > 0.0 ? static_cast<float>(1.0 / (1.0 - p)) : 1.f;
    const uint64_t s = static_cast<uint64_t>(seed);
    eb.seed_lo = static_cast<uint32_t>(s);
    eb.seed_hi = static_cast<uint32_t>(s >> 32);
    eb.seed_ptr = nullptr;
    if (seed_t.has_value()) {
        const at::Tensor& st = *seed_t;
        TORCH_CHECK_VALUE(st.defined() && st.is_cuda() && st.device() == q.device(),
                          "dropout_seed tensor must be on ", q.device().str(), " (got ",
                          st.defined() ? st.device().str() : std::string("an undefined tensor"), ")");
        TORCH_CHECK_VALUE(st.scalar_type() == at::kLong && st.numel() == 1,
                          "dropout_seed tensor must be one int64 (got ", dtype_name(st.scalar_type()), " ",
                          shape(st.sizes()), ")");
        eb.seed_ptr = reinterpret_cast<const uint32_t*>(st.data_ptr<int64_t>());
    }
}

const float* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// The edge terms of one pass: per-edge arrays [E, H] in the caller's edge
// order, reached through this pass's slot_edge (nnz_offset, slot_edge absent:
// no edge terms).
EdgeBiasArgs edge_args(const std::optional<at::Tensor>& nnz_offset, const std::optional<at::Tensor>& slot_edge,
                       const std::optional<at::Tensor>& slot_pos, int64_t num_heads,
                       const std::optional<at::Tensor>& bias, float* grad, const std::optional<at::Tensor>& dp_bias) {
    if (!nnz_offset.has_value()) return EdgeBiasArgs{};
    EdgeBiasArgs eb{};
    eb.bias = opt_ptr(bias);
    eb.grad = grad;
    eb.dp_bias = opt_ptr(dp_bias);
    eb.nnz_offset = nnz_offset->data_ptr<int32_t>();
    eb.slot_edge = slot_edge->data_ptr<int32_t>();
    eb.slot_pos = slot_pos->data_ptr<uint8_t>();
    eb.num_heads = static_cast<int32_t>(num_heads);
    return eb;
}

template <typename T, int kEdges>
void launch_for_head_dim(int64_t d, const Fused3SParams& params, cudaStream_t stream) {
    switch (d) {
        case 16: run_fused3s_fwd<T, 16, kEdges>(params, stream); break;
        case 32: run_fused3s_fwd<T, 32, kEdges>(params, stream); break;
        case 64: run_fused3s_fwd<T, 64, kEdges>(params, stream); break;
        case 128: run_fused3s_fwd<T, 128, kEdges>(params, stream); break;
        case 256: run_fused3s_fwd<T, 256, kEdges>(params, stream); break;
        default: TORCH_CHECK(false, "head dim ", num(d), " is not compiled (16, 32, 64, 128, 256)");
    }
}

// q, k, v of a launch [rows, heads, D] (the graph's or the sequence's
// params): pointers, and row and head strides in elements.
template <typename Params>
void set_qkv(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    p.q_ptr = q.data_ptr();
    p.k_ptr = k.data_ptr();
    p.v_ptr = v.data_ptr();
    p.q_row_stride = q.stride(0); p.q_head_stride = q.stride(1);
    p.k_row_stride = k.stride(0); p.k_head_stride = k.stride(1);
    p.v_row_stride = v.stride(0); p.v_head_stride = v.stride(1);
}

// The forward: out, lse and (return_scores, which needs the edge slots)
// each edge's raw dot product q_i.k_j [E, H] fp32 in the caller's edge order
// (else an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_impl(
        const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& rw_offset,
        const at::Tensor& cols, const at::Tensor& bitmap, const at::Tensor& window_order, const at::Tensor& items,
        const at::Tensor& slots, double scale, bool out_fp32, const std::optional<at::Tensor>& edge_bias,
        const std::optional<at::Tensor>& nnz_offset, const std::optional<at::Tensor>& slot_edge,
        const std::optional<at::Tensor>& slot_pos, double dropout_p, int64_t dropout_seed,
        const std::optional<at::Tensor>& dropout_seed_t, bool return_scores) {
    TORCH_CHECK(q_in.defined(), "q must be a tensor (got an undefined tensor)");
    TORCH_CHECK(q_in.is_cuda(), "q must be a CUDA tensor (got device ", q_in.device().str(), ")");
    const at::Tensor q = kernel_input(q_in, "q", q_in);
    const auto [k, v] = key_value_inputs(k_in, v_in, q);
    // N: the graph's nodes (k, v); Nq <= N: the destination rows (q, out)
    const int64_t N = k.size(0), Nq = q.size(0), H = q.size(1), D = q.size(2);
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256,
                "head dim D must be 16, 32, 64, 128 or 256 (got ", num(D), "); pad other multiples of 8");
    TORCH_CHECK(N < (int64_t(1) << 31), "k has ", num(N), " nodes, more than the int32 format allows");
    TORCH_CHECK(H >= 1, "q must have at least one head (got H = ", num(H), ")");

    check_index(rw_offset, "rw_offset", at::kInt, q);
    check_index(cols, "cols", at::kInt, q);
    check_index(bitmap, "bitmap", at::kLong, q);
    check_index(window_order, "window_order", at::kInt, q);
    check_index(items, "items", at::kInt, q);
    check_index(slots, "slots", at::kInt, q);
    const int64_t R = (N + 15) / 16;
    TORCH_CHECK(rw_offset.dim() == 1 && rw_offset.numel() == R + 1, "rw_offset has ", num(rw_offset.numel()),
                " entries but k has N = ", num(N), " nodes, which needs ceil(N / 16) + 1 = ", num(R + 1),
                "; the BSB was built for another graph");
    TORCH_CHECK(window_order.dim() == 1 && window_order.numel() == R, "window_order has ",
                num(window_order.numel()), " entries but k has N = ", num(N), " nodes, which needs ceil(N / 16) = ",
                num(R), "; the BSB was built for another graph");
    TORCH_CHECK(bitmap.dim() == 2 && bitmap.size(1) == 2, "bitmap must have shape [T, 2] (got ",
                shape(bitmap.sizes()), ")");
    const int64_t T = bitmap.size(0);
    TORCH_CHECK(cols.dim() == 1 && cols.numel() == 8 * T, "cols must have 8 * T = ", num(8 * T), " entries (got ",
                num(cols.numel()), ")");
    TORCH_CHECK(T < (int64_t(1) << 28), "too many TCBs (", num(T), ") for int32 column offsets");
    TORCH_CHECK(items.dim() == 2 && items.size(1) == 4, "items must have shape [I, 4] (got ", shape(items.sizes()), ")");
    TORCH_CHECK(slots.dim() == 2 && slots.size(1) == 4, "slots must have shape [S, 4] (got ", shape(slots.sizes()), ")");
    TORCH_CHECK(items.size(0) >= R, "items has ", num(items.size(0)), " rows, fewer than the ", num(R),
                " row windows; the schedule was built for another graph");
    TORCH_CHECK(items.size(0) * H < (int64_t(1) << 31) - (int64_t(1) << 24), "too many work items (",
                num(items.size(0)), " x ", num(H), " heads)");
    TORCH_CHECK(slots.size(0) * H * 16 * D < (int64_t(1) << 40), "partial workspace too large");
    TORCH_CHECK(std::isfinite(scale), "scale must be finite (got ", num(scale), ")");
    const bool has_bias = check_slots(nnz_offset, slot_edge, slot_pos, bitmap, q, "");   // the edge-term instance
    TORCH_CHECK(has_bias || (!edge_bias.has_value() && dropout_p == 0.0),
                "an edge_bias or dropout needs the graph's edge slots (GraphPlan.bias_args)");
    if (has_bias) check_edge_array(edge_bias, "edge_bias", slot_edge->numel(), q);
    check_dropout(dropout_p);
    TORCH_CHECK(has_bias || !return_scores, "scores need the graph's edge slots (GraphPlan.bias_args)");

    const c10::cuda::CUDAGuard device_guard(q.device());
    auto out = at::empty({Nq, H, D}, q.options().dtype(out_fp32 ? at::kFloat : q.scalar_type()));
    auto lse = at::empty({Nq, H}, q.options().dtype(at::kFloat));
    auto scores = at::empty({return_scores ? slot_edge->numel() : 0, H}, q.options().dtype(at::kFloat));
    if (Nq == 0) return {out, lse, scores};
    // Workspace of split windows only (most batches split none: no allocation).
    const int64_t S = slots.size(0);
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor part_o, part_ml, counters;
    if (S > 0) {
        part_o = at::empty({S, H, 16, D}, f32);
        part_ml = at::empty({S, H, 16, 2}, f32);
        counters = at::empty({S * H}, q.options().dtype(at::kInt));
    }

    Fused3SParams p{};
    set_qkv(p, q, k, v);
    p.o_ptr = out.data_ptr();
    p.o_row_stride = out.stride(0); p.o_head_stride = out.stride(1);
    p.out_fp32 = out_fp32;
    p.lse_ptr = lse.data_ptr<float>();
    p.lse_row_stride = lse.stride(0); p.lse_head_stride = lse.stride(1);
    p.cols_ptr = cols.data_ptr<int32_t>();
    p.bitmap_ptr = reinterpret_cast<const uint64_t*>(bitmap.data_ptr<int64_t>());
    p.items_ptr = reinterpret_cast<const Fused3SItem*>(items.data_ptr<int32_t>());
    p.num_items = static_cast<int32_t>(items.size(0));
    p.slots_ptr = reinterpret_cast<const Fused3SSlot*>(slots.data_ptr<int32_t>());
    p.num_slots = static_cast<int32_t>(S);
    p.counters_ptr = S > 0 ? counters.data_ptr<int32_t>() : nullptr;
    p.part_o_ptr = S > 0 ? part_o.data_ptr<float>() : nullptr;
    p.part_ml_ptr = S > 0 ? part_ml.data_ptr<float>() : nullptr;
    p.num_nodes = static_cast<int32_t>(Nq);   // rows read and written; windows past them have no edges
    p.num_heads = static_cast<int32_t>(H);
    p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    // head groups copy a group's K and V rows as one row: only where the heads are adjacent
    const bool adjacent = H == 1 || (k.stride(1) == D && v.stride(1) == D);
    p.head_group = adjacent ? head_group(H, D, T, R, q, has_bias, {&edge_bias}) : 1;
    p.bias = edge_args(nnz_offset, slot_edge, slot_pos, H, edge_bias, nullptr, std::nullopt);
    if (has_bias) set_dropout(p.bias, dropout_p, dropout_seed, dropout_seed_t, q);
    p.scores_ptr = return_scores ? scores.data_ptr<float>() : nullptr;

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    const bool half = q.scalar_type() == at::kHalf;
    // the instances with scores are kEdges 3, 4 (edge terms, and dropout)
    switch (edge_mode(has_bias, dropout_p) + (return_scores ? 2 : 0)) {
        case 0: half ? launch_for_head_dim<__half, 0>(D, p, stream) : launch_for_head_dim<__nv_bfloat16, 0>(D, p, stream); break;
        case 1: half ? launch_for_head_dim<__half, 1>(D, p, stream) : launch_for_head_dim<__nv_bfloat16, 1>(D, p, stream); break;
        case 2: half ? launch_for_head_dim<__half, 2>(D, p, stream) : launch_for_head_dim<__nv_bfloat16, 2>(D, p, stream); break;
        case 3: half ? launch_for_head_dim<__half, 3>(D, p, stream) : launch_for_head_dim<__nv_bfloat16, 3>(D, p, stream); break;
        default: half ? launch_for_head_dim<__half, 4>(D, p, stream) : launch_for_head_dim<__nv_bfloat16, 4>(D, p, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse, scores};
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& rw_offset, const at::Tensor& cols,
                                            const at::Tensor& bitmap, const at::Tensor& window_order,
                                            const at::Tensor& items, const at::Tensor& slots, double scale,
                                            bool out_fp32, const std::optional<at::Tensor>& edge_bias,
                                            const std::optional<at::Tensor>& nnz_offset,
                                            const std::optional<at::Tensor>& slot_edge,
                                            const std::optional<at::Tensor>& slot_pos, double dropout_p,
                                            int64_t dropout_seed, const std::optional<at::Tensor>& dropout_seed_t) {
    auto [out, lse, scores] = fwd_impl(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale,
                                       out_fp32, edge_bias, nnz_offset, slot_edge, slot_pos, dropout_p, dropout_seed,
                                       dropout_seed_t, false);
    return {out, lse};
}

// The forward that also returns each edge's raw dot product q_i.k_j (the
// attention weights are then exp(scale q_i.k_j + bias - lse_i), with no
// score pass of their own).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_scores_cuda(
        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rw_offset,
        const at::Tensor& cols, const at::Tensor& bitmap, const at::Tensor& window_order, const at::Tensor& items,
        const at::Tensor& slots, double scale, bool out_fp32, const std::optional<at::Tensor>& edge_bias,
        const at::Tensor& nnz_offset, const at::Tensor& slot_edge, const at::Tensor& slot_pos, double dropout_p,
        int64_t dropout_seed, const std::optional<at::Tensor>& dropout_seed_t) {
    return fwd_impl(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32, edge_bias,
                    nnz_offset, slot_edge, slot_pos, dropout_p, dropout_seed, dropout_seed_t, true);
}

// ---- Backward ------------------------------------------------------------------

template <typename T, int kEdges>
cudaError_t launch_bwd_for_head_dim(int64_t d, const Fused3SBwdParams& dq, const Fused3SBwdParams& dkv,
                                    cudaStream_t stream) {
    switch (d) {
        case 16: return run_fused3s_bwd<T, 16, kEdges>(dq, dkv, stream);
        case 32: return run_fused3s_bwd<T, 32, kEdges>(dq, dkv, stream);
        case 64: return run_fused3s_bwd<T, 64, kEdges>(dq, dkv, stream);
        case 128: return run_fused3s_bwd<T, 128, kEdges>(dq, dkv, stream);
        case 256: return run_fused3s_bwd<T, 256, kEdges>(dq, dkv, stream);
        default: TORCH_CHECK(false, "head dim ", num(d), " is not compiled (16, 32, 64, 128, 256)");
    }
    return cudaSuccess;   // not reached
}

Fused3SOperand operand(const at::Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1)}; }

// BSB + schedule arguments of one pass, checked against the node count.
void check_pass(const char* which, const at::Tensor& cols, const at::Tensor& bitmap, const at::Tensor& items,
                const at::Tensor& slots, const at::Tensor& q, int64_t num_nodes) {
    const std::string pre = std::string(which) + " ";
    check_index(cols, (pre + "cols").c_str(), at::kInt, q);
    check_index(bitmap, (pre + "bitmap").c_str(), at::kLong, q);
    check_index(items, (pre + "items").c_str(), at::kInt, q);
    check_index(slots, (pre + "slots").c_str(), at::kInt, q);
    TORCH_CHECK(bitmap.dim() == 2 && bitmap.size(1) == 2, pre, "bitmap must have shape [T, 2] (got ",
                shape(bitmap.sizes()), ")");
    TORCH_CHECK(cols.dim() == 1 && cols.numel() == 8 * bitmap.size(0), pre, "cols must have 8 * T = ",
                num(8 * bitmap.size(0)), " entries (got ", num(cols.numel()), ")");
    TORCH_CHECK(bitmap.size(0) < (int64_t(1) << 28), pre, "BSB has too many TCBs (", num(bitmap.size(0)), ")");
    TORCH_CHECK(items.dim() == 2 && items.size(1) == 4, pre, "items must have shape [I, 4] (got ",
                shape(items.sizes()), ")");
    TORCH_CHECK(slots.dim() == 2 && slots.size(1) == 4, pre, "slots must have shape [S, 4] (got ",
                shape(slots.sizes()), ")");
    const int64_t R = (num_nodes + 15) / 16, H = q.size(1);
    TORCH_CHECK(items.size(0) >= R, pre, "items has ", num(items.size(0)), " rows, fewer than the ", num(R),
                " row windows; the schedule was built for another graph");
    TORCH_CHECK(items.size(0) * H < (int64_t(1) << 31) - (int64_t(1) << 24), pre, "too many work items");
    TORCH_CHECK(slots.size(0) * H * 16 * q.size(2) < (int64_t(1) << 40), pre, "partial workspace too large");
}

// Gradients of fwd with respect to q, k, v. `cols`, `bitmap`, `items`, `slots`
// are the graph's BSB and schedule (dQ pass), `t_*` those of the transposed
// graph (dKV pass). out and lse are the forward's outputs (out in q's dtype or
// fp32). The gradients are in q's dtype, or fp32 if grad_fp32. Per-edge
// terms (in the caller's edge order) need each pass's nnz_offset, slot_edge
// and slot_pos: the edge_bias of the forward (its gradient dS [E, H] fp32
// comes fourth; else an empty tensor),
// dp_bias [E, H] added to dP and delta_extra [N, H] added to delta (the
// gradient of returned probabilities, see ops.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in,
    const at::Tensor& lse, const at::Tensor& cols, const at::Tensor& bitmap, const at::Tensor& items,
    const at::Tensor& slots, const at::Tensor& t_cols, const at::Tensor& t_bitmap, const at::Tensor& t_items,
    const at::Tensor& t_slots, double scale, bool grad_fp32, const std::optional<at::Tensor>& edge_bias,
    const std::optional<at::Tensor>& nnz_offset, const std::optional<at::Tensor>& slot_edge,
    const std::optional<at::Tensor>& slot_pos, const std::optional<at::Tensor>& t_nnz_offset,
    const std::optional<at::Tensor>& t_slot_edge, const std::optional<at::Tensor>& t_slot_pos,
    const std::optional<at::Tensor>& dp_bias, const std::optional<at::Tensor>& delta_extra, double dropout_p,
    int64_t dropout_seed, const std::optional<at::Tensor>& dropout_seed_t) {
    TORCH_CHECK(q_in.defined(), "q must be a tensor (got an undefined tensor)");
    TORCH_CHECK(q_in.is_cuda(), "q must be a CUDA tensor (got device ", q_in.device().str(), ")");
    const at::Tensor q = kernel_input(q_in, "q", q_in), dout = kernel_input(dout_in, "grad_out", q_in);
    const auto [k, v] = key_value_inputs(k_in, v_in, q);
    // N: the graph's nodes (k, v, dk, dv); Nq <= N: the rows (q, out, lse, dq)
    const int64_t N = k.size(0), Nq = q.size(0), H = q.size(1), D = q.size(2);
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128 || D == 256,
                "head dim D must be 16, 32, 64, 128 or 256 (got ", num(D), "); pad other multiples of 8");
    TORCH_CHECK(N < (int64_t(1) << 31), "k has ", num(N), " nodes, more than the int32 format allows");
    TORCH_CHECK(out_in.defined() && out_in.device() == q.device(), "out must be on the device of q");
    TORCH_CHECK(out_in.scalar_type() == q.scalar_type() || out_in.scalar_type() == at::kFloat,
                "out must have the dtype of q or float32 (got ", dtype_name(out_in.scalar_type()), ")");
    TORCH_CHECK(out_in.dim() == 3 && out_in.sizes() == q.sizes(), "out must have the shape of q ",
                shape(q.sizes()), " (got ", shape(out_in.sizes()), ")");
    const at::Tensor out = aligned_rows(out_in);
    TORCH_CHECK(lse.defined() && lse.device() == q.device() && lse.scalar_type() == at::kFloat &&
                    lse.dim() == 2 && lse.size(0) == Nq && lse.size(1) == H && lse.is_contiguous(),
                "lse must be a contiguous float32 [N, H] = ", shape({Nq, H}), " tensor on the device of q (got ",
                dtype_name(lse.scalar_type()), " ", shape(lse.sizes()), ")");
    check_pass("graph", cols, bitmap, items, slots, q, N);
    check_pass("transposed graph", t_cols, t_bitmap, t_items, t_slots, q, N);
    TORCH_CHECK(std::isfinite(scale), "scale must be finite (got ", num(scale), ")");
    const bool has_edges = check_slots(nnz_offset, slot_edge, slot_pos, bitmap, q, "");
    TORCH_CHECK(check_slots(t_nnz_offset, t_slot_edge, t_slot_pos, t_bitmap, q, "transposed graph ") == has_edges,
                "the edge slots of the graph and of the transposed graph come together");
    TORCH_CHECK(has_edges || !(edge_bias.has_value() || dp_bias.has_value() || delta_extra.has_value() ||
                               dropout_p != 0.0),
                "edge_bias, dp_bias, delta_extra and dropout need the edge slots of both graphs "
                "(GraphPlan.bias_args)");
    check_dropout(dropout_p);
    const int64_t E = has_edges ? slot_edge->numel() : 0;
    TORCH_CHECK(!has_edges || t_slot_edge->numel() == E, "transposed graph slot_edge must have E = ", num(E),
                " entries, as slot_edge");
    check_edge_array(edge_bias, "edge_bias", E, q);
    check_edge_array(dp_bias, "dp_bias", E, q);
    if (delta_extra.has_value()) {
        TORCH_CHECK(delta_extra->device() == q.device() && delta_extra->scalar_type() == at::kFloat &&
                        delta_extra->dim() == 2 && delta_extra->size(0) == Nq && delta_extra->size(1) == H &&
                        delta_extra->is_contiguous(),
                    "delta_extra must be a contiguous float32 [N, H] tensor on the device of q");
    }
    const bool has_bias = edge_bias.has_value();

    const c10::cuda::CUDAGuard device_guard(q.device());
    const auto grad_opts = q.options().dtype(grad_fp32 ? at::kFloat : q.scalar_type());
    auto dq = at::empty({Nq, H, D}, grad_opts);
    auto dk = at::empty({N, H, D}, grad_opts);
    auto dv = at::empty({N, H, D}, grad_opts);
    // dS [E, H] in edge order (every edge's score lies in one chunk of the
    // dQ pass, which writes it once); without a bias an empty tensor
    const auto grad_bias = has_bias ? at::empty({E, H}, q.options().dtype(at::kFloat))
                                    : at::empty({0}, q.options().dtype(at::kFloat));
    if (N == 0) return {dq, dk, dv, grad_bias};
    if (Nq == 0) {            // no rows, so no edges: k and v get nothing
        dk.zero_();
        dv.zero_();
        return {dq, dk, dv, grad_bias};
    }
    const auto f32 = q.options().dtype(at::kFloat);
    auto stats = at::empty({Nq, H, 2}, f32);   // (lse log2e, delta) per row, from the dQ pass
    const int64_t S = slots.size(0), St = t_slots.size(0);
    at::Tensor part_q, part_k, part_v, counters;   // split windows only
    if (S > 0) part_q = at::empty({S, H, 16, D}, f32);
    if (St > 0) {
        part_k = at::empty({St, H, 16, D}, f32);
        part_v = at::empty({St, H, 16, D}, f32);
    }
    if (S + St > 0) counters = at::empty({(S + St) * H}, q.options().dtype(at::kInt));

    Fused3SBwdParams common{};
    common.d_out = operand(dout);
    common.out = operand(out);
    common.o_fp32 = out.scalar_type() == at::kFloat;
    common.lse_ptr = lse.data_ptr<float>();
    common.stats_ptr = reinterpret_cast<float2*>(stats.data_ptr<float>());
    common.grad_fp32 = grad_fp32;
    common.num_heads = static_cast<int32_t>(H);
    common.scale = static_cast<float>(scale);
    common.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    common.delta_extra_ptr = opt_ptr(delta_extra);

    Fused3SBwdParams dq_pass = common;
    dq_pass.num_nodes = static_cast<int32_t>(Nq);   // rows of q, dO, O, dq (windows past them are empty)
    dq_pass.a1 = operand(q);
    dq_pass.a2 = operand(dout);
    dq_pass.g1 = operand(k);
    dq_pass.g2 = operand(v);
    dq_pass.out1_ptr = dq.data_ptr();
    dq_pass.cols_ptr = cols.data_ptr<int32_t>();
    dq_pass.bitmap_ptr = reinterpret_cast<const uint64_t*>(bitmap.data_ptr<int64_t>());
    dq_pass.items_ptr = reinterpret_cast<const Fused3SItem*>(items.data_ptr<int32_t>());
    dq_pass.num_items = static_cast<int32_t>(items.size(0));
    dq_pass.slots_ptr = reinterpret_cast<const Fused3SSlot*>(slots.data_ptr<int32_t>());
    dq_pass.num_slots = static_cast<int32_t>(S);
    dq_pass.counters_ptr = S + St > 0 ? counters.data_ptr<int32_t>() : nullptr;
    dq_pass.part1_ptr = S > 0 ? part_q.data_ptr<float>() : nullptr;
    dq_pass.bias = edge_args(nnz_offset, slot_edge, slot_pos, H, edge_bias,
                             has_bias ? grad_bias.data_ptr<float>() : nullptr, dp_bias);
    if (has_edges) set_dropout(dq_pass.bias, dropout_p, dropout_seed, dropout_seed_t, q);

    Fused3SBwdParams dkv_pass = common;
    dkv_pass.num_nodes = static_cast<int32_t>(N);    // rows of k, v, dk, dv; its columns are rows < Nq
    dkv_pass.a1 = operand(k);
    dkv_pass.a2 = operand(v);
    dkv_pass.g1 = operand(q);
    dkv_pass.g2 = operand(dout);
    dkv_pass.out1_ptr = dk.data_ptr();
    dkv_pass.out2_ptr = dv.data_ptr();
    dkv_pass.cols_ptr = t_cols.data_ptr<int32_t>();
    dkv_pass.bitmap_ptr = reinterpret_cast<const uint64_t*>(t_bitmap.data_ptr<int64_t>());
    dkv_pass.items_ptr = reinterpret_cast<const Fused3SItem*>(t_items.data_ptr<int32_t>());
    dkv_pass.num_items = static_cast<int32_t>(t_items.size(0));
    dkv_pass.slots_ptr = reinterpret_cast<const Fused3SSlot*>(t_slots.data_ptr<int32_t>());
    dkv_pass.num_slots = static_cast<int32_t>(St);
    dkv_pass.counters_ptr = S + St > 0 ? counters.data_ptr<int32_t>() + S * H : nullptr;
    dkv_pass.part1_ptr = St > 0 ? part_k.data_ptr<float>() : nullptr;
    dkv_pass.part2_ptr = St > 0 ? part_v.data_ptr<float>() : nullptr;
    dkv_pass.bias = edge_args(t_nnz_offset, t_slot_edge, t_slot_pos, H, edge_bias, nullptr, dp_bias);
    if (has_edges) set_dropout(dkv_pass.bias, dropout_p, dropout_seed, dropout_seed_t, q);

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    const bool half = q.scalar_type() == at::kHalf;
    auto launch = [&](auto edges) {
        constexpr int kEdges = decltype(edges)::value;
        return half ? launch_bwd_for_head_dim<__half, kEdges>(D, dq_pass, dkv_pass, stream)
                    : launch_bwd_for_head_dim<__nv_bfloat16, kEdges>(D, dq_pass, dkv_pass, stream);
    };
    // the instances with a dP bias are kEdges 3, 4 (edge terms, and dropout)
    const int mode = edge_mode(has_edges, dropout_p) + (has_edges && dp_bias.has_value() ? 2 : 0);
    // head groups copy a group's heads as one row: only where they are adjacent
    bool adjacent = true;
    for (const at::Tensor* t : {&q, &k, &v, &dout}) adjacent = adjacent && (H == 1 || t->stride(1) == D);
    dq_pass.head_group = adjacent ? head_group(H, D, bitmap.size(0), (Nq + 15) / 16, q, has_edges, {&edge_bias, &dp_bias}) : 1;
    dkv_pass.head_group = adjacent ? head_group(H, D, t_bitmap.size(0), (N + 15) / 16, q, has_edges, {&edge_bias, &dp_bias}) : 1;
    cudaError_t err = cudaSuccess;
    switch (mode) {
        case 0: err = launch(std::integral_constant<int, 0>{}); break;
        case 1: err = launch(std::integral_constant<int, 1>{}); break;
        case 2: err = launch(std::integral_constant<int, 2>{}); break;
        case 3: err = launch(std::integral_constant<int, 3>{}); break;
        default: err = launch(std::integral_constant<int, 4>{});
    }
    C10_CUDA_CHECK(err);
    return {dq, dk, dv, grad_bias};
}

// ---- 8-row windows (rows8_params.h) ------------------------------------------
// The 8-row format's arrays (gt_fused3s/graph8.py) for a graph of N nodes.
Rows8Format rows8_format(const at::Tensor& rw_offset, const at::Tensor& cols, const at::Tensor& bitmap,
                         const at::Tensor& windows, int64_t N, const at::Tensor& q, const char* which) {
    check_index(rw_offset, "rw_offset", at::kInt, q);
    check_index(cols, "cols", at::kInt, q);
    check_index(bitmap, "bitmap", at::kLong, q);
    check_index(windows, "windows", at::kInt, q);
    const int64_t R = (N + 7) / 8;
    TORCH_CHECK(rw_offset.dim() == 1 && rw_offset.numel() == R + 1 && windows.dim() == 2 && windows.size(0) == R &&
                    windows.size(1) == 4,
                which, "rw_offset / windows have shapes ", shape(rw_offset.sizes()), " / ", shape(windows.sizes()),
                " but the graph has N = ", num(N), " nodes, which needs [ceil(N / 8) + 1] / [ceil(N / 8), 4] = ",
                shape({R + 1}), " / ", shape({R, 4}), "; the 8-row format was built for another graph");
    TORCH_CHECK(bitmap.dim() == 2 && bitmap.size(1) == 2, which, "bitmap must have shape [T, 2] (got ",
                shape(bitmap.sizes()), ")");
    const int64_t T = bitmap.size(0);
    TORCH_CHECK(cols.dim() == 1 && cols.numel() == 16 * T, which, "cols must have 16 * T = ", num(16 * T),
                " entries (got ", num(cols.numel()), ")");
    TORCH_CHECK(T < (int64_t(1) << 27), "too many blocks (", num(T), ") for int32 column offsets");
    TORCH_CHECK(R * q.size(1) < (int64_t(1) << 31), "too many windows x heads for one launch");
    return {cols.data_ptr<int32_t>(), reinterpret_cast<const uint4*>(bitmap.data_ptr<int64_t>()),
            reinterpret_cast<const int4*>(windows.data_ptr<int32_t>()), static_cast<int32_t>(R)};
}

// An input of the 8-row kernels as they read it (kernel_input: q's dtype and
// shape, rows and heads 16-byte aligned; a strided view is read in place).
Rows8Operand rows8_operand(const at::Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1)}; }

int64_t rows8_head_dim(const at::Tensor& q) {
    const int64_t D = q.size(2);
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128,
                "the 8-row kernels take head dims 16, 32, 64 or 128 (got ", num(D),
                "; pad other multiples of 8 up to 128, or use the 16-row format)");
    TORCH_CHECK(q.size(0) < (int64_t(1) << 31), "q has ", num(q.size(0)), " nodes, more than int32 allows");
    return D;
}

template <typename Params, typename Run>
void rows8_dispatch(const at::Tensor& q, int64_t D, const Params& p, Run run) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    const bool half = q.scalar_type() == at::kHalf;
    auto go = [&](auto tag, auto dim) {
        using T = decltype(tag);
        C10_CUDA_CHECK((run.template operator()<T, decltype(dim)::value>(p, stream)));
    };
    switch (D) {
        case 16: half ? go(__half{}, std::integral_constant<int, 16>{}) : go(__nv_bfloat16{}, std::integral_constant<int, 16>{}); break;
        case 32: half ? go(__half{}, std::integral_constant<int, 32>{}) : go(__nv_bfloat16{}, std::integral_constant<int, 32>{}); break;
        case 64: half ? go(__half{}, std::integral_constant<int, 64>{}) : go(__nv_bfloat16{}, std::integral_constant<int, 64>{}); break;
        default: half ? go(__half{}, std::integral_constant<int, 128>{}) : go(__nv_bfloat16{}, std::integral_constant<int, 128>{});
    }
}

struct RunFwd8 {
    template <typename T, int D>
    cudaError_t operator()(const Fwd8Params& p, cudaStream_t s) const { return run_fused3s_fwd8<T, D>(p, s); }
};
struct RunBwd8 {
    template <typename T, int D>
    cudaError_t operator()(const Bwd8Params& p, cudaStream_t s) const { return run_fused3s_bwd8<T, D>(p, s); }
};

// The forward over 8-row windows: out [N, H, D] (q's dtype or fp32), lse [N, H].
std::tuple<at::Tensor, at::Tensor> fwd8_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                             const at::Tensor& rw_offset, const at::Tensor& cols,
                                             const at::Tensor& bitmap, const at::Tensor& windows, double scale,
                                             bool out_fp32) {
    TORCH_CHECK(q_in.defined() && q_in.is_cuda(), "q must be a CUDA tensor");
    const at::Tensor q = kernel_input(q_in, "q", q_in), k = kernel_input(k_in, "k", q), v = kernel_input(v_in, "v", q);
    const int64_t N = q.size(0), H = q.size(1), D = rows8_head_dim(q);
    TORCH_CHECK(std::isfinite(scale), "scale must be finite (got ", num(scale), ")");
    Fwd8Params p{};
    p.fmt = rows8_format(rw_offset, cols, bitmap, windows, N, q, "");
    const c10::cuda::CUDAGuard device_guard(q.device());
    auto out = at::empty({N, H, D}, q.options().dtype(out_fp32 ? at::kFloat : q.scalar_type()));
    auto lse = at::empty({N, H}, q.options().dtype(at::kFloat));
    if (N == 0 || H == 0) return {out, lse};
    p.q = rows8_operand(q); p.k = rows8_operand(k); p.v = rows8_operand(v);
    p.out = out.data_ptr(); p.out_fp32 = out_fp32; p.lse = lse.data_ptr<float>();
    p.num_nodes = static_cast<int32_t>(N); p.num_heads = static_cast<int32_t>(H);
    p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    rows8_dispatch(q, D, p, RunFwd8{});
    return {out, lse};
}

// Its backward: dq, dk, dv (q's dtype or fp32), over the graph's 8-row
// format (the dQ pass) and the transposed graph's (t_*: the dK / dV pass).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd8_cuda(
        const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
        const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& rw_offset, const at::Tensor& cols,
        const at::Tensor& bitmap, const at::Tensor& windows, const at::Tensor& t_rw_offset,
        const at::Tensor& t_cols, const at::Tensor& t_bitmap, const at::Tensor& t_windows, double scale,
        bool grad_fp32) {
    TORCH_CHECK(q_in.defined() && q_in.is_cuda(), "q must be a CUDA tensor");
    const at::Tensor q = kernel_input(q_in, "q", q_in), k = kernel_input(k_in, "k", q), v = kernel_input(v_in, "v", q);
    const at::Tensor dout = kernel_input(grad_out_in, "grad_out", q);
    const int64_t N = q.size(0), H = q.size(1), D = rows8_head_dim(q);
    TORCH_CHECK(out_in.defined() && out_in.device() == q.device() && out_in.sizes() == q.sizes() &&
                    (out_in.scalar_type() == q.scalar_type() || out_in.scalar_type() == at::kFloat),
                "out must be the forward's output: shape ", shape(q.sizes()), ", q's dtype or float32, on q's device");
    const at::Tensor out = aligned_rows(out_in);
    TORCH_CHECK(lse_in.defined() && lse_in.device() == q.device() && lse_in.scalar_type() == at::kFloat &&
                    lse_in.dim() == 2 && lse_in.size(0) == N && lse_in.size(1) == H,
                "lse must be a float32 [N, H] = ", shape({N, H}), " tensor on the device of q");
    const at::Tensor lse = lse_in.contiguous();
    TORCH_CHECK(std::isfinite(scale), "scale must be finite (got ", num(scale), ")");
    Bwd8Params p{};
    p.fmt = rows8_format(rw_offset, cols, bitmap, windows, N, q, "");
    p.t_fmt = rows8_format(t_rw_offset, t_cols, t_bitmap, t_windows, N, q, "t_");
    const c10::cuda::CUDAGuard device_guard(q.device());
    const auto gopt = q.options().dtype(grad_fp32 ? at::kFloat : q.scalar_type());
    auto dq = at::empty({N, H, D}, gopt), dk = at::empty({N, H, D}, gopt), dv = at::empty({N, H, D}, gopt);
    if (N == 0 || H == 0) return {dq, dk, dv};
    auto stats = at::empty({N, H, 2}, q.options().dtype(at::kFloat));
    p.q = rows8_operand(q); p.k = rows8_operand(k); p.v = rows8_operand(v);
    p.out = rows8_operand(out); p.o_fp32 = out.scalar_type() == at::kFloat;
    p.dout = rows8_operand(dout); p.lse = lse.data_ptr<float>();
    p.stats = reinterpret_cast<float2*>(stats.data_ptr<float>());
    p.dq = dq.data_ptr(); p.dk = dk.data_ptr(); p.dv = dv.data_ptr(); p.grad_fp32 = grad_fp32;
    p.num_nodes = static_cast<int32_t>(N); p.num_heads = static_cast<int32_t>(H);
    p.scale = static_cast<float>(scale);
    p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    rows8_dispatch(q, D, p, RunBwd8{});
    return {dq, dk, dv};
}

// edge_index [2, E] of int32 or int64, any strides, on a CUDA device: the
// builders' view of its rows (ValueError otherwise).
EdgeIndexView edge_index_view(const at::Tensor& edge_index) {
    TORCH_CHECK_VALUE(edge_index.defined() && edge_index.is_cuda(), "edge_index must be a CUDA tensor (got ",
                      edge_index.defined() ? edge_index.device().str() : std::string("an undefined tensor"), ")");
    TORCH_CHECK_VALUE(edge_index.scalar_type() == at::kInt || edge_index.scalar_type() == at::kLong,
                      "edge_index must be int32 or int64 (got ", dtype_name(edge_index.scalar_type()), ")");
    TORCH_CHECK_VALUE(edge_index.dim() == 2 && edge_index.size(0) == 2, "edge_index must have shape [2, E] (got ",
                      shape(edge_index.sizes()), ")");
    EdgeIndexView e{};
    e.src = edge_index.data_ptr();
    e.dst = static_cast<const char*>(edge_index.data_ptr()) + edge_index.stride(0) * edge_index.element_size();
    e.src_stride = e.dst_stride = edge_index.stride(1);
    e.index64 = edge_index.scalar_type() == at::kLong;
    return e;
}

// ---- BSB builder -------------------------------------------------------------
// Builds the BSB format of gt_fused3s/graph.py on the GPU, at capacity (cols
// and bitmap sized for E / 8 + R + 1 TCBs, T in counters[0]) and without a
// host synchronisation: the caller reads the counters (to check the indices
// and cut the arrays to T) when and if it may synchronise.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bsb_build_cuda(
    const at::Tensor& edge_index, int64_t num_nodes) {
    const EdgeIndexView edges_in = edge_index_view(edge_index);
    TORCH_CHECK_VALUE(num_nodes >= 0 && num_nodes <= INT32_MAX, "num_nodes must be in [0, 2^31) (got ",
                      num(num_nodes), ")");
    const int64_t E = edge_index.size(1);
    // the builder packs two running counts of up to E into one 64-bit scan
    TORCH_CHECK_VALUE(E < (int64_t(1) << 31) - 1, "edge_index has ", num(E),
                      " edges; the builder takes fewer than 2^31 - 1");
    const c10::cuda::CUDAGuard guard(edge_index.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

    const int32_t N = static_cast<int32_t>(num_nodes);
    const int32_t R = (N + 15) / 16;
    const int64_t max_tcbs = E / 8 + R + 1;   // = graph.tcb_capacity(E, N)
    const auto i32 = edge_index.options().dtype(at::kInt);
    const auto i64 = edge_index.options().dtype(at::kLong);
    at::Tensor rw_offset = at::empty({R + 1}, i32);
    at::Tensor cols = at::empty({max_tcbs * 8}, i32);
    at::Tensor bitmap = at::empty({max_tcbs, 2}, i64);
    at::Tensor window_order = at::empty({R}, i32);
    at::Tensor edges = at::empty({2, E}, i64);
    at::Tensor counters = at::empty({5}, i64);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bsb_build_workspace_bytes(E, N))},
                                     edge_index.options().dtype(at::kByte));

    BsbBuildParams p{};
    p.edge_index = edges_in;
    p.num_edges = E;
    p.num_nodes = N;
    p.num_windows = R;
    p.max_tcbs = max_tcbs;
    p.rw_offset_ptr = rw_offset.data_ptr<int32_t>();
    p.cols_ptr = cols.data_ptr<int32_t>();
    p.bitmap_ptr = reinterpret_cast<uint64_t*>(bitmap.data_ptr<int64_t>());
    p.window_order_ptr = window_order.data_ptr<int32_t>();
    p.edge_src_ptr = edges.data_ptr<int64_t>();
    p.edge_dst_ptr = edges.data_ptr<int64_t>() + E;
    p.counters_ptr = counters.data_ptr<int64_t>();
    C10_CUDA_CHECK(run_bsb_build(p, workspace.data_ptr(), static_cast<size_t>(workspace.numel()), stream));
    return {rw_offset, cols, bitmap, window_order, edges, counters};
}

// ---- The edges' places in a BSB (kernels/edge_slots.h) ---------------------------
// edge_index [2, E] (int32 or int64, any strides: the graph the BSB was built
// from, in the caller's edge order); rw_offset, cols, bitmap: the BSB's arrays.
// (nnz_offset int32 [T + 1], slot_edge int32 [E], slot_pos uint8 [E]); no host
// synchronisation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> edge_slots_cuda(const at::Tensor& edge_index,
                                                               const at::Tensor& rw_offset, const at::Tensor& cols,
                                                               const at::Tensor& bitmap, int64_t num_nodes) {
    const EdgeIndexView edges_in = edge_index_view(edge_index);
    check_index(rw_offset, "rw_offset", at::kInt, edge_index, "edge_index");
    check_index(cols, "cols", at::kInt, edge_index, "edge_index");
    check_index(bitmap, "bitmap", at::kLong, edge_index, "edge_index");
    const int64_t E = edge_index.size(1), T = bitmap.size(0);
    TORCH_CHECK(bitmap.dim() == 2 && bitmap.size(1) == 2 && cols.numel() == 8 * T && rw_offset.dim() == 1 &&
                    rw_offset.numel() >= 1,
                "the BSB arrays must be rw_offset [R + 1], cols [8 T], bitmap [T, 2] (got ",
                shape(rw_offset.sizes()), ", ", shape(cols.sizes()), ", ", shape(bitmap.sizes()), ")");
    TORCH_CHECK(E < (int64_t(1) << 31) && num_nodes >= 0 && num_nodes <= INT32_MAX,
                "edge_slots takes fewer than 2^31 edges and nodes");
    const c10::cuda::CUDAGuard device_guard(edge_index.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(edge_index.get_device()).stream();
    const auto bits = reinterpret_cast<const uint64_t*>(bitmap.data_ptr<int64_t>());
    const auto i32 = edge_index.options().dtype(at::kInt);
    auto counts = at::empty({T + 1}, i32);
    C10_CUDA_CHECK(run_tcb_counts(bits, T, counts.data_ptr<int32_t>(), stream));
    const at::Tensor nnz_offset = counts.cumsum(0, at::kInt);
    auto slot_edge = at::empty({E}, i32);
    auto slot_pos = at::empty({E}, edge_index.options().dtype(at::kByte));
    const size_t bytes = edge_slots_workspace_bytes(E, num_nodes);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, edge_index.options().dtype(at::kByte));
    EdgeSlotsParams p{};
    p.edge_index = edges_in;
    p.rw_offset = rw_offset.data_ptr<int32_t>();
    p.cols = cols.data_ptr<int32_t>();
    p.bitmap = bits;
    p.nnz_offset = nnz_offset.data_ptr<int32_t>();
    p.slot_edge = slot_edge.data_ptr<int32_t>();
    p.slot_pos = slot_pos.data_ptr<uint8_t>();
    p.num_edges = E;
    p.num_nodes = num_nodes;
    C10_CUDA_CHECK(run_edge_slots(p, workspace.data_ptr(), bytes, stream));
    return {nnz_offset, slot_edge, slot_pos};
}

// ---- The work schedule (kernels/work_schedule.h) ------------------------------------
// rw_offset int32 [R + 1] and window_order int32 [R] of a BSB; the chunk
// bound C and split threshold, the capacities I and S (gt_fused3s/schedule.py:
// chunk_bounds, work_schedule). (items int32 [I, 4], slots int32 [S, 4],
// counts int64 [2]: the items and slots used); no host synchronisation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> work_schedule_cuda(const at::Tensor& rw_offset,
                                                                  const at::Tensor& window_order, int64_t chunk,
                                                                  int64_t threshold, int64_t num_items,
                                                                  int64_t num_slots) {
    TORCH_CHECK(rw_offset.defined() && rw_offset.is_cuda(), "rw_offset must be a CUDA tensor");
    check_index(rw_offset, "rw_offset", at::kInt, rw_offset);
    check_index(window_order, "window_order", at::kInt, rw_offset, "rw_offset");
    const int64_t R = window_order.numel();
    TORCH_CHECK(rw_offset.dim() == 1 && window_order.dim() == 1 && rw_offset.numel() == R + 1 && R > 0,
                "work_schedule takes rw_offset [R + 1] and window_order [R], R >= 1 (got ",
                shape(rw_offset.sizes()), ", ", shape(window_order.sizes()), ")");
    TORCH_CHECK(chunk >= 1 && chunk % 2 == 0 && threshold >= chunk && threshold < INT32_MAX,
                "work_schedule: the chunk bound must be even and at most the split threshold (got ", num(chunk),
                ", ", num(threshold), ")");
    TORCH_CHECK(num_items >= R && num_items < INT32_MAX && num_slots >= 0 && num_slots < INT32_MAX,
                "work_schedule: capacities out of range (", num(num_items), " items for ", num(R), " windows, ",
                num(num_slots), " slots)");
    const c10::cuda::CUDAGuard guard(rw_offset.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(rw_offset.get_device()).stream();
    const auto i32 = rw_offset.options();
    at::Tensor items = at::empty({num_items, 4}, i32);
    at::Tensor slots = at::empty({num_slots, 4}, i32);
    at::Tensor counts = at::empty({2}, i32.dtype(at::kLong));
    const size_t bytes = work_schedule_workspace_bytes(static_cast<int32_t>(R), static_cast<int32_t>(num_items));
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, i32.dtype(at::kByte));
    WorkScheduleParams p{};
    p.rw_offset = rw_offset.data_ptr<int32_t>();
    p.window_order = window_order.data_ptr<int32_t>();
    p.num_windows = static_cast<int32_t>(R);
    p.chunk = static_cast<int32_t>(chunk);
    p.threshold = static_cast<int32_t>(threshold);
    p.num_items = static_cast<int32_t>(num_items);
    p.num_slots = static_cast<int32_t>(num_slots);
    p.items = items.data_ptr<int32_t>();
    p.slots = slots.data_ptr<int32_t>();
    p.counts = counts.data_ptr<int64_t>();
    C10_CUDA_CHECK(run_work_schedule(p, workspace.data_ptr(), bytes, stream));
    return {items, slots, counts};
}

// ---- Sequences ----------------------------------------------------------------
// Attention over the tokens of packed documents with a structured mask
// computed inside the kernel. mask: gt_fused3s/sequence/masks.py kernel_code:
// [row_stride, num_parts, (kind, a, b, c, d) per part, num_global, positions...].
SeqMask seq_mask_from(c10::IntArrayRef code) {
    TORCH_CHECK_VALUE(code.size() >= 3, "mask code too short (", num(static_cast<int64_t>(code.size())), " ints)");
    SeqMask mk{};
    mk.row_stride = static_cast<int32_t>(code[0]);
    mk.num_parts = static_cast<int32_t>(code[1]);
    TORCH_CHECK_VALUE(mk.row_stride >= 1, "mask row stride must be >= 1 (got ", num(code[0]), ")");
    TORCH_CHECK_VALUE(mk.num_parts >= 0 && mk.num_parts <= kSeqMaxParts, "a mask holds at most ",
                      num(int64_t(kSeqMaxParts)), " parts (got ", num(code[1]), ")");
    size_t at = 2;
    TORCH_CHECK_VALUE(code.size() >= at + 5 * mk.num_parts + 1, "mask code too short for its parts");
    for (int i = 0; i < mk.num_parts; ++i, at += 5) {
        SeqMaskPart& pt = mk.parts[i];
        pt.kind = static_cast<int32_t>(code[at]);
        pt.a = static_cast<int32_t>(code[at + 1]);
        pt.b = static_cast<int32_t>(code[at + 2]);
        pt.c = static_cast<int32_t>(code[at + 3]);
        pt.d = static_cast<int32_t>(code[at + 4]);
        TORCH_CHECK_VALUE(pt.kind >= kSeqLocal && pt.kind <= kSeqRandom, "unknown mask part kind ", num(code[at]));
        TORCH_CHECK_VALUE(i == 0 || pt.kind >= mk.parts[i - 1].kind, "mask parts must be in kind order");
        TORCH_CHECK_VALUE(pt.kind != kSeqDilated || pt.c >= 1, "dilation must be >= 1");
        TORCH_CHECK_VALUE(pt.kind != kSeqBlockDilated || (pt.a >= 1 && pt.b >= 1 && pt.a % pt.b == 0),
                          "block-dilated segment must be a positive multiple of the dilation");
        TORCH_CHECK_VALUE(pt.kind != kSeqRandom || (pt.a >= 16 && pt.a % 16 == 0 && mk.row_stride == 1),
                          "random blocks must be a multiple of 16 tokens (row stride 1)");
    }
    mk.num_global = static_cast<int32_t>(code[at++]);
    TORCH_CHECK_VALUE(mk.num_global >= 0 && mk.num_global <= kSeqMaxGlobal && code.size() == at + mk.num_global,
                      "mask code: at most ", num(int64_t(kSeqMaxGlobal)), " global tokens, listed last");
    for (int i = 0; i < mk.num_global; ++i) {
        mk.global_idx[i] = static_cast<int32_t>(code[at + i]);
        TORCH_CHECK_VALUE(mk.global_idx[i] >= 0 && (i == 0 || mk.global_idx[i] > mk.global_idx[i - 1]),
                          "global token positions must be sorted, distinct and >= 0");
    }
    return mk;
}

template <typename T>
void launch_seq_for_head_dim(int64_t d, const SeqFwdParams& p, cudaStream_t stream) {
    switch (d) {
        case 32: run_seq_fwd<T, 32>(p, stream); break;
        case 64: run_seq_fwd<T, 64>(p, stream); break;
        case 128: run_seq_fwd<T, 128>(p, stream); break;
        default: TORCH_CHECK_VALUE(false, "sequence attention: head dim ", num(d), " is not compiled (32, 64, 128)");
    }
}

// Checks shared by the sequence forward and backward (q, k, v already
// through kernel_input), and the parameters both kernels read: q, k, v, the
// documents, the mask, the scale; lse is the forward's output or the
// backward's input.
void check_seq_inputs(const at::Tensor& q, const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                      int64_t num_windows, int64_t block_rows, int want_rows, double scale) {
    const int64_t T = q.size(0), H = q.size(1);
    TORCH_CHECK_VALUE(T < (int64_t(1) << 31), "at most 2^31 - 1 tokens (got ", num(T), ")");
    TORCH_CHECK_VALUE(H >= 1 && H <= 65535, "sequence attention takes 1 to 65535 heads (got ", num(H), ")");
    check_index(cu_seqlens, "cu_seqlens", at::kInt, q);
    check_index(cu_windows, "cu_windows", at::kInt, q);
    TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2 && cu_windows.sizes() == cu_seqlens.sizes(),
                      "cu_seqlens and cu_windows must be [num_docs + 1] (got ", shape(cu_seqlens.sizes()), ", ",
                      shape(cu_windows.sizes()), ")");
    TORCH_CHECK_VALUE(num_windows >= 0 && num_windows < (int64_t(1) << 31), "num_windows out of range");
    TORCH_CHECK_VALUE(block_rows == want_rows, "block_rows must be ", num(int64_t(want_rows)), " for head dim ",
                      num(q.size(2)), " (got ", num(block_rows), "): cu_windows was computed for another block size");
    TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite (got ", num(scale), ")");
}

SeqFwdParams seq_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                        const at::Tensor& cu_seqlens, const at::Tensor& cu_windows, c10::IntArrayRef mask_code,
                        double scale, int64_t num_windows, int64_t block_rows) {
    SeqFwdParams p{};
    set_qkv(p, q, k, v);
    p.lse_ptr = const_cast<float*>(lse.data_ptr<float>());
    p.lse_row_stride = lse.stride(0); p.lse_head_stride = lse.stride(1);
    p.cu_seqlens = cu_seqlens.data_ptr<int32_t>();
    p.cu_windows = cu_windows.data_ptr<int32_t>();
    p.num_tokens = q.size(0);
    p.num_docs = static_cast<int32_t>(cu_seqlens.numel() - 1);
    p.num_windows = num_windows;
    p.block_rows = static_cast<int32_t>(block_rows);
    p.num_heads = static_cast<int32_t>(q.size(1));
    p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    p.mask = seq_mask_from(mask_code);
    return p;
}

// free_sms: SeqFwdParams::free_sms (the op's 0).
std::tuple<at::Tensor, at::Tensor> seq_fwd_launch(const at::Tensor& q_in, const at::Tensor& k_in,
                                                  const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                  const at::Tensor& cu_windows, c10::IntArrayRef mask_code,
                                                  double scale, int64_t num_windows, int64_t block_rows,
                                                  int free_sms) {
    TORCH_CHECK(q_in.defined() && q_in.is_cuda(), "q must be a CUDA tensor");
    const at::Tensor q = kernel_input(q_in, "q", q_in);
    const at::Tensor k = kernel_input(k_in, "k", q), v = kernel_input(v_in, "v", q);
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
    check_seq_inputs(q, cu_seqlens, cu_windows, num_windows, block_rows, seq_block_rows(static_cast<int>(D)), scale);

    const c10::cuda::CUDAGuard device_guard(q.device());
    auto out = at::empty({T, H, D}, q.options());
    auto lse = at::empty({T, H}, q.options().dtype(at::kFloat));
    if (T == 0) return {out, lse};
    SeqFwdParams p = seq_params(q, k, v, lse, cu_seqlens, cu_windows, mask_code, scale, num_windows, block_rows);
    p.o_ptr = out.data_ptr();
    p.o_row_stride = out.stride(0); p.o_head_stride = out.stride(1);
    p.free_sms = free_sms;
    p.num_sms = sm_count(q.get_device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    if (q.scalar_type() == at::kHalf) launch_seq_for_head_dim<__half>(D, p, stream);
    else launch_seq_for_head_dim<__nv_bfloat16>(D, p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> seq_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                                                c10::IntArrayRef mask_code, double scale, int64_t num_windows,
                                                int64_t block_rows) {
    return seq_fwd_launch(q, k, v, cu_seqlens, cu_windows, mask_code, scale, num_windows, block_rows, 0);
}

// Gradients of seq_fwd from its output and lse: dq, dk, dv [T, H, D] in q's
// dtype. cu_windows, num_windows: the forward's row blocks (64 rows), which
// the backward by key blocks takes as its key blocks (Hopper, D = 64, masks
// whose transpose the walk knows: seq_mask_transpose); otherwise the
// backward by query blocks runs on blocks of seq_bwd_block_rows(D) rows:
// bwd_windows where the caller has them made (gt_fused3s/ops.py:
// seq_windows), else made here.
template <typename T>
void launch_seq_bwd_for_head_dim(int64_t d, const SeqBwdParams& p, cudaStream_t stream) {
    switch (d) {
        case 32: run_seq_bwd<T, 32>(p, stream); break;
        case 64: run_seq_bwd<T, 64>(p, stream); break;
        case 128: run_seq_bwd<T, 128>(p, stream); break;
        default: TORCH_CHECK_VALUE(false, "sequence attention: head dim ", num(d), " is not compiled (32, 64, 128)");
    }
}

template <typename T>
void launch_seq_bwd_prep(int64_t d, const SeqBwdPrepParams& p, cudaStream_t stream) {
    switch (d) {
        case 32: run_seq_bwd_prep<T, 32>(p, stream); break;
        case 64: run_seq_bwd_prep<T, 64>(p, stream); break;
        default: run_seq_bwd_prep<T, 128>(p, stream); break;   // (head dims checked before)
    }
}

// The row blocks of `rows` queries per document (ops.py: seq_windows).
at::Tensor seq_windows_of(const at::Tensor& cu, int64_t stride, int64_t rows) {
    const at::Tensor lens = (cu.slice(0, 1) - cu.slice(0, 0, -1)).to(at::kLong);
    const at::Tensor per = ((lens + (stride - 1)).div(stride, "floor") + (rows - 1)).div(rows, "floor") * stride;
    return at::cat({per.new_zeros({1}), per.cumsum(0)}).to(at::kInt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> seq_bwd_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
    const std::optional<at::Tensor>& bwd_windows, c10::IntArrayRef mask_code, double scale, int64_t num_windows) {
    TORCH_CHECK(q_in.defined() && q_in.is_cuda(), "q must be a CUDA tensor");
    const at::Tensor q = kernel_input(q_in, "q", q_in);
    const at::Tensor k = kernel_input(k_in, "k", q), v = kernel_input(v_in, "v", q);
    const at::Tensor dout = kernel_input(grad_out_in, "grad_out", q), out = kernel_input(out_in, "out", q);
    const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
    check_seq_inputs(q, cu_seqlens, cu_windows, num_windows, seq_block_rows(static_cast<int>(D)),
                     seq_block_rows(static_cast<int>(D)), scale);
    TORCH_CHECK(lse.defined() && lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat &&
                    lse.dim() == 2 && lse.size(0) == T && lse.size(1) == H && lse.is_contiguous(),
                "lse must be a contiguous float32 [T, H] = ", shape({T, H}), " tensor on q's device");

    const c10::cuda::CUDAGuard device_guard(q.device());
    const auto f32 = q.options().dtype(at::kFloat);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    const bool half = q.scalar_type() == at::kHalf;
    if (T == 0) return {at::zeros_like(q), at::zeros_like(q), at::zeros_like(q)};

    // (lse log2(e), delta = rowsum(dO O)) per query, read by either kernel
    const int64_t ld_head_stride = (2 * T + 3) / 4 * 4;   // 16-byte aligned heads (the TMA's rows)
    auto ld = at::empty({H, ld_head_stride}, f32);
    SeqBwdPrepParams prep{};
    prep.do_ptr = dout.data_ptr();
    prep.o_ptr = out.data_ptr();
    prep.do_row_stride = dout.stride(0); prep.do_head_stride = dout.stride(1);
    prep.o_row_stride = out.stride(0); prep.o_head_stride = out.stride(1);
    prep.lse_ptr = lse.data_ptr<float>();
    prep.ld_ptr = ld.data_ptr<float>();
    prep.ld_head_stride = ld_head_stride;
    prep.num_tokens = T;
    prep.num_heads = static_cast<int32_t>(H);
    const SeqMask mask = seq_mask_from(mask_code);
    SeqMask transposed{};
    const bool by_keys = D == 64 && is_sm90(q.get_device()) && seq_mask_transpose(mask, transposed) &&
                         (half ? seq_bwd_keys_ready<__half>() : seq_bwd_keys_ready<__nv_bfloat16>());
    // the band backward's item counter, zeroed by the prep kernel (no launch of its own)
    const at::Tensor counter = by_keys ? at::empty({1}, q.options().dtype(at::kLong)) : at::Tensor();
    prep.counter = by_keys ? reinterpret_cast<unsigned long long*>(counter.data_ptr<int64_t>()) : nullptr;
    if (half) launch_seq_bwd_prep<__half>(D, prep, stream);
    else launch_seq_bwd_prep<__nv_bfloat16>(D, prep, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    if (by_keys) {
        auto dq = at::zeros({T, H, D}, f32);   // added to by every key block that sees a query
        auto dk = at::empty({T, H, D}, q.options()), dv = at::empty({T, H, D}, q.options());   // written
        SeqBwdKeysParams p{};
        p.fwd = seq_params(q, k, v, lse, cu_seqlens, cu_windows, mask_code, scale, num_windows,
                           seq_block_rows(static_cast<int>(D)));
        p.fwd.mask = transposed;
        p.fwd.num_sms = sm_count(q.get_device());   // (the band backward's persistent blocks)
        p.do_ptr = dout.data_ptr();
        p.do_row_stride = dout.stride(0); p.do_head_stride = dout.stride(1);
        p.ld_ptr = ld.data_ptr<float>();
        p.ld_head_stride = ld_head_stride;
        p.dq_ptr = dq.data_ptr<float>();
        p.dk_ptr = dk.data_ptr();
        p.dv_ptr = dv.data_ptr();
        p.grad_row_stride = dq.stride(0); p.grad_head_stride = dq.stride(1);
        p.scale = static_cast<float>(scale);
        p.item_counter = prep.counter;
        if (half) run_seq_bwd_keys<__half>(p, stream);
        else run_seq_bwd_keys<__nv_bfloat16>(p, stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return {dq.to(q.scalar_type()), dk, dv};
    }

    const int64_t rows = seq_bwd_block_rows(static_cast<int>(D)), stride = mask.row_stride;
    const at::Tensor windows = bwd_windows.has_value() ? *bwd_windows : seq_windows_of(cu_seqlens, stride, rows);
    const int64_t bwd_num_windows = (T + rows - 1) / rows + (cu_seqlens.numel() - 1) * (2 * stride + 1);
    check_seq_inputs(q, cu_seqlens, windows, bwd_num_windows, rows, rows, scale);
    auto dq = at::empty({T, H, D}, q.options());   // every query's row is written by its row block
    auto dk = at::zeros({T, H, D}, f32), dv = at::zeros({T, H, D}, f32);   // added to
    SeqBwdParams p{};
    p.fwd = seq_params(q, k, v, lse, cu_seqlens, windows, mask_code, scale, bwd_num_windows, rows);
    p.do_ptr = dout.data_ptr();
    p.do_row_stride = dout.stride(0); p.do_head_stride = dout.stride(1);
    p.ld_ptr = ld.data_ptr<float>();
    p.ld_head_stride = ld_head_stride;
    p.dq_ptr = dq.data_ptr();
    p.dk_ptr = dk.data_ptr<float>();
    p.dv_ptr = dv.data_ptr<float>();
    p.grad_row_stride = dq.stride(0); p.grad_head_stride = dq.stride(1);   // (dk's and dv's too: all contiguous)
    p.scale = static_cast<float>(scale);
    if (half) launch_seq_bwd_for_head_dim<__half>(D, p, stream);
    else launch_seq_bwd_for_head_dim<__nv_bfloat16>(D, p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {dq, dk.to(q.scalar_type()), dv.to(q.scalar_type())};
}

// ---- edge-feature products (kernels/edge_terms.h) ------------------------------
// fp32 contiguous operands (gt_fused3s/edge_terms.py casts); each message
// names its input.
void check_f32(const at::Tensor& t, const char* name, int64_t dim, const at::Tensor& like) {
    TORCH_CHECK(t.defined(), name, " must be a tensor (got an undefined tensor)");
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device().str(),
                " (got ", t.device().str(), ")");
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32 (got ", dtype_name(t.scalar_type()), ")");
    TORCH_CHECK(t.dim() == dim, name, " must have ", num(dim), " dims (got ", shape(t.sizes()), ")");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_edge_index_array(const at::Tensor& t, const char* name, int64_t size, const at::Tensor& like) {
    check_index(t, name, at::kLong, like);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == size, name, " must have shape [", num(size), "] (got ",
                shape(t.sizes()), ")");
}

EdgeTermsShape edge_shape(int64_t E, int64_t N, int64_t H, int64_t F) {
    TORCH_CHECK(H > 0 && H <= INT32_MAX && F > 0 && F <= INT32_MAX, "heads and features must be positive");
    return {E, N, static_cast<int32_t>(H), static_cast<int32_t>(F)};
}

// out[e, h] = <x[idx[e], h, :], a[e, :]>
at::Tensor edge_dot_cuda(const at::Tensor& x, const at::Tensor& a, const at::Tensor& idx) {
    check_f32(x, "x", 3, x);
    check_f32(a, "a", 2, x);
    TORCH_CHECK(a.size(1) == x.size(2), "a must have shape [E, F] with x's F = ", num(x.size(2)), " (got ",
                shape(a.sizes()), ")");
    check_edge_index_array(idx, "idx", a.size(0), x);
    const c10::cuda::CUDAGuard device_guard(x.device());
    auto out = at::empty({a.size(0), x.size(1)}, x.options());
    const EdgeTermsShape s = edge_shape(a.size(0), x.size(0), x.size(1), x.size(2));
    C10_CUDA_CHECK(run_edge_dot(x.data_ptr<float>(), a.data_ptr<float>(), idx.data_ptr<int64_t>(),
                                out.data_ptr<float>(), s, c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// P[e, h] = exp(scale scores[e, h] + bias[e, h] - lse[idx[e], h]): the
// attention weights from fwd_scores' raw scores, bias optional
at::Tensor edge_probs_cuda(const at::Tensor& scores, const std::optional<at::Tensor>& bias, const at::Tensor& lse,
                           const at::Tensor& idx, double scale) {
    check_f32(scores, "scores", 2, scores);
    check_f32(lse, "lse", 2, scores);
    TORCH_CHECK(lse.size(1) == scores.size(1), "lse must have shape [N, H] with scores' H = ", num(scores.size(1)),
                " (got ", shape(lse.sizes()), ")");
    if (bias.has_value()) {
        check_f32(*bias, "bias", 2, scores);
        TORCH_CHECK(bias->sizes() == scores.sizes(), "bias must have the shape of scores ", shape(scores.sizes()),
                    " (got ", shape(bias->sizes()), ")");
    }
    check_edge_index_array(idx, "idx", scores.size(0), scores);
    const c10::cuda::CUDAGuard device_guard(scores.device());
    auto out = at::empty_like(scores);
    const EdgeTermsShape s = edge_shape(scores.size(0), lse.size(0), scores.size(1), 1);
    C10_CUDA_CHECK(run_edge_probs(scores.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                  lse.data_ptr<float>(), idx.data_ptr<int64_t>(), static_cast<float>(scale),
                                  out.data_ptr<float>(), s, c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// out[e, f] = sum_h w[e, h] x[idx[e], h, f] (+ the same over w2, x2)
at::Tensor edge_rows_cuda(const at::Tensor& w, const at::Tensor& x, const at::Tensor& idx,
                          const std::optional<at::Tensor>& w2, const std::optional<at::Tensor>& x2) {
    check_f32(x, "x", 3, x);
    check_f32(w, "w", 2, x);
    TORCH_CHECK(w.size(1) == x.size(1), "w must have shape [E, H] with x's H = ", num(x.size(1)), " (got ",
                shape(w.sizes()), ")");
    check_edge_index_array(idx, "idx", w.size(0), x);
    TORCH_CHECK(w2.has_value() == x2.has_value(), "w2 and x2 come together");
    if (w2.has_value()) {
        check_f32(*w2, "w2", 2, x);
        check_f32(*x2, "x2", 3, x);
        TORCH_CHECK(w2->sizes() == w.sizes() && x2->sizes() == x.sizes(), "w2 and x2 must have the shapes of w ",
                    shape(w.sizes()), " and x ", shape(x.sizes()), " (got ", shape(w2->sizes()), ", ",
                    shape(x2->sizes()), ")");
    }
    const c10::cuda::CUDAGuard device_guard(x.device());
    auto out = at::empty({w.size(0), x.size(2)}, x.options());
    const EdgeTermsShape s = edge_shape(w.size(0), x.size(0), x.size(1), x.size(2));
    C10_CUDA_CHECK(run_edge_rows(w.data_ptr<float>(), x.data_ptr<float>(),
                                 w2.has_value() ? w2->data_ptr<float>() : nullptr,
                                 x2.has_value() ? x2->data_ptr<float>() : nullptr, idx.data_ptr<int64_t>(),
                                 out.data_ptr<float>(), s, c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// out[n, h, f] = sum over node n's edges (order[rowptr[n] .. rowptr[n + 1]]) of w[e, h] a[e, f]
at::Tensor edge_scatter_cuda(const at::Tensor& w, const at::Tensor& a, const at::Tensor& rowptr,
                             const at::Tensor& order) {
    check_f32(w, "w", 2, w);
    check_f32(a, "a", 2, w);
    TORCH_CHECK(a.size(0) == w.size(0), "a must have w's ", num(w.size(0)), " edges (got ", shape(a.sizes()), ")");
    TORCH_CHECK(rowptr.dim() == 1 && rowptr.size(0) >= 1, "rowptr must have shape [N + 1] (got ",
                shape(rowptr.sizes()), ")");
    check_edge_index_array(rowptr, "rowptr", rowptr.size(0), w);
    check_edge_index_array(order, "order", w.size(0), w);
    const int64_t N = rowptr.size(0) - 1;
    const c10::cuda::CUDAGuard device_guard(w.device());
    auto out = at::empty({N, w.size(1), a.size(1)}, w.options());
    const EdgeTermsShape s = edge_shape(w.size(0), N, w.size(1), a.size(1));
    C10_CUDA_CHECK(run_edge_scatter(w.data_ptr<float>(), a.data_ptr<float>(), rowptr.data_ptr<int64_t>(),
                                    order.data_ptr<int64_t>(), out.data_ptr<float>(), s,
                                    c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// out[i] = x[index[i]] along dim 0, any dtype (gather_rows.h: torch's
// index_select is slow for rows of 16 to 512 bytes); x's rows contiguous.
at::Tensor gather_rows_cuda(const at::Tensor& x_in, const at::Tensor& index) {
    TORCH_CHECK(x_in.defined() && x_in.is_cuda() && x_in.dim() >= 1, "x must be a CUDA tensor with a row dimension");
    TORCH_CHECK(index.device() == x_in.device(), "index must be on the device of x (", x_in.device().str(), "), got ",
                index.device().str());
    TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "index must be a 1-D int64 tensor (got ",
                dtype_name(index.scalar_type()), " ", shape(index.sizes()), ")");
    const at::Tensor x = x_in.contiguous();
    const at::Tensor idx = index.contiguous();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes[0] = idx.size(0);
    const c10::cuda::CUDAGuard device_guard(x.device());
    auto out = at::empty(sizes, x.options());
    const int64_t row_bytes = x.size(0) ? x.nbytes() / x.size(0) : 0;
    C10_CUDA_CHECK(run_gather_rows(x.data_ptr(), x.size(0), row_bytes, idx.data_ptr<int64_t>(), idx.size(0),
                                   out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// ---- dense rows of sequence attention (kernels/dense_rows.h) -------------------
// The queries: qg [B, G, H, D] contiguous (G <= 32), or where rows (int64
// [G], positions in [0, L)) is defined the rows of qg = q [B, L, H, D] (rows
// 16-byte aligned) at those positions. k, v [B, L, H, D] (rows 16-byte
// aligned, any batch / row / head strides), fp16 / bf16, D in {32, 64, 128}.
// The chunks of keys are the caller's to size (chunk_keys: the forward's
// and the backward's differ).
DenseRowsParams dense_rows_params(const at::Tensor& qg, const at::Tensor& rows, const at::Tensor& k,
                                  const at::Tensor& v, double scale) {
    TORCH_CHECK(qg.defined() && qg.is_cuda() && qg.dim() == 4 && (rows.defined() || qg.is_contiguous()),
                "qg must be a contiguous CUDA tensor [B, G, H, D]");
    TORCH_CHECK(qg.scalar_type() == at::kHalf || qg.scalar_type() == at::kBFloat16, "qg must be fp16 or bf16 (got ",
                dtype_name(qg.scalar_type()), ")");
    if (rows.defined()) {
        check_index(rows, "rows", at::kLong, qg);
        TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous(), "rows must be a contiguous int64 [G]");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(qg.data_ptr()) % 16 == 0 && qg.stride(3) == 1 &&
                        qg.stride(0) % 8 == 0 && qg.stride(1) % 8 == 0 && qg.stride(2) % 8 == 0,
                    "q rows must be 16-byte aligned (dense_rows_input copies them otherwise)");
    }
    const int64_t B = qg.size(0), G = rows.defined() ? rows.numel() : qg.size(1), H = qg.size(2), D = qg.size(3);
    TORCH_CHECK_VALUE(G >= 1 && G <= kDenseRowsMaxQueries, "dense rows: 1 to ", num(int64_t(kDenseRowsMaxQueries)),
                      " queries (got ", num(G), ")");
    TORCH_CHECK_VALUE(D == 32 || D == 64 || D == 128, "dense rows: head dim 32, 64 or 128 (got ", num(D), ")");
    for (const auto* t : {&k, &v}) {
        TORCH_CHECK(t->defined() && t->device() == qg.device() && t->scalar_type() == qg.scalar_type() &&
                        t->dim() == 4 && t->size(0) == B && t->size(2) == H && t->size(3) == D,
                    "k and v must be [B, L, H, D] = [", num(B), ", L, ", num(H), ", ", num(D),
                    "] with qg's dtype and device");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 && t->stride(3) == 1 &&
                        t->stride(0) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(2) % 8 == 0,
                    "k and v rows must be 16-byte aligned (dense_rows_input copies them otherwise)");
    }
    TORCH_CHECK_VALUE(v.size(1) == k.size(1), "k and v must have the same keys");
    DenseRowsParams p{};
    p.qg = qg.data_ptr();
    p.q_batch_stride = qg.stride(0); p.q_row_stride = qg.stride(1); p.q_head_stride = qg.stride(2);
    p.q_rows = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
    p.q_len = qg.size(1);
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.k_batch_stride = k.stride(0); p.k_row_stride = k.stride(1); p.k_head_stride = k.stride(2);
    p.v_batch_stride = v.stride(0); p.v_row_stride = v.stride(1); p.v_head_stride = v.stride(2);
    p.batch = static_cast<int32_t>(B);
    p.queries = static_cast<int32_t>(G);
    p.heads = static_cast<int32_t>(H);
    p.keys = static_cast<int32_t>(k.size(1));
    p.scale = static_cast<float>(scale);
    TORCH_CHECK_VALUE(k.size(1) < (int64_t(1) << 31) && B * H < 65536, "dense rows: too many keys or batch x heads");
    return p;
}

// k or v as the kernels read them: itself where its rows are 16-byte
// aligned with the last dim contiguous, else a contiguous copy.
at::Tensor dense_rows_input(const at::Tensor& t) {
    const bool ok = t.dim() == 4 && t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                    t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
    return ok ? t : t.contiguous();
}

template <typename Fn>
void dense_rows_dispatch(const at::Tensor& qg, Fn&& fn) {
    const int64_t D = qg.size(3);
    if (qg.scalar_type() == at::kHalf) {
        if (D == 32) fn(run_dense_rows_fwd<__half, 32>, run_dense_rows_bwd<__half, 32>);
        else if (D == 64) fn(run_dense_rows_fwd<__half, 64>, run_dense_rows_bwd<__half, 64>);
        else fn(run_dense_rows_fwd<__half, 128>, run_dense_rows_bwd<__half, 128>);
    } else {
        if (D == 32) fn(run_dense_rows_fwd<__nv_bfloat16, 32>, run_dense_rows_bwd<__nv_bfloat16, 32>);
        else if (D == 64) fn(run_dense_rows_fwd<__nv_bfloat16, 64>, run_dense_rows_bwd<__nv_bfloat16, 64>);
        else fn(run_dense_rows_fwd<__nv_bfloat16, 128>, run_dense_rows_bwd<__nv_bfloat16, 128>);
    }
}

// (og fp32 [B, G, H, D], lse fp32 [B, H, G]): softmax attention of the
// queries (qg, rows as dense_rows_params) over all keys, on the current
// stream. Where out16 is defined the output goes there in qg's dtype too:
// over the rows' positions of a [B, L, H, D] output (at_rows), or as
// [B, G, H, D]. sms: the multiprocessors the key chunks are sized for (0:
// the device's).
std::tuple<at::Tensor, at::Tensor> dense_rows_fwd_on(const at::Tensor& qg, const at::Tensor& rows,
                                                     const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                                                     int sms, const at::Tensor& out16, bool at_rows) {
    const at::Tensor k = dense_rows_input(k_in), v = dense_rows_input(v_in);
    if (sms <= 0) sms = sm_count(qg.get_device());
    DenseRowsParams p = dense_rows_params(qg, rows, k, v, scale);
    p.chunk_keys = dense_rows_fwd_chunk_keys(p.keys, static_cast<int64_t>(p.batch) * p.heads, sms);   // (a warp's)
    const c10::cuda::CUDAGuard device_guard(qg.device());
    const auto f32 = qg.options().dtype(at::kFloat);
    const int64_t B = p.batch, G = p.queries, H = p.heads, D = qg.size(3);
    if (p.keys == 0) return {at::zeros({B, G, H, D}, f32), at::full({B, H, G}, -INFINITY, f32)};
    auto og = at::empty({B, G, H, D}, f32);   // (the merge writes every entry)
    auto lse = at::empty({B, H, G}, f32);
    auto work = at::empty({dense_rows_workspace(p.batch, p.heads, p.queries, D, p.keys, p.chunk_keys)}, f32);
    p.og = og.data_ptr<float>();
    p.lse = lse.data_ptr<float>();
    p.partial = work.data_ptr<float>();
    if (out16.defined()) {
        TORCH_CHECK(out16.scalar_type() == qg.scalar_type() && out16.dim() == 4 && out16.size(0) == B &&
                        out16.size(2) == H && out16.size(3) == D && out16.stride(3) == 1 &&
                        (at_rows ? rows.defined() && out16.size(1) == qg.size(1) : out16.size(1) == G),
                    "dense rows: out16 must be [B, L, H, D] (at the rows) or [B, G, H, D] in q's dtype");
        p.out_rows = out16.data_ptr();
        p.out_batch_stride = out16.stride(0); p.out_row_stride = out16.stride(1); p.out_head_stride = out16.stride(2);
        p.out_at_q_rows = at_rows;
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(qg.get_device()).stream();
    dense_rows_dispatch(qg, [&](auto fwd, auto) { C10_CUDA_CHECK(fwd(p, stream)); });
    return {og, lse};
}

std::tuple<at::Tensor, at::Tensor> dense_rows_fwd_cuda(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v,
                                                       double scale) {
    return dense_rows_fwd_on(qg, at::Tensor(), k, v, scale, 0, at::Tensor(), false);
}

// (dqg, dk, dv) in qg's dtype: the gradients of dense_rows_fwd's og (fp32)
// for dog (qg's dtype); dk, dv [B, L, H, D] contiguous. Where dk_into and
// dv_into are given (contiguous [B, L, H, D] in qg's dtype) the rows' dK and
// dV are added to them in place and they are returned.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_rows_bwd_add(const at::Tensor& dog_in, const at::Tensor& qg,
                                                                  const at::Tensor& k_in, const at::Tensor& v_in,
                                                                  const at::Tensor& og, const at::Tensor& lse,
                                                                  double scale, const at::Tensor& dk_into,
                                                                  const at::Tensor& dv_into) {
    const at::Tensor k = dense_rows_input(k_in), v = dense_rows_input(v_in);
    DenseRowsParams p = dense_rows_params(qg, at::Tensor(), k, v, scale);
    p.chunk_keys = dense_rows_chunk_keys(p.keys, static_cast<int64_t>(p.batch) * p.heads, sm_count(qg.get_device()));
    const at::Tensor dog = dog_in.to(qg.scalar_type()).contiguous();
    TORCH_CHECK(dog.sizes() == qg.sizes() && og.sizes() == qg.sizes() && og.scalar_type() == at::kFloat,
                "dog and og must have qg's shape (og fp32)");
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == qg.size(0) &&
                    lse.size(1) == qg.size(2) && lse.size(2) == qg.size(1),
                "lse must be the forward's contiguous fp32 [B, H, G]");
    const c10::cuda::CUDAGuard device_guard(qg.device());
    const auto f32 = qg.options().dtype(at::kFloat);
    const at::Tensor delta = (dog.to(at::kFloat) * og).sum(-1).transpose(1, 2).contiguous();   // [B, H, G]
    auto dqg = at::zeros(qg.sizes(), f32);
    const std::vector<int64_t> kv_shape = {qg.size(0), k.size(1), qg.size(2), qg.size(3)};
    p.dkv_add = dk_into.defined();
    for (const at::Tensor* t : {&dk_into, &dv_into}) {
        TORCH_CHECK(t->defined() == p.dkv_add && (!p.dkv_add || (t->device() == qg.device() &&
                                                                 t->scalar_type() == qg.scalar_type() &&
                                                                 t->sizes() == kv_shape && t->is_contiguous())),
                    "dk_into and dv_into must both be contiguous ", shape(kv_shape), " tensors of qg's dtype");
    }
    auto dk = p.dkv_add ? dk_into : at::empty(kv_shape, qg.options());
    auto dv = p.dkv_add ? dv_into : at::empty_like(dk);
    if (p.keys == 0) return {dqg.to(qg.scalar_type()), dk, dv};
    p.dog = dog.data_ptr();
    p.delta = delta.data_ptr<float>();
    p.lse = const_cast<float*>(lse.data_ptr<float>());
    p.dqg = dqg.data_ptr<float>();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(qg.get_device()).stream();
    dense_rows_dispatch(qg, [&](auto, auto bwd) { C10_CUDA_CHECK(bwd(p, stream)); });
    return {dqg.to(qg.scalar_type()), dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_rows_bwd_cuda(const at::Tensor& dog, const at::Tensor& qg,
                                                                   const at::Tensor& k, const at::Tensor& v,
                                                                   const at::Tensor& og, const at::Tensor& lse,
                                                                   double scale) {
    return dense_rows_bwd_add(dog, qg, k, v, og, lse, scale, at::Tensor(), at::Tensor());
}

// ---- sequence attention's eager autograd ---------------------------------------
// seq_attention_eager: seq_fwd with its backward as a C++ autograd node, for
// eager mode (torch.compile traces gt_fused3s::seq_attention, ops.py). An
// autograd.Function's backward took the GIL and a Python frame per step, and
// the views of [B, L, H, D] as [B L, H, D] were nodes of their own: on the
// H200 machine the 65k-token local step spent 308 us of host time for 43 +
// 136 us of kernels (228 us this way). Here q, k, v are [..., H, D]
// (contiguous in their last dim, a compiled head dim: ops.seq_eager_fits);
// the output has q's shape. With global_rows (q, k, v [B, L, H, D]; int64
// positions, at most 32) the node also computes those rows by the dense-rows
// kernels, writes them over the kernel's rows and takes their backward: a
// Longformer step is one node instead of five (gather, the rows' Function,
// the overwrite, two gradient sums).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor tokens_view(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined() && t.dim() >= 3, name, " must have shape [..., H, D] (got ",
                t.defined() ? shape(t.sizes()) : std::string("an undefined tensor"), ")");
    return t.reshape({-1, t.size(-2), t.size(-1)});
}

// SMs for the global rows beside the sequence kernel (seq_eager_forward): the
// rows read all of K and V once (memory-bound), the band kernel is bound by
// its products and exponentials, so they share the GPU better than they take
// turns where both are long: from 2^20 keys x batch x heads (H100, Longformer
// and dilated + global, 20 SMs: 1M 0.39-0.43 ms against 0.46-0.48 one after
// the other, 4M 1.42-1.48 against 1.64; at 262k 0.29 against 0.24 with a
// pool stream a call: the rows' walks, sized for 20 SMs, outlast the small
// kernel there). An eighth of the SMs (16 of 132) since dilated + global
// runs the band kernel too (H100, 4M, ms, 12 / 16 / 20 / 28 SMs: Longformer
// 1.82 / 1.41 / 1.44 / 1.55, dilated + global 1.91 / 1.64-1.67 / 1.74 /
// 1.87: with 12 the rows outlast the band). GT_FUSED3S_ROWS_SMS=n gives the
// rows n SMs at any size, 0 runs them after the kernel on one stream (A/B).
int global_rows_sms(const at::Tensor& q) {
    const int sms = sm_count(q.get_device());
    const int64_t work = q.size(0) * q.size(1) * q.size(2);   // keys x batch x heads ([B, L, H, D])
    const char* env = std::getenv("GT_FUSED3S_ROWS_SMS");
    const int want = env != nullptr ? std::atoi(env) : work >= (int64_t(1) << 20) ? std::max(1, sms / 8) : 0;
    return std::clamp(want, 0, sms - 1);
}

// The side stream of the fork and two events (no timing) for the fork and
// the join, made once per thread and device: no host sync, no allocation. One
// stream, not the pool's next: the caching allocator keeps its blocks per
// stream. (Raw CUDA events: at::cuda::CUDAEvent's header needs the CUDA
// libraries' headers, c10's is not in every torch this builds against.)
struct StreamFork {
    c10::cuda::CUDAStream side;
    cudaEvent_t inputs_ready, side_done;
    static StreamFork& of(int device) {
        thread_local std::vector<std::unique_ptr<StreamFork>> made;
        if (made.size() <= static_cast<size_t>(device)) made.resize(device + 1);
        if (!made[device]) made[device].reset(new StreamFork(device));
        return *made[device];
    }

   private:
    explicit StreamFork(int device) : side(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready, cudaEventDisableTiming));
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&side_done, cudaEventDisableTiming));
    }
};

// The forward: out (a fresh contiguous tensor of q's shape), the kernel's
// lse, and where there are global rows their fp32 output and lse.
struct SeqEagerForward {
    at::Tensor out, lse, og, lse_rows;
};

SeqEagerForward seq_eager_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                                  c10::IntArrayRef mask_code, double scale, int64_t num_windows,
                                  const std::optional<at::Tensor>& global_rows) {
    const at::Tensor q3 = tokens_view(q, "q");
    TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "k and v must have the shape of q ",
                shape(q.sizes()), " (got ", shape(k.sizes()), ", ", shape(v.sizes()), ")");
    const int64_t block_rows = seq_block_rows(static_cast<int>(q.size(-1)));
    auto kernel = [&](int free_sms) {
        auto [out, lse] = seq_fwd_launch(q3, tokens_view(k, "k"), tokens_view(v, "v"), cu_seqlens, cu_windows,
                                         mask_code, scale, num_windows, block_rows, free_sms);
        out.resize_(q.sizes());   // a fresh contiguous tensor: q's shape without a view of it
        return SeqEagerForward{out, lse, at::Tensor(), at::Tensor()};
    };
    if (!global_rows.has_value()) return kernel(0);
    TORCH_CHECK(q.dim() == 4, "global rows need q, k, v [B, L, H, D] (got q ", shape(q.sizes()), ")");
    const at::Tensor& rows = *global_rows;
    const at::Tensor qr = dense_rows_input(q);   // (the rows' kernel gathers the rows' queries itself)
    const int side_sms = global_rows_sms(q);
    if (side_sms == 0) {   // one stream: the kernel, then the rows (their merge writes them over its rows)
        SeqEagerForward f = kernel(0);
        std::tie(f.og, f.lse_rows) = dense_rows_fwd_on(qr, rows, k, v, scale, 0, f.out, /*at_rows=*/true);
        return f;
    }
    // The rows on a second stream beside the kernel: it is launched first
    // (its blocks take all SMs but side_sms), the rows' blocks fill the rest;
    // the output's rows are written once both are done.
    const c10::cuda::CUDAGuard device_guard(q.device());   // (the events are made on the current device)
    const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream(q.get_device());
    const StreamFork& fork = StreamFork::of(q.get_device());
    const c10::cuda::CUDAStream side = fork.side;
    C10_CUDA_CHECK(cudaEventRecord(fork.inputs_ready, main.stream()));
    SeqEagerForward f = kernel(side_sms);
    C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), fork.inputs_ready, 0));
    at::Tensor og16;   // the rows' output in q's dtype, [B, G, H, D]
    {
        const c10::cuda::CUDAStreamGuard on_side(side);
        og16 = at::empty({q.size(0), rows.numel(), q.size(2), q.size(3)}, q.options());
        std::tie(f.og, f.lse_rows) = dense_rows_fwd_on(qr, rows, k, v, scale, side_sms, og16, /*at_rows=*/false);
        C10_CUDA_CHECK(cudaEventRecord(fork.side_done, side.stream()));
    }
    C10_CUDA_CHECK(cudaStreamWaitEvent(main.stream(), fork.side_done, 0));
    // made on side, used on main (the allocator's call, not the aten op
    // record_stream: opcheck's schema check cannot name its Stream argument)
    for (const at::Tensor& t : {f.og, f.lse_rows, og16}) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), main);
    }
    f.out.index_copy_(1, rows, og16);
    return f;
}

struct SeqAttentionFn : public torch::autograd::Function<SeqAttentionFn> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                              const std::optional<at::Tensor>& bwd_windows, std::vector<int64_t> mask_code,
                              double scale, int64_t num_windows, const std::optional<at::Tensor>& global_rows) {
        SeqEagerForward f = seq_eager_forward(q, k, v, cu_seqlens, cu_windows, mask_code, scale, num_windows,
                                              global_rows);
        ctx->save_for_backward({q, k, v, f.out, f.lse, cu_seqlens, cu_windows,
                                bwd_windows.has_value() ? *bwd_windows : at::Tensor(),
                                global_rows.has_value() ? *global_rows : at::Tensor(), f.og, f.lse_rows});
        ctx->saved_data["mask_code"] = mask_code;
        ctx->saved_data["scale"] = scale;
        ctx->saved_data["num_windows"] = num_windows;
        return f.out;
    }

    // The global rows' output was the dense rows': no gradient goes through
    // the kernel's own rows there (their log-sum-exp set to +inf: P = 0, so
    // dS = 0 in the kernel's backward; a copy of the [T, H] lse, not of
    // grad_out), the rows' share takes their grad_out and adds its dK, dV
    // onto the kernel's.
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list s = ctx->get_saved_variables();
        const at::Tensor &q = s[0], &k = s[1], &v = s[2], &rows = s[8];
        const std::vector<int64_t> mask_code = ctx->saved_data["mask_code"].toIntVector();
        const double scale = ctx->saved_data["scale"].toDouble();
        const std::optional<at::Tensor> bwd_windows = s[7].defined() ? std::optional<at::Tensor>(s[7]) : std::nullopt;
        const at::Tensor lse = rows.defined() ? s[4].view({q.size(0), q.size(1), q.size(2)})
                                                    .index_fill(1, rows, INFINITY)
                                                    .view(s[4].sizes())
                                              : s[4];
        auto [dq3, dk3, dv3] = seq_bwd_cuda(tokens_view(grads[0], "grad_out"), tokens_view(q, "q"),
                                            tokens_view(k, "k"), tokens_view(v, "v"), tokens_view(s[3], "out"), lse,
                                            s[5], s[6], bwd_windows, mask_code, scale,
                                            ctx->saved_data["num_windows"].toInt());
        at::Tensor dq = dq3.view(q.sizes()), dk = dk3.view(k.sizes()), dv = dv3.view(v.sizes());
        if (rows.defined()) {
            const at::Tensor dqg = std::get<0>(dense_rows_bwd_add(grads[0].index_select(1, rows),
                                                                  q.index_select(1, rows), k, v, s[9], s[10], scale,
                                                                  dk, dv));
            dq.index_add_(1, rows, dqg);
        }
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor()};
    }
};

at::Tensor seq_attention_eager_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                                        const std::optional<at::Tensor>& bwd_windows, c10::IntArrayRef mask_code,
                                        double scale, int64_t num_windows,
                                        const std::optional<at::Tensor>& global_rows) {
    return SeqAttentionFn::apply(q, k, v, cu_seqlens, cu_windows, bwd_windows, mask_code.vec(), scale, num_windows,
                                 global_rows);
}

// Below autograd (torch.inference_mode, say): the forward alone.
at::Tensor seq_attention_eager_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& cu_seqlens, const at::Tensor& cu_windows,
                                    const std::optional<at::Tensor>& bwd_windows, c10::IntArrayRef mask_code,
                                    double scale, int64_t num_windows, const std::optional<at::Tensor>& global_rows) {
    (void)bwd_windows;
    return seq_eager_forward(q, k, v, cu_seqlens, cu_windows, mask_code, scale, num_windows, global_rows).out;
}

// ---- the edge-feature attention's eager autograd ------------------------------
// edge_feature_eager: edge_terms.edge_feature_attention's node path as one C++
// op and autograd node, for eager mode without dropout (q, k, v fp16 / bf16
// or fp32 of a compiled head dim: ops.edge_feature_eager_fits).
// TransformerConv's e_ij = W_e a_ij enter as a key term, the bias
// <qe_i, a_e> with qe = scale q W_e, and a value term, W_e agg_i with
// agg_i = sum_e alpha_e a_e: the per-head projections by W_e (two
// head_project kernels), the edge kernels (edge_dot, fwd_scores,
// edge_probs, edge_scatter) and the final sum forward; backward, the
// kernels' folded backward (bwd, edge_scatter, edge_rows: ops.py's
// edge_terms_backward), the projections' transposes and W_e's gradient
// (head_outer_sum and a sum over its chunks). As Python autograd
// nodes (the autograd.Function _EdgeFeatureTerms between the projections)
// these were most of a call's host time on small graphs (README: ZINC
// x1024, H100, 257 us of host for about 60 us of kernels a forward with the
// Function's middle part in C++). Same kernels and products as the Python
// composition, but the projections: fp32 from the inputs as they are (the
// Python path's block-diagonal GEMMs round to autocast's dtype), where
// cuBLAS's calls cost 35-90 us of host time each (csrc/kernels/head_project.h).
//
// (y, alpha) from q, k, v [N, H, C], w_e [H, C, F] (lin_edge's weight per
// head), a [E, F]; fwd_graph: the plan's forward_args (six), bwd_graph its
// backward_args (four; empty where no gradient will be asked for),
// edge_slots its bias_args (six), dst [E] int64, (rowptr, order) the edges
// by destination, all in a's edge order.

// A float32 contiguous copy where t is not one (ops._f32).
at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// ops._edge_dot on the kernel, in the dtype the Python path returns
// (promote(x, a)), then float32 as the callers take it.
at::Tensor edge_dot_f32(const at::Tensor& x, const at::Tensor& a, const at::Tensor& dst) {
    const at::ScalarType dt = at::promote_types(x.scalar_type(), a.scalar_type());
    return edge_dot_cuda(f32(x), f32(a), dst).to(dt).to(at::kFloat);
}

// ops._edge_scatter on the kernel: [N, H, F] in promote(w, a).
at::Tensor edge_scatter_typed(const at::Tensor& w, const at::Tensor& a, const at::Tensor& rowptr,
                              const at::Tensor& order) {
    return edge_scatter_cuda(f32(w), f32(a), rowptr, order).to(at::promote_types(w.scalar_type(), a.scalar_type()));
}

RowDtype row_dtype(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return RowDtype::kF32;
        case at::kHalf: return RowDtype::kF16;
        case at::kBFloat16: return RowDtype::kBF16;
        default: TORCH_CHECK(false, name, " must be fp32, fp16 or bf16 (got ", dtype_name(t.scalar_type()), ")");
    }
}

HeadShape head_shape(const at::Tensor& w32, int64_t rows) {
    TORCH_CHECK(w32.scalar_type() == at::kFloat && w32.dim() == 3 && w32.is_contiguous(),
                "w must be a contiguous float32 [H, C, F] tensor");
    // head_project's shared chunk of w[h]: 16 columns of C or F rows
    TORCH_CHECK(w32.size(1) <= 768 && w32.size(2) <= 768 && w32.size(1) % 4 == 0,
                "w must have C, F <= 768 and C a multiple of 4 (got C = ", num(w32.size(1)), ", F = ",
                num(w32.size(2)), ")");
    return HeadShape{rows, static_cast<int32_t>(w32.size(0)), static_cast<int32_t>(w32.size(1)),
                     static_cast<int32_t>(w32.size(2))};
}

// edge_terms.head_project on the kernel: out[n, h, :] = scale x[n, h, :] W_h
// ([N, H, C] -> [N, H, F]) or, transposed, scale x[n, h, :] W_h^T
// ([N, H, F] -> [N, H, C]); fp32 out, x fp32 / fp16 / bf16, w32 fp32.
at::Tensor head_project(const at::Tensor& x_in, const at::Tensor& w32, double scale, bool transposed) {
    const at::Tensor x = x_in.contiguous();
    const HeadShape s = head_shape(w32, x.size(0));
    TORCH_CHECK(x.dim() == 3 && x.size(1) == s.heads && x.size(2) == (transposed ? s.f : s.c), "x must have shape ",
                shape({x.size(0), s.heads, transposed ? s.f : s.c}), " (got ", shape(x.sizes()), ")");
    at::Tensor out = at::empty({s.rows, s.heads, transposed ? s.c : s.f}, x.options().dtype(at::kFloat));
    C10_CUDA_CHECK(run_head_project(x.data_ptr(), row_dtype(x, "x"), w32.data_ptr<float>(), static_cast<float>(scale),
                                    transposed, out.data_ptr<float>(), s,
                                    c10::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// W's gradient from both projections: sum_n s1 x1[n, h, :]^T y1[n, h, :]
// (+ s2 x2[n, h, :]^T y2[n, h, :] where x2 is defined), [H, C, F] fp32; x1,
// x2 [N, H, C] of one dtype, y1, y2 [N, H, F]. Chunks of rows summed in a
// fixed order (no atomics).
at::Tensor head_outer_sum(const at::Tensor& x1, const at::Tensor& y1, double s1, const at::Tensor& x2,
                          const at::Tensor& y2, double s2, const at::Tensor& w32) {
    const HeadShape s = head_shape(w32, x1.size(0));
    const at::Tensor a1 = x1.contiguous(), b1 = f32(y1);
    const at::Tensor a2 = x2.defined() ? x2.to(a1.scalar_type()).contiguous() : at::Tensor();
    const at::Tensor b2 = x2.defined() ? f32(y2) : at::Tensor();
    for (const at::Tensor* t : {&a1, &a2}) {
        TORCH_CHECK(!t->defined() || t->sizes() == at::IntArrayRef({s.rows, s.heads, s.c}), "x must have shape ",
                    shape({s.rows, s.heads, s.c}), " (got ", shape(t->sizes()), ")");
    }
    for (const at::Tensor* t : {&b1, &b2}) {
        TORCH_CHECK(!t->defined() || t->sizes() == at::IntArrayRef({s.rows, s.heads, s.f}), "y must have shape ",
                    shape({s.rows, s.heads, s.f}), " (got ", shape(t->sizes()), ")");
    }
    const int64_t chunks = head_outer_sum_chunks(s);
    at::Tensor partials = at::empty({chunks, s.heads, s.c, s.f}, w32.options());
    C10_CUDA_CHECK(run_head_outer_sum(a1.data_ptr(), b1.data_ptr<float>(), static_cast<float>(s1),
                                      a2.defined() ? a2.data_ptr() : nullptr,
                                      b2.defined() ? b2.data_ptr<float>() : nullptr, static_cast<float>(s2),
                                      row_dtype(a1, "x"), partials.data_ptr<float>(), chunks, s,
                                      c10::cuda::getCurrentCUDAStream().stream()));
    return chunks == 1 ? partials[0] : partials.sum(0);
}

struct EdgeTermsGraph {   // the graph's arrays, as the node's ops take them
    std::vector<at::Tensor> fwd, bwd, slots;
    at::Tensor dst, rowptr, order;
};

void check_edge_terms_graph(const EdgeTermsGraph& g) {
    TORCH_CHECK(g.fwd.size() == 6, "fwd_graph must be the plan's six forward arrays (got ", num(int64_t(g.fwd.size())),
                ")");
    TORCH_CHECK(g.bwd.empty() || g.bwd.size() == 4, "bwd_graph must be the plan's four backward arrays or empty (got ",
                num(int64_t(g.bwd.size())), ")");
    TORCH_CHECK(g.slots.size() == 6, "edge_slots must be the plan's six bias arrays (got ",
                num(int64_t(g.slots.size())), ")");
}

// The attention with the key term and the value sum (ops.edge_terms_forward):
// (out, lse, bias, alpha, agg), out in float32 where out_fp32 (fp32 inputs:
// q, k, v are their fp16 casts here).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> edge_terms_forward(
        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qe, const at::Tensor& a,
        const EdgeTermsGraph& g, double scale, bool out_fp32) {
    const at::Tensor bias = edge_dot_f32(qe, a, g.dst);
    const std::vector<at::Tensor>& f = g.fwd;
    auto [out, lse, scores] = fwd_scores_cuda(q, k, v, f[0], f[1], f[2], f[3], f[4], f[5], scale, out_fp32, bias,
                                              g.slots[0], g.slots[1], g.slots[2], 0.0, 0, std::nullopt);
    at::Tensor alpha = edge_probs_cuda(scores, bias, lse, g.dst, scale);
    at::Tensor agg = edge_scatter_typed(alpha, a, g.rowptr, g.order);
    return {out, lse, bias, alpha, agg};
}

// Everything the backward reads.
struct EdgeFeatureForward {
    at::Tensor y, alpha;                         // the outputs
    at::Tensor qk, kk, vk;                       // q, k, v as the kernels read them (fp32's fp16 casts)
    at::Tensor out, lse, bias, agg, qe;          // the attention's and its terms'
    at::Tensor w32;                              // w_e in float32, contiguous (the projections' weight)
};

EdgeFeatureForward edge_feature_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& w_e, const at::Tensor& a, const EdgeTermsGraph& g,
                                        double scale) {
    check_edge_terms_graph(g);
    const int64_t H = q.size(1), C = q.size(2);
    TORCH_CHECK(w_e.dim() == 3 && w_e.size(0) == H && w_e.size(1) == C && w_e.size(2) == a.size(1),
                "w_e must have shape [H, C, F] = ", shape({H, C, a.size(1)}), " (got ", shape(w_e.sizes()), ")");
    EdgeFeatureForward r;
    // fp32 inputs (ops._cast_once): the kernels read their fp16 casts, made
    // once and saved, and write out (and the backward q, k, v's gradients)
    // in float32; the projections take the inputs as they are
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "q, k and v must have one dtype (got ", dtype_name(q.scalar_type()), ", ",
                dtype_name(k.scalar_type()), ", ", dtype_name(v.scalar_type()), ")");
    const bool fp32_in = q.scalar_type() == at::kFloat;
    r.qk = fp32_in ? q.to(at::kHalf) : q;
    r.kk = fp32_in ? k.to(at::kHalf) : k;
    r.vk = fp32_in ? v.to(at::kHalf) : v;
    r.w32 = f32(w_e);
    r.qe = head_project(q, r.w32, scale, false);   // [N, H, F] fp32
    std::tie(r.out, r.lse, r.bias, r.alpha, r.agg) =
        edge_terms_forward(r.qk, r.kk, r.vk, r.qe, a, g, scale, fp32_in);
    // y = out + W_e agg in out's dtype: one kernel (add's out= casts)
    r.y = at::empty_like(r.out);
    at::add_out(r.y, r.out, head_project(r.agg, r.w32, 1.0, true));
    return r;
}

struct EdgeFeatureFn : public torch::autograd::Function<EdgeFeatureFn> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& w_e, const at::Tensor& a, std::vector<at::Tensor> fwd_graph,
                                 std::vector<at::Tensor> bwd_graph, std::vector<at::Tensor> edge_slots,
                                 const at::Tensor& dst, const at::Tensor& rowptr, const at::Tensor& order,
                                 double scale) {
        const EdgeTermsGraph g{std::move(fwd_graph), std::move(bwd_graph), std::move(edge_slots), dst, rowptr, order};
        EdgeFeatureForward f = edge_feature_forward(q, k, v, w_e, a, g, scale);
        ctx->save_for_backward({f.qk, f.kk, f.vk, f.qe, a, f.out, f.lse, f.bias, f.alpha, f.agg, dst, rowptr, order, q,
                                f.w32});
        ctx->saved_data["fwd"] = g.fwd;
        ctx->saved_data["bwd"] = g.bwd;
        ctx->saved_data["slots"] = g.slots;
        ctx->saved_data["scale"] = scale;
        ctx->saved_data["w_dtype"] = static_cast<int64_t>(w_e.scalar_type());
        ctx->set_materialize_grads(false);
        return {f.y, f.alpha};
    }

    // The value term's projection backward (grad_y W_e per head) gives
    // dagg; the attention's (ops.py: edge_terms_backward: the value sum's
    // share of delta is <dagg_i, agg_i> per node, the gradient of `a` one
    // pass over the edges for both terms) gives dq, dk, dv, dqe, da; the key
    // term's projection backward (dqe W_e^T, scaled) adds to dq; W_e's
    // gradient is both projections' outer sums in one head_outer_sum.
    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "gt_fused3s: double backward through the edge-feature attention is not supported (the fused "
                    "backward kernels are not differentiable)");
        const variable_list s = ctx->get_saved_variables();
        // q, k, v as the kernels read them; out is float32 for fp32 inputs,
        // whose gradients then come in float32 from the kernel's accumulators
        const at::Tensor &q = s[0], &k = s[1], &v = s[2], &qe = s[3], &a = s[4], &out = s[5], &lse = s[6],
                         &bias = s[7], &alpha = s[8], &agg = s[9], &dst = s[10], &rowptr = s[11], &order = s[12],
                         &q_in = s[13], &w32 = s[14];   // q as given (the projection's input)
        const std::vector<at::Tensor> f = ctx->saved_data["fwd"].toTensorVector();
        const std::vector<at::Tensor> b = ctx->saved_data["bwd"].toTensorVector();
        const std::vector<at::Tensor> sl = ctx->saved_data["slots"].toTensorVector();
        const double scale = ctx->saved_data["scale"].toDouble();
        const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
        TORCH_CHECK(b.size() == 4, "gt_fused3s: the edge-feature attention was called without the backward's "
                    "graph arrays (no input required a gradient then)");
        // (needs_input_grad counts the tensor inputs: q, k, v, w_e, a first)
        const bool need_q = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(3),
                   need_a = ctx->needs_input_grad(4);
        const at::Tensor &grad_y = grads[0], &grad_alpha = grads[1];
        at::Tensor gv, grad_agg;
        if (grad_y.defined()) {   // the value term: y = out + agg W_e^T per head
            gv = grad_y.to(q_in.scalar_type());
            grad_agg = head_project(gv, w32, 1.0, false).to(agg.scalar_type());
        }
        // the attention with its terms
        const bool fp32_in = out.scalar_type() == at::kFloat;
        const at::Tensor grad_out = grad_y.defined() ? grad_y.to(q.scalar_type()) : at::zeros_like(q);
        std::optional<at::Tensor> dp_bias, delta_extra;
        if (grad_agg.defined()) {
            dp_bias = edge_dot_f32(grad_agg, a, dst);
            delta_extra = (grad_agg.to(at::kFloat) * agg.to(at::kFloat)).sum(-1);
        }
        if (grad_alpha.defined()) {
            const at::Tensor ga = grad_alpha.to(at::kFloat).contiguous();
            dp_bias = dp_bias.has_value() ? *dp_bias + ga : ga;
            const at::Tensor extra = at::zeros_like(lse).index_add_(0, dst, alpha * ga);   // ops.weights_delta
            delta_extra = delta_extra.has_value() ? *delta_extra + extra : extra;
        }
        auto [dq, dk, dv, ds] = bwd_cuda(grad_out, q, k, v, out, lse, f[1], f[2], f[4], f[5], b[0], b[1], b[2], b[3],
                                         scale, fp32_in, bias, sl[0], sl[1], sl[2], sl[3], sl[4], sl[5], dp_bias,
                                         delta_extra, 0.0, 0, std::nullopt);
        dp_bias.reset();   // per-edge temporaries go as soon as they are used (peak memory)
        at::Tensor da, dw;
        if (need_q || need_w) {   // the key term: qe = scale q W_e per head
            const at::Tensor gqe = edge_scatter_typed(ds, a, rowptr, order).to(qe.scalar_type());
            if (need_q) dq.add_(head_project(gqe, w32, scale, true));   // (add_ casts to dq's dtype)
            // both terms' products: scale q^T gqe + gv^T agg per head
            if (need_w) dw = head_outer_sum(q_in, gqe, scale, gv, agg, 1.0, w32).to(w_dtype);
        }
        if (need_a) {
            const at::ScalarType dt = at::promote_types(ds.scalar_type(), qe.scalar_type());
            da = grad_agg.defined() ? edge_rows_cuda(f32(ds), f32(qe), dst, f32(alpha), f32(grad_agg))
                                    : edge_rows_cuda(f32(ds), f32(qe), dst, std::nullopt, std::nullopt);
            da = da.to(dt).to(a.scalar_type());
        }
        return {need_q ? dq : at::Tensor(), ctx->needs_input_grad(1) ? dk : at::Tensor(),
                ctx->needs_input_grad(2) ? dv : at::Tensor(), dw, da, at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

std::tuple<at::Tensor, at::Tensor> edge_feature_eager_autograd(
        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w_e, const at::Tensor& a,
        at::TensorList fwd_graph, at::TensorList bwd_graph, at::TensorList edge_slots, const at::Tensor& dst,
        const at::Tensor& rowptr, const at::Tensor& order, double scale) {
    variable_list r = EdgeFeatureFn::apply(q, k, v, w_e, a, fwd_graph.vec(), bwd_graph.vec(), edge_slots.vec(), dst,
                                           rowptr, order, scale);
    return {r[0], r[1]};
}

// Below autograd (torch.inference_mode, say): the forward alone.
std::tuple<at::Tensor, at::Tensor> edge_feature_eager_cuda(
        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w_e, const at::Tensor& a,
        at::TensorList fwd_graph, at::TensorList bwd_graph, at::TensorList edge_slots, const at::Tensor& dst,
        const at::Tensor& rowptr, const at::Tensor& order, double scale) {
    const EdgeTermsGraph g{fwd_graph.vec(), bwd_graph.vec(), edge_slots.vec(), dst, rowptr, order};
    EdgeFeatureForward f = edge_feature_forward(q, k, v, w_e, a, g, scale);
    return {f.y, f.alpha};
}

}  // namespace
}  // namespace gt_fused3s

// The schemas (and the fake kernels torch.compile traces with) are defined in
// Python, gt_fused3s/ops.py, at import; this file only implements them.
TORCH_LIBRARY_IMPL(gt_fused3s, CUDA, m) {
    m.impl("fwd", &gt_fused3s::fwd_cuda);
    m.impl("fwd_scores", &gt_fused3s::fwd_scores_cuda);
    m.impl("bwd", &gt_fused3s::bwd_cuda);
    m.impl("fwd8", &gt_fused3s::fwd8_cuda);
    m.impl("bwd8", &gt_fused3s::bwd8_cuda);
    m.impl("bsb_build", &gt_fused3s::bsb_build_cuda);
    m.impl("edge_slots", &gt_fused3s::edge_slots_cuda);
    m.impl("work_schedule", &gt_fused3s::work_schedule_cuda);
    m.impl("seq_fwd", &gt_fused3s::seq_fwd_cuda);
    m.impl("seq_bwd", &gt_fused3s::seq_bwd_cuda);
    m.impl("edge_dot", &gt_fused3s::edge_dot_cuda);
    m.impl("edge_rows", &gt_fused3s::edge_rows_cuda);
    m.impl("edge_probs", &gt_fused3s::edge_probs_cuda);
    m.impl("edge_scatter", &gt_fused3s::edge_scatter_cuda);
    m.impl("gather_rows", &gt_fused3s::gather_rows_cuda);
    m.impl("dense_rows_fwd", &gt_fused3s::dense_rows_fwd_cuda);
    m.impl("dense_rows_bwd", &gt_fused3s::dense_rows_bwd_cuda);
    m.impl("seq_attention_eager", &gt_fused3s::seq_attention_eager_cuda);
    m.impl("edge_feature_eager", &gt_fused3s::edge_feature_eager_cuda);
}

// The ops whose autograd lives here (the others' is in ops.py): eager
// backwards without Python (SeqAttentionFn, EdgeFeatureFn).
TORCH_LIBRARY_IMPL(gt_fused3s, Autograd, m) {
    m.impl("seq_attention_eager", &gt_fused3s::seq_attention_eager_autograd);
    m.impl("edge_feature_eager", &gt_fused3s::edge_feature_eager_autograd);
}
