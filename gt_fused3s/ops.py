"""Public functional API ``fused3s_attention``, and every registered op with
its fake kernel and autograd.

Ops of the ``gt_fused3s`` namespace (schemas and fake kernels registered at
import; the CUDA implementations come with the extension, compiled on first
use, see ``_build``):

* ``fwd``        the fused forward kernel: (out, lse) from q, k, v and a plan's arrays
                 (and an optional edge bias with the plan's edge slots)
* ``fwd_scores`` fwd that also writes each edge's q_i.k_j; ``edge_probs``
                 the attention weights per edge [E, H] from them and lse
* ``bwd``        the fused backward kernels: (dq, dk, dv, d edge_bias)
* ``fwd8``, ``bwd8``  the same over the 8-row window format
* ``bsb_build``  the CUDA builder of the BSB format, at capacity, no host sync
* ``edge_slots`` each edge's place in a BSB (the plan's edge slots), no host sync
* ``work_schedule`` the kernels' work items and slots of a BSB (schedule.py), no host sync
* ``edge_dot``, ``edge_rows``, ``edge_scatter``
                 the edge-feature kernels (fp32), one pass each
* ``gather_rows`` row gathers (a plan's node and edge orders)
* ``seq_fwd``, ``seq_bwd``, ``seq_attention_eager``, ``dense_rows_fwd``,
  ``dense_rows_bwd``, ``seq_attention``, ``dense_rows``
                 sequence attention with structured masks (and its global rows)
* ``edge_dot_term``, ``edge_scatter_term``
                 the differentiable edge-feature products (:func:`edge_dot`,
                 :func:`edge_scatter`) as ``torch.compile`` sees them
* ``attention``  fwd with autograd (bwd), the one op ``torch.compile`` sees
* ``edge_feature_terms``
                 the edge-feature attention as one node (edge_dot, fwd,
                 edge_scatter; one folded backward), as ``torch.compile``
                 sees :func:`~gt_fused3s.edge_terms.edge_feature_attention`
* ``edge_feature_eager``
                 the edge-feature attention with its projections by W_e as
                 one C++ op and autograd node (eager mode, no dropout, fp16 /
                 bf16 / fp32 operands of a compiled head dim:
                 :func:`edge_feature_eager_fits`)

CUDA tensors take the fused kernel; CPU tensors, and CUDA tensors when the
extension cannot be built or ``GT_FUSED3S_DISABLE_KERNEL=1`` is set, take
the reference path of ``reference.py``, which computes the same function.
"""
from __future__ import annotations

import math
import os
import warnings

import torch
from torch import Tensor

from . import _build
from .graph import _in_capture_or_compile, node_csr, tcb_capacity
from .plan import ROWS8_NO_EDGE_TERMS, GraphPlan, as_plan, padded_head_dim
from .reference import _check_qkv, attention_reference, default_scale

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
_KERNEL_DIMS = frozenset(_SUPPORTED_HEAD_DIMS)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

# ----------------------------------------------------------- op schemas + fakes
_LIB = torch.library.Library("gt_fused3s", "FRAGMENT")
_LIB.define("fwd(Tensor q, Tensor k, Tensor v, Tensor rw_offset, Tensor cols, Tensor bitmap, "
            "Tensor window_order, Tensor items, Tensor slots, float scale, bool out_fp32, "
            "Tensor? edge_bias=None, Tensor? nnz_offset=None, Tensor? slot_edge=None, Tensor? slot_pos=None, "
            "float dropout_p=0.0, int dropout_seed=0, Tensor? dropout_seed_t=None) -> (Tensor out, Tensor lse)")
_LIB.define("bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cols, "
            "Tensor bitmap, Tensor items, Tensor slots, Tensor t_cols, Tensor t_bitmap, Tensor t_items, "
            "Tensor t_slots, float scale, bool grad_fp32, Tensor? edge_bias=None, "
            "Tensor? nnz_offset=None, Tensor? slot_edge=None, Tensor? slot_pos=None, "
            "Tensor? t_nnz_offset=None, Tensor? t_slot_edge=None, Tensor? t_slot_pos=None, Tensor? dp_bias=None, "
            "Tensor? delta_extra=None, float dropout_p=0.0, int dropout_seed=0, Tensor? dropout_seed_t=None) "
            "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_bias)")
# The forward that also returns each edge's raw dot product q_i.k_j [E, H]
# fp32 in the caller's edge order (the weights follow from it and lse).
_LIB.define("fwd_scores(Tensor q, Tensor k, Tensor v, Tensor rw_offset, Tensor cols, Tensor bitmap, "
            "Tensor window_order, Tensor items, Tensor slots, float scale, bool out_fp32, "
            "Tensor? edge_bias, Tensor nnz_offset, Tensor slot_edge, Tensor slot_pos, "
            "float dropout_p=0.0, int dropout_seed=0, Tensor? dropout_seed_t=None) "
            "-> (Tensor out, Tensor lse, Tensor scores)")
# (SymInt: under torch.compile(dynamic=True) the node count stays symbolic;
# an int specialised it and recompiled the graph for every node count)
_LIB.define("bsb_build(Tensor edge_index, SymInt num_nodes) -> (Tensor rw_offset, Tensor cols, "
            "Tensor bitmap, Tensor window_order, Tensor edges, Tensor counters)")
# Where each edge of edge_index sits in the BSB built from it (graph.py:
# edge_slots), from the edges and the BSB's arrays: (nnz_offset, slot_edge, slot_pos).
_LIB.define("edge_slots(Tensor edge_index, Tensor rw_offset, Tensor cols, Tensor bitmap, SymInt num_nodes) "
            "-> (Tensor nnz_offset, Tensor slot_edge, Tensor slot_pos)")
# The work schedule of a BSB (schedule.py: work_schedule) at the capacities
# given: (items [I, 4], slots [S, 4], counts [2]: the items and slots used).
# SymInt: the chunk bound and the capacities follow the TCB capacity, symbolic
# under torch.compile(dynamic=True).
_LIB.define("work_schedule(Tensor rw_offset, Tensor window_order, SymInt chunk, SymInt threshold, "
            "SymInt num_items, SymInt num_slots) -> (Tensor items, Tensor slots, Tensor counts)")
_LIB.define("seq_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor cu_windows, int[] mask, "
            "float scale, int num_windows, int block_rows) -> (Tensor out, Tensor lse)")
# The backward takes the forward's row blocks (cu_windows, num_windows): by
# key blocks it runs on them; by query blocks on bwd_windows, which it makes
# if not given (csrc/bindings.cpp: seq_bwd_cuda chooses).
_LIB.define("seq_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor cu_seqlens, Tensor cu_windows, Tensor? bwd_windows, int[] mask, float scale, "
            "int num_windows) -> (Tensor dq, Tensor dk, Tensor dv)")
# seq_fwd with seq_bwd as its autograd, both in C++ (eager mode's sequence
# attention on q, k, v [..., H, D]: csrc/bindings.cpp, SeqAttentionFn), with
# the global rows of [B, L, H, D] operands by the dense-rows kernels inside.
_LIB.define("seq_attention_eager(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor cu_windows, "
            "Tensor? bwd_windows, int[] mask, float scale, int num_windows, Tensor? global_rows=None) -> Tensor")
# The edge-feature attention (edge_terms.py: the projections by W_e, the
# node's kernels, the value term) with its backward, both in C++
# (csrc/bindings.cpp: EdgeFeatureFn): (out, alpha) from q, k, v, w_e [H, C, F],
# the edge features a, the plan's forward, backward (or none) and bias
# arrays, and the edges' destinations and CSR.
_LIB.define("edge_feature_eager(Tensor q, Tensor k, Tensor v, Tensor w_e, Tensor a, Tensor[] fwd_graph, "
            "Tensor[] bwd_graph, Tensor[] edge_slots, Tensor dst, Tensor rowptr, Tensor order, float scale) "
            "-> (Tensor out, Tensor alpha)")
# Dense rows of sequence attention (csrc/kernels/dense_rows.h): a few
# queries [B, G, H, D] against all keys [B, L, H, D].
_LIB.define("dense_rows_fwd(Tensor qg, Tensor k, Tensor v, float scale) -> (Tensor og, Tensor lse)")
_LIB.define("dense_rows_bwd(Tensor dog, Tensor qg, Tensor k, Tensor v, Tensor og, Tensor lse, float scale) "
            "-> (Tensor dqg, Tensor dk, Tensor dv)")
_LIB.define("edge_dot(Tensor x, Tensor a, Tensor idx) -> Tensor")
_LIB.define("edge_rows(Tensor w, Tensor x, Tensor idx, Tensor? w2=None, Tensor? x2=None) -> Tensor")
_LIB.define("edge_probs(Tensor scores, Tensor? bias, Tensor lse, Tensor idx, float scale) -> Tensor")
_LIB.define("edge_scatter(Tensor w, Tensor a, Tensor rowptr, Tensor order) -> Tensor")
_LIB.define("gather_rows(Tensor x, Tensor index) -> Tensor")
# The kernels over 8-row windows (csrc/kernels/rows8_params.h): the 8-row
# format's rw_offset, cols, bitmap and its windows heaviest first
# (BSBGraph8.window_items), no schedule, no edge terms;
# the backward takes the graph's and the transposed graph's (t_*).
_LIB.define("fwd8(Tensor q, Tensor k, Tensor v, Tensor rw_offset, Tensor cols, Tensor bitmap, "
            "Tensor windows, float scale, bool out_fp32) -> (Tensor out, Tensor lse)")
_LIB.define("bwd8(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor rw_offset, "
            "Tensor cols, Tensor bitmap, Tensor windows, Tensor t_rw_offset, Tensor t_cols, "
            "Tensor t_bitmap, Tensor t_windows, float scale, bool grad_fp32) "
            "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v)")


@torch.library.register_fake("gt_fused3s::fwd")
def _fwd_fake(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32,
              edge_bias=None, nnz_offset=None, slot_edge=None, slot_pos=None, dropout_p=0.0, dropout_seed=0,
              dropout_seed_t=None):
    N, H, D = q.shape       # q's rows: k and v may have more (the graph's nodes)
    return (q.new_empty((N, H, D), dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty((N, H), dtype=torch.float32))


@torch.library.register_fake("gt_fused3s::bwd")
def _bwd_fake(grad_out, q, k, v, out, lse, cols, bitmap, items, slots, t_cols, t_bitmap, t_items,
              t_slots, scale, grad_fp32, edge_bias=None, nnz_offset=None, slot_edge=None, slot_pos=None,
              t_nnz_offset=None, t_slot_edge=None, t_slot_pos=None, dp_bias=None, delta_extra=None,
              dropout_p=0.0, dropout_seed=0, dropout_seed_t=None):
    dtype = torch.float32 if grad_fp32 else q.dtype
    grad_bias = (torch.empty_like(edge_bias) if edge_bias is not None
                 else q.new_empty((0,), dtype=torch.float32))
    return (q.new_empty(q.shape, dtype=dtype), *(k.new_empty(k.shape, dtype=dtype) for _ in range(2)),
            grad_bias)


@torch.library.register_fake("gt_fused3s::fwd8")
def _fwd8_fake(q, k, v, rw_offset, cols, bitmap, windows, scale, out_fp32):
    N, H, D = q.shape
    return (q.new_empty((N, H, D), dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty((N, H), dtype=torch.float32))


@torch.library.register_fake("gt_fused3s::bwd8")
def _bwd8_fake(grad_out, q, k, v, out, lse, rw_offset, cols, bitmap, windows, t_rw_offset, t_cols,
               t_bitmap, t_windows, scale, grad_fp32):
    dtype = torch.float32 if grad_fp32 else q.dtype
    return tuple(t.new_empty(t.shape, dtype=dtype) for t in (q, k, v))


def _is_rows8(fwd_args: tuple) -> bool:
    """Whether a plan's forward arguments are the 8-row format's four
    arrays (the 16-row ones are six: the format's four, the schedule's
    items and slots)."""
    return len(fwd_args) == 4


@torch.library.register_fake("gt_fused3s::fwd_scores")
def _fwd_scores_fake(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32,
                     edge_bias, nnz_offset, slot_edge, slot_pos, dropout_p=0.0, dropout_seed=0,
                     dropout_seed_t=None):
    return (*_fwd_fake(q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32),
            q.new_empty((slot_edge.size(0), q.size(1)), dtype=torch.float32))


@torch.library.register_fake("gt_fused3s::edge_slots")
def _edge_slots_fake(edge_index, rw_offset, cols, bitmap, num_nodes):
    E = edge_index.size(1)
    return (bitmap.new_empty((bitmap.size(0) + 1,), dtype=torch.int32), bitmap.new_empty((E,), dtype=torch.int32),
            bitmap.new_empty((E,), dtype=torch.uint8))


@torch.library.register_fake("gt_fused3s::work_schedule")
def _work_schedule_fake(rw_offset, window_order, chunk, threshold, num_items, num_slots):
    return (rw_offset.new_empty((num_items, 4)), rw_offset.new_empty((num_slots, 4)),
            rw_offset.new_empty((2,), dtype=torch.int64))


@torch.library.register_fake("gt_fused3s::seq_fwd")
def _seq_fwd_fake(q, k, v, cu_seqlens, cu_windows, mask, scale, num_windows, block_rows):
    T, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((T, H), dtype=torch.float32)


@torch.library.register_fake("gt_fused3s::seq_bwd")
def _seq_bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens, cu_windows, bwd_windows, mask, scale, num_windows):
    return tuple(q.new_empty(q.shape) for _ in range(3))


@torch.library.register_fake("gt_fused3s::seq_attention_eager")
def _seq_attention_eager_fake(q, k, v, cu_seqlens, cu_windows, bwd_windows, mask, scale, num_windows,
                              global_rows=None):
    return q.new_empty(q.shape)


@torch.library.register_fake("gt_fused3s::edge_feature_eager")
def _edge_feature_eager_fake(q, k, v, w_e, a, fwd_graph, bwd_graph, edge_slots, dst, rowptr, order, scale):
    return q.new_empty(q.shape), q.new_empty((a.size(0), q.size(1)), dtype=torch.float32)


@torch.library.register_fake("gt_fused3s::dense_rows_fwd")
def _dense_rows_fwd_fake(qg, k, v, scale):
    B, G, H, _ = qg.shape
    return qg.new_empty(qg.shape, dtype=torch.float32), qg.new_empty((B, H, G), dtype=torch.float32)


@torch.library.register_fake("gt_fused3s::dense_rows_bwd")
def _dense_rows_bwd_fake(dog, qg, k, v, og, lse, scale):
    B, G, H, D = qg.shape
    return qg.new_empty(qg.shape), *(qg.new_empty((B, k.size(1), H, D)) for _ in range(2))


@torch.library.register_fake("gt_fused3s::bsb_build")
def _bsb_build_fake(edge_index, num_nodes):
    E = edge_index.size(1)
    R = (num_nodes + 15) // 16
    T = tcb_capacity(E, num_nodes)
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    return (edge_index.new_empty((R + 1,), **i32), edge_index.new_empty((T * 8,), **i32),
            edge_index.new_empty((T, 2), **i64), edge_index.new_empty((R,), **i32),
            edge_index.new_empty((2, E), **i64), edge_index.new_empty((5,), **i64))


@torch.library.register_fake("gt_fused3s::edge_dot")
def _edge_dot_fake(x, a, idx):
    return x.new_empty((a.size(0), x.size(1)))


@torch.library.register_fake("gt_fused3s::edge_rows")
def _edge_rows_fake(w, x, idx, w2=None, x2=None):
    return x.new_empty((w.size(0), x.size(2)))


@torch.library.register_fake("gt_fused3s::edge_probs")
def _edge_probs_fake(scores, bias, lse, idx, scale):
    return torch.empty_like(scores)


@torch.library.register_fake("gt_fused3s::edge_scatter")
def _edge_scatter_fake(w, a, rowptr, order):
    return w.new_empty((rowptr.size(0) - 1, w.size(1), a.size(1)))


@torch.library.register_fake("gt_fused3s::gather_rows")
def _gather_rows_fake(x, index):
    return x.new_empty((index.size(0), *x.shape[1:]))


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x.index_select(0, index)``. On a CUDA device with the extension, a
    kernel of our own (``csrc/kernels/gather_rows.h``): torch 2.11's
    index_select takes a fixed ~0.6 ns per index for rows of 16 to 512
    bytes on an H100, ten times what the copy needs (README). Not
    differentiable: its callers carry their own autograd."""
    if _use_kernel(x) and x.dim() >= 1:
        return _op("gather_rows")(x, index if index.dtype == torch.int64 else index.long())
    return x.index_select(0, index)


def bsb_build(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, ...]:
    """``torch.ops.gt_fused3s.bsb_build`` (compiling the extension on first
    use): the BSB arrays at capacity and the counters, on the device."""
    _build.load_extension()
    return torch.ops.gt_fused3s.bsb_build(edge_index, num_nodes)


def edge_slots_op(edge_index: Tensor, rw_offset: Tensor, cols: Tensor, bitmap: Tensor,
                  num_nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.gt_fused3s.edge_slots``: :func:`~gt_fused3s.graph.edge_slots`
    on the device (the edges' keys, their sort, two kernels and a scan in
    place of about 140 aten ops)."""
    _build.load_extension()
    return torch.ops.gt_fused3s.edge_slots(edge_index, rw_offset, cols, bitmap, num_nodes)


def work_schedule_op(rw_offset: Tensor, window_order: Tensor, chunk: int, threshold: int, num_items: int,
                     num_slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.gt_fused3s.work_schedule``: :func:`~gt_fused3s.schedule.work_schedule`
    on the device (three kernels, two scans and a sort in place of about 80
    aten ops)."""
    _build.load_extension()
    return torch.ops.gt_fused3s.work_schedule(rw_offset, window_order, chunk, threshold, num_items, num_slots)


# ------------------------------------------------------------------ public API
def fused3s_attention(q: Tensor, k: Tensor, v: Tensor, graph: GraphPlan | Tensor,
                      scale: float | None = None, *, edge_bias: Tensor | None = None,
                      return_weights: bool = False, dropout_p: float = 0.0,
                      dropout_seed: int | Tensor | None = None, num_nodes: int | None = None,
                      out_dtype: torch.dtype | None = None,
                      compute_dtype: torch.dtype | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Sparse graph attention fused into one kernel (SDDMM, softmax, SpMM).

    .. math::
        \mathbf{o}_{i,h} = \sum_{e = (j \to i)}
        \mathrm{softmax}_e\left(s \langle \mathbf{q}_{i,h}, \mathbf{k}_{j,h} \rangle
        + b_{e,h}\right) \mathbf{v}_{j,h}

    Every edge is a term: an edge listed ``m`` times counts ``m`` times, as
    in PyG's and DGL's message passing (each copy with its own bias).

    Args:
        q, k, v: [N, H, D] node queries, keys and values (fp16 or bf16 for
            the kernel; fp32 is accepted and computed in ``compute_dtype``;
            float64 on the CPU path stays float64). With a plan built with
            ``num_rows`` (a graph whose destinations are its first nodes,
            such as a rank's share of a partitioned graph), q has
            ``num_rows`` rows and k, v the graph's ``num_nodes``.
        graph: a :class:`~gt_fused3s.plan.GraphPlan` (prepared ahead:
            :meth:`~gt_fused3s.plan.GraphPlan.prepare`, so that the call
            builds nothing and makes no host synchronisation), a
            :class:`~gt_fused3s.graph.BSBGraph`, or an ``edge_index`` [2, E]
            (source, destination), whose plan is built for this call (not
            cached: build a plan once and pass it to reuse it). A plan built
            with ``reorder`` (a locality order of the nodes) runs the kernels
            on q, k, v gathered into its order and gathers the output (and
            the gradients) back: inputs, outputs and every edge tensor stay
            in the caller's order.
        scale: the score scale :math:`s`, default ``1 / sqrt(D)``.
        edge_bias: optional [E, H] additive attention bias :math:`b`, in the
            order of the plan's :attr:`~gt_fused3s.plan.GraphPlan.edge_index`
            (the ``edge_index`` it was built from), added to the scaled score
            before the softmax. Differentiable (its gradient is the score
            gradient, in the same order). The kernel reads it in fp32.
        return_weights: also return the attention weights (the softmax
            probabilities) [E, H] fp32, in the same edge order, computed
            from the forward's log-sum-exp in one score pass. They are
            differentiable: their gradient enters the fused backward. They
            are the weights before dropout, as TransformerConv returns them.
        dropout_p: attention dropout (pass it while training only, as to
            ``F.scaled_dot_product_attention``): each edge's weight in the
            sum is dropped with probability ``dropout_p`` and the kept ones
            scaled by ``1 / (1 - dropout_p)``, per head. The mask comes from
            a counter-based hash of (seed, head, edge id) that the backward
            regenerates; :func:`dropout_keep` computes it (for tests).
        dropout_seed: the mask's seed, an int or an int64 tensor of one
            element on q's device (read by the kernels there: no host
            synchronisation). Default: drawn per call, from torch's CPU
            generator when the call runs eagerly, on the device inside a
            captured CUDA graph or a compiled region (each replay or call
            draws a new one; ``torch.manual_seed`` makes either repeatable).
            An int inside a capture or a compiled region raises: it would
            replay one mask.
        num_nodes: with an ``edge_index``, the node count (default ``N``).
        out_dtype: dtype of the output, default ``q.dtype``.
        compute_dtype: operand precision of the kernel for fp32 inputs,
            ``torch.float16`` (default) or ``torch.bfloat16``.

    Returns:
        [N, H, D] (and the weights [E, H] with ``return_weights``); rows
        without in-neighbours are 0. Differentiable once
        (double backward raises): the kernel path's gradients come from the
        fused backward kernels, which recompute the scores from q, k (and
        the bias) and the forward's per-row log-sum-exp over the graph's
        BSB and its transpose.
    """
    if edge_bias is None and not return_weights and not dropout_p:
        out = _fast_path(q, k, v, graph, scale, out_dtype, compute_dtype)
        if out is not None:
            return out
    elif isinstance(graph, GraphPlan) and graph.window_rows == 8:
        raise ValueError(ROWS8_NO_EDGE_TERMS)
    N, H, D = _check_qkv(q, k, v, rows=True)
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)} (got {tuple(v.shape)})")
    if k.size(0) != N and not isinstance(graph, GraphPlan):
        raise ValueError(f"q has {N} rows and k, v {k.size(0)}: pass a GraphPlan built with "
                         f"num_rows={N} (GraphPlan.from_edge_index(edge_index, {k.size(0)}, num_rows={N}))")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"out_dtype must be a floating-point torch.dtype (got {out_dtype})")
    scale = default_scale(D) if scale is None else float(scale)
    if compute_dtype is not None and compute_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"compute_dtype must be torch.float16 or torch.bfloat16 (got {compute_dtype})")
    if not _use_kernel(q):
        # The reference reads the edges only: an edge_index needs no format.
        if isinstance(graph, Tensor):
            _check_edges_for(graph, N, num_nodes, q.device)
            edges = graph
        else:
            plan = as_plan(graph)
            _check_plan_for(plan, q, k)
            edges = plan.edge_index
        _check_edge_bias(edge_bias, edges.size(1), H, q.device)
        mask = dropout_factors(_dropout(dropout_p, dropout_seed, q.device), edges.size(1), H, q.device)
        return attention_reference(q, k, v, edges, scale, edge_bias=edge_bias, dropout_mask=mask,
                                   return_weights=return_weights, out_dtype=out_dtype or q.dtype,
                                   compute_dtype=torch.float64 if q.dtype == torch.float64
                                   else torch.float32)
    plan = as_plan(graph, N if num_nodes is None else num_nodes)
    _check_plan_for(plan, q, k)
    _check_kernel_inputs(q, k, v)
    _check_edge_bias(edge_bias, plan.num_edges, H, q.device)
    Dp = padded_head_dim(D)
    fwd_args = plan.forward_args(H, Dp)
    out_dtype = out_dtype or q.dtype
    drop = _dropout(dropout_p, dropout_seed, q.device)
    # the bias in the kernel's fp32 (a no-op for an fp32 bias); the edge slots
    bias = None if edge_bias is None else edge_bias.float().contiguous()
    slots = plan.bias_args() if bias is not None or return_weights or dropout_p else ()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad))
    bwd_args = plan.backward_args(H, Dp) if grad else ()
    # the kernels' rows are the plan's nodes (the destinations of the
    # returned weights' gradient too); edge tensors keep the caller's order
    dst = plan.kernel_edge_index[1] if return_weights else None
    # per-edge arrays grouped by destination where the caller's order
    # scatters them (plan.edge_grouping: PyG's order is by source), for a
    # call with a backward (a forward alone measured slower: 1.10 -> 1.16 ms
    # on the 200k graph, H = 4, the gathers unpaid); not with dropout, whose
    # mask is keyed by the caller's edge ids. Under torch.compile: a grouping
    # the plan decided before (prepare, an eager call) is read as is, its
    # permutations traced as indexing
    compiling = torch.compiler.is_compiling()
    grouping = plan.edge_grouping() if slots and grad and not drop[0] else None
    if grouping is not None:
        slots = grouping.slots
        if bias is not None:
            bias = bias[grouping.perm] if compiling else _permute_rows(bias, grouping.perm, grouping.inv)
        if dst is not None:
            dst = grouping.dst
    order = plan.order
    if order is not None:
        q, k, v = (_permute_rows(t, order.perm, order.inv) for t in (q, k, v))
    if compiling:
        out, _, probs = _attention_op(q, k, v, list(fwd_args), list(bwd_args), scale, out_dtype,
                                      compute_dtype, bias, list(slots), dst, *drop)
    elif grad:
        out, probs = _FusedAttention.apply(q, k, v, bias, fwd_args, bwd_args, slots, dst, scale,
                                           out_dtype, compute_dtype, drop)
    else:
        out, _, probs = _kernel_forward(q, k, v, fwd_args, scale, out_dtype, compute_dtype, bias, slots,
                                        dst, drop)
    if order is not None:
        out = _permute_rows(out, order.inv, order.perm)
    if grouping is not None and probs is not None:
        probs = probs[grouping.inv] if compiling else _permute_rows(probs, grouping.inv, grouping.perm)
    return (out, probs) if return_weights else out


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` (:func:`gather_rows`) whose gradient is the
    gather by the inverse (not index_select's zero fill and scatter-add)."""

    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return gather_rows(x, perm)

    @staticmethod
    def backward(ctx, grad):
        inv, = ctx.saved_tensors
        return gather_rows(grad, inv), None, None


def _permute_rows(x: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
    """Rows of ``x`` in the order ``perm`` (new -> old; ``inv`` its
    inverse), one gather forward and one backward; a reordered plan's q, k,
    v go in this way and its output comes back with (inv, perm)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _PermuteRows.apply(x, perm, inv)
    return gather_rows(x, perm)


def _dropout(p: float, seed: int | Tensor | None,
             device: torch.device | str | None = None) -> tuple[float, int, Tensor | None]:
    """(p, seed, seed tensor or None) of the kernels' attention dropout, as
    the ops take them; (0.0, 0, None) without. ``seed`` None: drawn, from
    torch's CPU generator (an int: no device op) where the call runs
    eagerly, and on ``device`` inside a captured CUDA graph or a compiled
    region (:func:`draw_dropout_seed_tensor`), where an int would be frozen
    into the graph: the kernels then read the seed from device memory, so
    each replay or compiled call draws a new mask and its backward
    regenerates that one."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (got {p})")
    if p == 0.0:
        return 0.0, 0, None
    if seed is None and _in_capture_or_compile():
        seed = draw_dropout_seed_tensor(device if device is not None else "cpu")
    if isinstance(seed, Tensor):
        if seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError(f"a dropout_seed tensor must hold one int64 (got {seed.dtype} "
                             f"{tuple(seed.shape)})")
        if device is not None and seed.device != torch.device(device):
            raise ValueError(f"the dropout_seed tensor is on {seed.device} but q, k, v are on {device}")
        return p, 0, seed
    if _in_capture_or_compile():
        raise NotImplementedError("an int dropout_seed inside a captured CUDA graph or a torch.compile "
                                  "region would replay one mask: pass dropout_seed=None (a seed drawn "
                                  "on the device each run) or a seed tensor")
    if seed is None:
        seed = draw_dropout_seed()
    return p, int(seed) % 2**63, None       # the ops take an int64 seed


def draw_dropout_seed() -> int:
    """A dropout seed from torch's CPU generator (no device sync;
    ``torch.manual_seed`` makes it repeatable)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def draw_dropout_seed_tensor(device: torch.device | str) -> Tensor:
    """A dropout seed drawn on ``device``: int64 [1] in [0, 2^62), from the
    device's generator. Inside a captured CUDA graph each replay draws a new
    one (torch's CUDA generator is graph-safe), and a compiled region draws
    it in its own code; the host never reads it."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _drop_seed(drop: tuple) -> int | Tensor:
    """The seed of a ``_dropout`` triple: its tensor where it has one."""
    return drop[2] if drop[2] is not None else drop[1]


def dropout_factors(drop: tuple, num_edges: int, heads: int, device: torch.device | str) -> Tensor | None:
    """:func:`dropout_keep` of a ``_dropout`` triple (None without dropout)."""
    return dropout_keep(_drop_seed(drop), drop[0], num_edges, heads, device) if drop[0] else None


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for x in [0, 2^32) (int64, no overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(seed: int | Tensor, p: float, num_edges: int, heads: int,
                 device: torch.device | str = "cpu") -> Tensor:
    """The attention-dropout factors [E, H] (fp32) the kernels apply for
    ``(seed, p)``: 0 where edge ``e`` (in the caller's edge order) is dropped
    in head ``h``, ``1 / (1 - p)`` where it is kept. The same counter-based
    hash as ``csrc/kernels/edge_bias.cuh``, so a test or the CPU path
    reproduces the kernels' mask exactly. ``seed``: an int (taken mod 2^63),
    or an int64 tensor of one element (its 64 bits as they are, read on the
    device: no host synchronisation)."""
    if isinstance(seed, Tensor):
        s64 = seed.reshape(()).to(device=device, dtype=torch.int64)
        lo, hi = s64 & _M32, (s64 >> 32) & _M32
    else:
        seed = int(seed) % 2**63
        lo, hi = seed & _M32, seed >> 32
    e = torch.arange(num_edges, dtype=torch.int64, device=device).unsqueeze(1)
    h = torch.arange(heads, dtype=torch.int64, device=device).unsqueeze(0)
    a = _mix32(lo ^ _mul32(h, 0x9E3779B9))
    hashed = _mix32((_mix32(a ^ e) + hi) & _M32)
    threshold = min(int(p * 2**32 + 0.5), _M32)
    return (hashed >= threshold).float() / (1.0 - p) if p > 0 else torch.ones(num_edges, heads, device=device)


def _check_edge_bias(edge_bias: Tensor | None, E: int, H: int, device: torch.device) -> None:
    if edge_bias is None:
        return
    if not isinstance(edge_bias, Tensor) or not edge_bias.is_floating_point():
        raise ValueError(f"edge_bias must be a floating-point tensor (got "
                         f"{getattr(edge_bias, 'dtype', type(edge_bias).__name__)})")
    if tuple(edge_bias.shape) != (E, H):
        raise ValueError(f"edge_bias must have shape [E, H] = [{E}, {H}] (got {tuple(edge_bias.shape)})")
    if edge_bias.device != device:
        raise ValueError(f"edge_bias is on {edge_bias.device} but q, k, v are on {device}")


def _fast_path(q, k, v, graph, scale, out_dtype, compute_dtype) -> Tensor | None:
    """The call on a plan prepared for q's heads and head dim, in eager mode,
    with fp16 / bf16 operands of a compiled head dim: straight to the kernel
    (the binding checks q, k, v against the graph arrays itself; q's rows
    against the plan's are checked here). None: take the
    general path, which checks and converts everything."""
    if (type(graph) is not GraphPlan or out_dtype is not None or compute_dtype is not None
            or not isinstance(q, Tensor) or q.dim() != 3 or q.dtype not in _KERNEL_DTYPES
            or torch.compiler.is_compiling()):
        return None
    N, H, D = q.shape
    fwd_args = graph._fwd_args.get((H, D))      # a compiled D is its own padded head dim
    if fwd_args is None or N != graph.num_rows or not kernel_available(q.device):
        return None
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    order = graph.order
    if order is not None:
        return _fast_path_reordered(q, k, v, graph, order, fwd_args, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        bwd_args = graph._bwd_args.get((H, D))
        if bwd_args is None:
            return None
        return _FusedAttention.apply(q, k, v, None, fwd_args, bwd_args, (), None, scale, q.dtype, None)[0]
    return _forward_op(q, k, v, fwd_args, scale)


def _fast_path_reordered(q, k, v, plan, order, fwd_args, scale) -> Tensor | None:
    """:func:`_fast_path` on a reordered plan: q, k, v gathered into the
    plan's node order, the output gathered back."""
    if k.shape != q.shape or v.shape != q.shape:
        return None           # the general path names the mismatch
    perm, inv = order.perm, order.inv
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        bwd_args = plan._bwd_args.get((q.size(1), q.size(2)))
        if bwd_args is None:
            return None
        q, k, v = (_permute_rows(t, perm, inv) for t in (q, k, v))
        out = _FusedAttention.apply(q, k, v, None, fwd_args, bwd_args, (), None, scale, q.dtype, None)[0]
        return _permute_rows(out, inv, perm)
    q, k, v = (gather_rows(t, perm) for t in (q, k, v))
    return gather_rows(_forward_op(q, k, v, fwd_args, scale), inv)


def _forward_op(q: Tensor, k: Tensor, v: Tensor, fwd_args: tuple, scale: float) -> Tensor:
    """The output of the forward op of the plan's format, in q's dtype."""
    return _op("fwd8" if _is_rows8(fwd_args) else "fwd")(q, k, v, *fwd_args, scale, False)[0]


_OPS: dict[str, object] = {}


def _op(name: str):
    """``torch.ops.gt_fused3s.<name>.default``, looked up once (the overload
    itself: calling it skips the packet's overload resolution)."""
    op = _OPS.get(name)
    if op is None:
        op = getattr(torch.ops.gt_fused3s, name).default
        if not torch.compiler.is_compiling():   # traced code may not mutate module state
            _OPS[name] = op
    return op


def kernel_available(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the fused kernel: a CUDA device
    where the extension builds and loads, unless ``GT_FUSED3S_DISABLE_KERNEL=1``
    (else they take the reference path, with a warning if the build failed)."""
    if device.type != "cuda" or os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1":
        return False
    return _extension_ready()


# A constant of the process once known. Traced by torch.compile it runs at
# trace time and its result is a constant of the graph: the first compiled
# call on a GPU may come before the extension is loaded, and its build and
# load (file locks, a compiler subprocess) are not code dynamo can trace; a
# break there would stay in the compiled code for every later call. (With
# the build cached on disk, a first compiled call at git 649067a showed no
# break and the same step time, 2.66 vs 2.70 ms on github, H100: this
# guards the first build, which tests/test_compile.py stands in for.)
@torch.compiler.assume_constant_result
def _extension_ready() -> bool:
    if _build.extension_available():
        return True
    warnings.warn("gt_fused3s: the CUDA extension is unavailable, CUDA tensors take the "
                  "reference path (see gt_fused3s._build.load_extension() for the reason)",
                  RuntimeWarning, stacklevel=4)
    return False


def _use_kernel(q: Tensor) -> bool:
    return q.is_cuda and kernel_available(q.device)


def kernel_accepts(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused CUDA kernel takes features of this head dim and dtype
    (the layers send what it does not take to their unfused path)."""
    return (head_dim % 8 == 0 and 0 < head_dim <= _SUPPORTED_HEAD_DIMS[-1]
            and dtype in _KERNEL_DTYPES + (torch.float32,))


def _check_plan_for(plan: GraphPlan, q: Tensor, k: Tensor) -> None:
    plan.bsb.check_nodes(k.size(0), "k" if k.size(0) != q.size(0) else "q")
    if q.size(0) != plan.num_rows:
        raise ValueError(f"q has {q.size(0)} rows but the plan's destinations are its first "
                         f"num_rows={plan.num_rows} nodes")
    device = q.device
    if plan.device != device:
        raise ValueError(f"graph is on {plan.device} but q, k, v are on {device}; "
                         f"move it once with graph.to(q.device)")


def _check_edges_for(edge_index: Tensor, N: int, num_nodes: int | None, device: torch.device) -> None:
    from .graph import _check_edge_index, _check_range
    _check_edge_index(edge_index)
    if num_nodes is not None and num_nodes != N:
        raise ValueError(f"q has {N} nodes but num_nodes={num_nodes}")
    if edge_index.device != device:
        raise ValueError(f"edge_index is on {edge_index.device} but q, k, v are on {device}")
    if not torch.compiler.is_compiling():   # a host sync; traced code relies on the index ops
        _check_range("edge_index", edge_index, 0, N)


def _check_kernel_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    D = q.size(-1)
    if D % 8 != 0 or D > _SUPPORTED_HEAD_DIMS[-1]:
        raise ValueError(f"the fused kernel needs a head dim that is a multiple of 8 and at most "
                         f"{_SUPPORTED_HEAD_DIMS[-1]} (got D={D})")
    dt = q.dtype
    if dt not in _KERNEL_DTYPES and dt != torch.float32:
        raise ValueError(f"q must be fp16, bf16 or fp32 for the fused kernel (got {dt})")
    if k.dtype != dt or v.dtype != dt:
        raise ValueError(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")


def _compute_dtype(q: Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    return q.dtype if q.dtype in _KERNEL_DTYPES else (compute_dtype or torch.float16)


def _kernel_operand(t: Tensor, cdt: torch.dtype, Dp: int) -> Tensor:
    """``t`` in dtype ``cdt`` with its head dim zero-padded to ``Dp``. Strides
    are the binding's business: it copies a tensor whose rows or heads are
    not 16-byte aligned, in C++, where that check is cheap."""
    if t.dtype != cdt:
        t = t.to(cdt)
    if t.size(-1) != Dp:
        t = torch.nn.functional.pad(t, (0, Dp - t.size(-1)))
    return t


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, fwd_args: tuple, scale: float,
                    out_dtype: torch.dtype, compute_dtype: torch.dtype | None,
                    bias: Tensor | None = None, slots: tuple = (),
                    dst: Tensor | None = None, drop: tuple = (0.0, 0, None)) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run the forward kernel on validated inputs: (out [N, H, D] in
    ``out_dtype``, lse [N, H] fp32, probabilities [E, H] fp32 or None).

    fp32 inputs are cast to ``compute_dtype`` (default fp16); head dims other
    than 16/32/64/128/256 are zero-padded up to the next one (the scale is the
    caller's, so padding changes nothing) and sliced back. ``bias``: None or
    the fp32 [E, H] edge bias; ``slots``: the plan's ``bias_args()`` (needed
    by a bias, by the probabilities and by dropout); ``dst``: the row of
    each edge (the plan's ``kernel_edge_index[1]``), given to return the
    probabilities: the kernel then writes each edge's q_i.k_j
    (``fwd_scores``) and P = exp(scale q_i.k_j + bias - lse_i) is one
    elementwise pass over [E, H] (``edge_probs``), where a score pass of
    its own (an op removed at git 7852ed9) took 17-20% more on the 200k
    graph; ``drop``: (p, seed, seed tensor or None) of :func:`_dropout`.
    """
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    if q.dtype != cdt or D != Dp:
        q, k, v = (_kernel_operand(t, cdt, Dp) for t in (q, k, v))
    edge = (bias, *slots[:3], *drop) if slots else ()   # the BSB's three slot arrays
    probs = None
    if _is_rows8(fwd_args):       # plain attention (the op refused edge terms)
        out, lse = _op("fwd8")(q, k, v, *fwd_args, scale, out_dtype != cdt)
    elif dst is None:
        out, lse = _op("fwd")(q, k, v, *fwd_args, scale, out_dtype != cdt, *edge)
    else:
        out, lse, scores = _op("fwd_scores")(q, k, v, *fwd_args, scale, out_dtype != cdt, *edge)
        probs = _op("edge_probs")(scores, bias, lse, dst if dst.dtype == torch.int64 else dst.long(), scale)
    if Dp != D:
        out = out[..., :D].contiguous()
    return (out if out.dtype == out_dtype else out.to(out_dtype)), lse, probs


def _kernel_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     fwd_args: tuple, bwd_args: tuple, scale: float,
                     compute_dtype: torch.dtype | None, edge: tuple = (),
                     in_dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """Gradients of :func:`_kernel_forward` with respect to q, k, v, in their
    dtype (fp32 inputs get fp32 gradients straight from the fp32 accumulators),
    and to the edge bias (fp32 [E, H]; empty without a bias). ``edge``: ()
    or the bwd op's per-edge arguments (edge_bias or None, the plan's six
    slot arrays, dp_bias or None, delta_extra or None, dropout p, seed and seed tensor).
    ``in_dtype``: the inputs' dtype where q, k, v are their casts to the
    compute dtype (saved so by the forward; default q's)."""
    dtype = in_dtype or q.dtype
    if _is_rows8(fwd_args):
        def run(grad_out, q, k, v, out, grad_fp32):
            return (*_op("bwd8")(grad_out, q, k, v, out, lse, *fwd_args, *bwd_args, scale, grad_fp32),
                    q.new_empty((0,), dtype=torch.float32))
    else:
        _, cols, bitmap, _, items, slots = fwd_args

        def run(grad_out, q, k, v, out, grad_fp32):
            return _op("bwd")(grad_out, q, k, v, out, lse, cols, bitmap, items, slots, *bwd_args, scale,
                              grad_fp32, *edge)
    if dtype in _KERNEL_DTYPES and grad_out.dtype == dtype and out.dtype == dtype and q.size(-1) in _KERNEL_DIMS:
        # the kernel's own operands: nothing to convert (the common case)
        return run(grad_out, q, k, v, out, False)
    cdt = _compute_dtype(q, compute_dtype)
    D = q.size(-1)
    Dp = padded_head_dim(D)
    grad_out, q, k, v = (_kernel_operand(t, cdt, Dp) for t in (grad_out, q, k, v))
    # O enters only delta = rowsum(dO * O): in the compute dtype or fp32
    out = _kernel_operand(out, out.dtype if out.dtype in (cdt, torch.float32) else torch.float32, Dp)
    *grads, grad_bias = run(grad_out, q, k, v, out, dtype not in _KERNEL_DTYPES)
    if Dp != D or grads[0].dtype != dtype:
        grads = [(g[..., :D] if Dp != D else g).to(dtype) for g in grads]
    return (*grads, grad_bias)


def _cast_once(q: Tensor, k: Tensor, v: Tensor, compute_dtype: torch.dtype | None
               ) -> tuple[Tensor, Tensor, Tensor, torch.dtype | None]:
    """fp32 inputs cast once to the compute dtype, for the forward and the
    saved operands of the backward (which recast them before: three more
    kernels, and twice the saved bytes): (q, k, v, the inputs' dtype), or
    the inputs and None where nothing is cast (padded head dims keep the old
    way: the kernels' wrappers pad and cast)."""
    in_dtype, cdt = q.dtype, _compute_dtype(q, compute_dtype)
    if in_dtype != cdt and q.size(-1) in _KERNEL_DIMS:
        return q.to(cdt), k.to(cdt), v.to(cdt), in_dtype
    return q, k, v, None


def weights_delta(lse: Tensor, dst: Tensor, probs: Tensor, grad_probs: Tensor) -> Tensor:
    """The share of delta = rowsum(dO * O) that a gradient of the returned
    weights adds, sum over each row's edges of P dP: [N, H] (``lse``'s shape)."""
    return torch.zeros_like(lse).index_add_(0, dst, probs * grad_probs)


def _grads_from_saved(ctx, grad_out, grad_probs) -> tuple:
    """(dq, dk, dv, d edge_bias), None where not needed, from what the
    forward saved. The gradient of returned probabilities P enters the
    kernel as an extra dP per edge (dp_bias) with its share of delta,
    sum_j P_ij dP_ij (delta_extra)."""
    if torch.is_grad_enabled():
        raise RuntimeError("gt_fused3s: double backward through fused3s_attention is not supported "
                           "(the fused backward kernels are not differentiable)")
    q, k, v, out, lse, bias, probs = ctx.saved_tensors
    if grad_out is None:     # only the weights were used
        grad_out = torch.zeros_like(out)
    edge = ()
    if ctx.slots:
        dp_bias = delta_extra = None
        if grad_probs is not None:
            dp_bias = grad_probs.float().contiguous()
            delta_extra = weights_delta(lse, ctx.dst, probs, dp_bias)
        edge = (bias if ctx.has_bias else None, *ctx.slots, dp_bias, delta_extra, *ctx.drop)
    grads = _kernel_backward(grad_out, q, k, v, out, lse, ctx.fwd_args, ctx.bwd_args, ctx.scale,
                             ctx.compute_dtype, edge, ctx.in_dtype)
    need = ctx.needs_input_grad
    return (grads[0] if need[0] else None, grads[1] if need[1] else None,
            grads[2] if need[2] else None, grads[3] if ctx.has_bias and need[3] else None)


def _save(ctx, q, k, v, bias, fwd_args, bwd_args, slots, dst, scale, compute_dtype, drop, out, lse,
          probs, in_dtype: torch.dtype | None = None) -> None:
    # The graph arrays are constants of the plan (never modified, no
    # gradient): kept as attributes, which is cheaper than saving them.
    ctx.has_bias = bias is not None
    ctx.in_dtype = in_dtype       # q, k, v saved as their casts to the compute dtype (else None)
    ctx.save_for_backward(q, k, v, out, lse, bias, probs)
    ctx.fwd_args, ctx.bwd_args, ctx.slots, ctx.dst = tuple(fwd_args), tuple(bwd_args), tuple(slots), dst
    ctx.scale, ctx.compute_dtype, ctx.drop = scale, compute_dtype, tuple(drop)


# The differentiable kernel path is registered twice over the same forward,
# saved state and backward: as a torch.library custom op with autograd (one
# opaque op for torch.compile, through the fake below) and as a plain
# autograd.Function, which eager mode takes because its host time is much
# lower (the custom op flattens its list inputs through pytrees on every call).
# Without a gradient, torch.compile calls the op with an empty bwd_graph.
# ``edge_bias`` (fp32) and ``dst`` (the destination of each edge, given to
# return the weights) need ``edge_slots``, the plan's bias_args().
@torch.library.custom_op("gt_fused3s::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, fwd_graph: list[Tensor], bwd_graph: list[Tensor],
                  scale: float, out_dtype: torch.dtype, compute_dtype: torch.dtype | None,
                  edge_bias: Tensor | None, edge_slots: list[Tensor],
                  dst: Tensor | None, dropout_p: float, dropout_seed: int,
                  dropout_seed_t: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    _build.load_extension()
    out, lse, probs = _kernel_forward(q, k, v, fwd_graph, scale, out_dtype, compute_dtype, edge_bias,
                                      tuple(edge_slots), dst, (dropout_p, dropout_seed, dropout_seed_t))
    return out, lse, probs if probs is not None else lse.new_empty((0, q.size(1)))


@_attention_op.register_fake
def _(q, k, v, fwd_graph, bwd_graph, scale, out_dtype, compute_dtype, edge_bias, edge_slots, dst,
      dropout_p, dropout_seed, dropout_seed_t):
    E = dst.size(0) if dst is not None else 0
    return (q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:2], dtype=torch.float32),
            q.new_empty((E, q.size(1)), dtype=torch.float32))


def _attention_setup_context(ctx, inputs, output):
    (q, k, v, fwd_graph, bwd_graph, scale, _out_dtype, compute_dtype, edge_bias, edge_slots, dst,
     dropout_p, dropout_seed, dropout_seed_t) = inputs
    ctx.mark_non_differentiable(output[1])
    _save(ctx, q, k, v, edge_bias, fwd_graph, bwd_graph, edge_slots, dst, scale, compute_dtype,
          (dropout_p, dropout_seed, dropout_seed_t), *output)


def _attention_backward(ctx, grad_out, _grad_lse, grad_probs):
    # one entry per input, a list of them for each list input (the graph arrays)
    dq, dk, dv, grad_bias = _grads_from_saved(ctx, grad_out, grad_probs if ctx.dst is not None else None)
    return (dq, dk, dv, [None] * len(ctx.fwd_args), [None] * len(ctx.bwd_args), None, None, None,
            grad_bias, [None] * len(ctx.slots), None, None, None, None)


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


class _FusedAttention(torch.autograd.Function):
    """Eager-mode twin of the ``gt_fused3s::attention`` custom op: returns
    (out, probabilities or None)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, fwd_args, bwd_args, slots, dst, scale, out_dtype, compute_dtype,
                drop=(0.0, 0, None)):
        q, k, v, in_dtype = _cast_once(q, k, v, compute_dtype)
        out, lse, probs = _kernel_forward(q, k, v, fwd_args, scale, out_dtype, compute_dtype, bias, slots,
                                          dst, drop)
        _save(ctx, q, k, v, bias, fwd_args, bwd_args, slots, dst, scale, compute_dtype, drop, out, lse, probs,
              in_dtype)
        ctx.set_materialize_grads(False)      # an unused output's gradient stays None
        return out, probs

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        return (*_grads_from_saved(ctx, grad_out, grad_probs), None, None, None, None, None, None, None, None)


# ---- the edge-feature products (edge_terms.py composes them) ----------------
# With ``a`` [E, F] the features of the edges ``e`` and ``idx`` [E] a node of
# each edge: edge_dot ``out[e, h] = <X[idx[e], h, :], a[e, :]>`` [E, H] and
# edge_scatter ``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]`` [N, H, F],
# each one's backward the other one (plus _edge_weighted_rows for the
# gradient of ``a``). fp16 / bf16 / fp32 operands on a CUDA device with the
# extension take one kernel each (fp32 arithmetic, nothing of size [E, H, F];
# the node sums read the edges grouped by node, ``csr`` = graph.node_csr,
# which a plan keeps: GraphPlan.destination_csr). Elsewhere (the CPU,
# float64) the PyTorch code below, which is also the kernels' reference: it
# runs over chunks of edges, so that the gathered [E, H, F] product is never
# held whole (nor saved for the backward, which recomputes it chunk by
# chunk): at most CHUNK_ELEMENTS elements at a time. Plain elementwise
# products and sums (an einsum here becomes a batched matmul of [H, F] x
# [F, 1] per edge, which measured 10x slower).

CHUNK_ELEMENTS = 1 << 24    # 64 MB of fp32 per temporary product
_EDGE_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _edge_kernel(*tensors: Tensor) -> bool:
    """Whether these operands take the edge-term kernels."""
    return all(t.dtype in _EDGE_KERNEL_DTYPES for t in tensors) and _use_kernel(tensors[0])


def _f32(t: Tensor) -> Tensor:
    return t.float().contiguous()


def _chunks(E: int, per_edge: int):
    step = max(1, CHUNK_ELEMENTS // max(per_edge, 1))
    for s in range(0, E, step):
        yield s, min(E, s + step)


def _edge_dot(X: Tensor, a: Tensor, idx: Tensor) -> Tensor:
    E, H = a.size(0), X.size(1)
    dtype = torch.promote_types(X.dtype, a.dtype)
    if _edge_kernel(X, a):
        return _op("edge_dot")(_f32(X), _f32(a), idx.long().contiguous()).to(dtype)
    out = a.new_empty((E, H), dtype=dtype)
    for s, e in _chunks(E, H * a.size(1)):
        out[s:e] = (X.index_select(0, idx[s:e]) * a[s:e].unsqueeze(1)).sum(-1)
    return out


def _edge_scatter(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int,
                  csr: tuple[Tensor, Tensor] | None) -> Tensor:
    H, F = w.size(1), a.size(1)
    if _edge_kernel(w, a):
        rowptr, order = csr if csr is not None else node_csr(idx, num_nodes)
        return _op("edge_scatter")(_f32(w), _f32(a), rowptr, order).to(
            torch.promote_types(w.dtype, a.dtype))
    out = a.new_zeros((num_nodes, H, F), dtype=torch.promote_types(w.dtype, a.dtype))
    for s, e in _chunks(a.size(0), H * F):
        out.index_add_(0, idx[s:e], w[s:e].unsqueeze(-1) * a[s:e].unsqueeze(1))
    return out


def _edge_weighted_rows(w: Tensor, X: Tensor, idx: Tensor, w2: Tensor | None = None,
                        X2: Tensor | None = None) -> Tensor:
    """[E, F]: ``sum_h w[e, h] X[idx[e], h, :]`` (the gradient with respect to
    ``a``), plus the same sum over ``(w2, X2)`` if given (one pass, no
    [E, 2H] concatenation)."""
    E, H, F = w.size(0), X.size(1), X.size(2)
    if _edge_kernel(w, X):
        second = (_f32(w2), _f32(X2)) if w2 is not None else ()
        return _op("edge_rows")(_f32(w), _f32(X), idx.long().contiguous(), *second).to(
            torch.promote_types(w.dtype, X.dtype))
    out = w.new_empty((E, F), dtype=torch.promote_types(w.dtype, X.dtype))
    for s, e in _chunks(E, H * F):
        out[s:e] = (w[s:e].unsqueeze(-1) * X.index_select(0, idx[s:e])).sum(1)
        if w2 is not None:
            out[s:e] += (w2[s:e].unsqueeze(-1) * X2.index_select(0, idx[s:e])).sum(1)
    return out


def _csr_of(ctx) -> tuple[Tensor, Tensor] | None:
    return (ctx.rowptr, ctx.order) if ctx.rowptr is not None else None


def _edge_dot_grads(ctx, grad):
    X, a, idx = ctx.saved_tensors
    dX = (_edge_scatter(grad, a, idx, X.size(0), _csr_of(ctx)).to(X.dtype)
          if ctx.needs_input_grad[0] else None)
    da = _edge_weighted_rows(grad, X, idx).to(a.dtype) if ctx.needs_input_grad[1] else None
    return dX, da


def _edge_scatter_grads(ctx, grad):
    w, a, idx = ctx.saved_tensors
    dw = _edge_dot(grad, a, idx).to(w.dtype) if ctx.needs_input_grad[0] else None
    da = _edge_weighted_rows(w, grad, idx).to(a.dtype) if ctx.needs_input_grad[1] else None
    return dw, da


def _save_edge_ctx(ctx, saved, rowptr, order):
    ctx.save_for_backward(*saved)
    ctx.rowptr, ctx.order = rowptr, order       # graph structure: no gradient, not mutated


class _EdgeDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, a, idx, rowptr, order):
        _save_edge_ctx(ctx, (X, a, idx), rowptr, order)
        return _edge_dot(X, a, idx)

    @staticmethod
    def backward(ctx, grad):
        return *_edge_dot_grads(ctx, grad), None, None, None


class _EdgeScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, a, idx, num_nodes, rowptr, order):
        _save_edge_ctx(ctx, (w, a, idx), rowptr, order)
        return _edge_scatter(w, a, idx, num_nodes, _csr_of(ctx))

    @staticmethod
    def backward(ctx, grad):
        return *_edge_scatter_grads(ctx, grad), None, None, None, None


# What torch.compile traces: the same products as opaque custom ops with the
# same backward. Dynamo's own trace of the autograd.Functions above got every
# gradient through them wrong on CUDA: it traced their backward with zeros
# for the incoming gradient (the edge-dim layer's gradients of x, the edge
# features and the query, key and edge weights all wrong under torch.compile,
# default and reduce-overhead modes, and under aot_eager: measured on an H100,
# torch 2.11; the CPU stand-in kernels did not show it). Eager mode keeps the
# autograd.Functions, whose host time per call is lower.
@torch.library.custom_op("gt_fused3s::edge_dot_term", mutates_args=())
def _edge_dot_term(X: Tensor, a: Tensor, idx: Tensor, rowptr: Tensor | None,
                   order: Tensor | None) -> Tensor:
    return _edge_dot(X, a, idx)


@_edge_dot_term.register_fake
def _(X, a, idx, rowptr, order):
    return a.new_empty((a.size(0), X.size(1)), dtype=torch.promote_types(X.dtype, a.dtype))


@torch.library.custom_op("gt_fused3s::edge_scatter_term", mutates_args=())
def _edge_scatter_term(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int, rowptr: Tensor | None,
                       order: Tensor | None) -> Tensor:
    return _edge_scatter(w, a, idx, num_nodes, (rowptr, order) if rowptr is not None else None)


@_edge_scatter_term.register_fake
def _(w, a, idx, num_nodes, rowptr, order):
    return a.new_empty((num_nodes, w.size(1), a.size(1)), dtype=torch.promote_types(w.dtype, a.dtype))


_edge_dot_term.register_autograd(
    lambda ctx, grad: (*_edge_dot_grads(ctx, grad), None, None, None),
    setup_context=lambda ctx, inputs, output: _save_edge_ctx(ctx, inputs[:3], *inputs[3:]))
_edge_scatter_term.register_autograd(
    lambda ctx, grad: (*_edge_scatter_grads(ctx, grad), None, None, None, None),
    setup_context=lambda ctx, inputs, output: _save_edge_ctx(ctx, inputs[:3], *inputs[4:]))


def edge_dot(X: Tensor, a: Tensor, idx: Tensor, csr: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``out[e, h] = <X[idx[e], h, :], a[e, :]>``: X [N, H, F], a [E, F],
    idx [E] (int64) -> [E, H]. Differentiable in X and a; ``csr``: the edges
    grouped by ``idx`` (:func:`~gt_fused3s.graph.node_csr`) for the backward's
    sum, built there if not given."""
    rowptr, order = csr if csr is not None else (None, None)
    if torch.compiler.is_compiling():
        return _edge_dot_term(X, a, idx, rowptr, order)
    return _EdgeDot.apply(X, a, idx, rowptr, order)


def edge_scatter(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int,
                 csr: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]``: w [E, H],
    a [E, F], idx [E] (int64) -> [num_nodes, H, F]. Differentiable in w and
    a; ``csr`` as for :func:`edge_dot`."""
    rowptr, order = csr if csr is not None else (None, None)
    if torch.compiler.is_compiling():
        return _edge_scatter_term(w, a, idx, num_nodes, rowptr, order)
    return _EdgeScatter.apply(w, a, idx, num_nodes, rowptr, order)


# ---- the edge-feature attention as one node (edge_terms.py) ----------------
# TransformerConv's edge features on the kernels: the key term as an edge
# bias (edge_dot of qe = the queries projected by W_e, scaled), the value sum
# agg = edge_scatter of the weights (after dropout), and one backward that
# folds what the composed ops recomputed (edge_terms.py: _EdgeFeatureTerms).
# Registered twice over the same forward and backward, as the attention is:
# an autograd.Function for eager mode (edge_terms.py) and the custom op
# below for torch.compile, which traced the composed ops (three opaque ops
# and their own backwards) before.

def edge_terms_forward(q: Tensor, k: Tensor, v: Tensor, qe: Tensor, a: Tensor, fwd_args: tuple, slots: tuple,
                       dst: Tensor, csr: tuple[Tensor, Tensor], scale: float, drop: tuple,
                       keep: Tensor | None = None) -> tuple:
    """(q, k, v as the kernels read them, the inputs' dtype or None, out,
    lse, bias, alpha, keep or None, agg): the forward of the one node.
    ``keep``: the dropout factors of ``drop`` where the caller has them
    (a compiled region computes them in its own fused code), else computed
    here."""
    q, k, v, in_dtype = _cast_once(q, k, v, None)
    bias = _edge_dot(qe, a, dst).float()
    out, lse, alpha = _kernel_forward(q, k, v, fwd_args, scale, in_dtype or q.dtype, None, bias, slots, dst,
                                      drop)
    # the kernel's dropout factors (same seed, same hash): 0 or 1 / (1 - p)
    if keep is None:
        keep = dropout_factors(drop, *alpha.shape, alpha.device)
    agg = _edge_scatter(alpha if keep is None else alpha * keep, a, dst, q.size(0), csr)
    return q, k, v, in_dtype, out, lse, bias, alpha, keep, agg


def edge_terms_backward(saved: tuple, graph: tuple, grad_out: Tensor | None, grad_agg: Tensor | None,
                        grad_alpha: Tensor | None, need: tuple) -> tuple:
    """(dq, dk, dv, dqe, da) of the one node, None where not ``need``ed.
    ``saved``: (q, k, v as the kernels read them, qe, a, out, lse, bias,
    alpha, keep, agg); ``graph``: (fwd_args, bwd_args, slots, dst, csr,
    scale, drop, in_dtype). The value sum's share of delta = rowsum(dO * O)
    is <dagg_i, agg_i> per node (no scatter of P dP over the edges), and the
    gradient of ``a`` is one pass over the edges for both terms (dS against
    qe and the weights against dagg)."""
    if torch.is_grad_enabled():
        raise RuntimeError("gt_fused3s: double backward through the edge-feature attention is not "
                           "supported (the fused backward kernels are not differentiable)")
    q, k, v, qe, a, out, lse, bias, alpha, keep, agg = saved
    fwd_args, bwd_args, slots, dst, csr, scale, drop, in_dtype = graph
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    # dP of each edge beyond dO.v: the value sum's <dagg_i, a_e> (times the
    # dropout factor: it weighs the weights after dropout) and the weights'
    # own gradient
    dp_bias = delta_extra = None
    if grad_agg is not None:
        dp_bias = _edge_dot(grad_agg, a, dst).float()
        if keep is not None:
            dp_bias = dp_bias * keep
        delta_extra = (grad_agg.float() * agg.float()).sum(-1)
    if grad_alpha is not None:
        grad_alpha = grad_alpha.float()
        dp_bias = grad_alpha if dp_bias is None else dp_bias + grad_alpha
        extra = weights_delta(lse, dst, alpha, grad_alpha)
        delta_extra = extra if delta_extra is None else delta_extra + extra
    edge = (bias, *slots, dp_bias, delta_extra, *drop)
    dq, dk, dv, ds = _kernel_backward(grad_out, q, k, v, out, lse, fwd_args, bwd_args, scale, None, edge,
                                      in_dtype)
    # per-edge temporaries [E, H] go as soon as they are used (peak memory, README)
    del edge, dp_bias
    dqe = _edge_scatter(ds, a, dst, qe.size(0), csr).to(qe.dtype) if need[3] else None
    da = None
    if need[4]:
        if grad_agg is None:
            da = _edge_weighted_rows(ds, qe, dst)
        else:       # both terms in one pass over the edges
            da = _edge_weighted_rows(ds, qe, dst, alpha if keep is None else alpha * keep, grad_agg)
        da = da.to(a.dtype)
    return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, dqe, da


@torch.library.custom_op("gt_fused3s::edge_feature_terms", mutates_args=())
def _edge_terms_op(q: Tensor, k: Tensor, v: Tensor, qe: Tensor, a: Tensor, fwd_graph: list[Tensor],
                   bwd_graph: list[Tensor], edge_slots: list[Tensor], dst: Tensor, rowptr: Tensor,
                   order: Tensor, scale: float, dropout_p: float, dropout_seed: int,
                   dropout_seed_t: Tensor | None, keep: Tensor | None,
                   weights_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, agg, alpha, lse, bias) of :func:`edge_terms_forward`; alpha's
    gradient is used where ``weights_grad`` (the weights are returned).
    ``keep``: the dropout factors [E, H] (:func:`dropout_factors`), given
    by the compiled region, which fuses their hash into one kernel (inside
    this op it is about forty elementwise kernels over [E, H], in the
    forward and again in the backward); None: computed here."""
    _build.load_extension()
    out, lse, bias, alpha, _, agg = edge_terms_forward(q, k, v, qe, a, tuple(fwd_graph), tuple(edge_slots), dst,
                                                       (rowptr, order), scale,
                                                       (dropout_p, dropout_seed, dropout_seed_t), keep)[4:]
    return out, agg, alpha, lse, bias


@_edge_terms_op.register_fake
def _(q, k, v, qe, a, fwd_graph, bwd_graph, edge_slots, dst, rowptr, order, scale, dropout_p, dropout_seed,
      dropout_seed_t, keep, weights_grad):
    N, H, E = q.size(0), q.size(1), a.size(0)
    f32 = torch.float32
    return (q.new_empty(q.shape), q.new_empty((N, H, a.size(1)), dtype=f32), q.new_empty((E, H), dtype=f32),
            q.new_empty((N, H), dtype=f32), q.new_empty((E, H), dtype=f32))


def _edge_terms_setup_context(ctx, inputs, output):
    (q, k, v, qe, a, fwd_graph, bwd_graph, edge_slots, dst, rowptr, order, scale, dropout_p, dropout_seed,
     dropout_seed_t, keep, weights_grad) = inputs
    out, agg, alpha, lse, bias = output
    ctx.mark_non_differentiable(lse, bias)
    # q, k, v saved as given (the backward casts fp32 ones again: a custom
    # op's outputs cannot alias its inputs, which an uncast q would)
    ctx.save_for_backward(q, k, v, qe, a, out, lse, bias, alpha, agg, keep)
    ctx.graph = (tuple(fwd_graph), tuple(bwd_graph), tuple(edge_slots), dst, (rowptr, order), scale,
                 (dropout_p, dropout_seed, dropout_seed_t))
    ctx.weights_grad = weights_grad


def _edge_terms_op_backward(ctx, grad_out, grad_agg, grad_alpha, _grad_lse, _grad_bias):
    q, k, v, qe, a, out, lse, bias, alpha, agg, keep = ctx.saved_tensors
    q, k, v, in_dtype = _cast_once(q, k, v, None)
    fwd_args, bwd_args, slots, dst, csr, scale, drop = ctx.graph
    if keep is None:
        keep = dropout_factors(drop, *alpha.shape, alpha.device)
    grads = edge_terms_backward((q, k, v, qe, a, out, lse, bias, alpha, keep, agg),
                                (fwd_args, bwd_args, slots, dst, csr, scale, drop, in_dtype),
                                grad_out, grad_agg, grad_alpha if ctx.weights_grad else None,
                                ctx.needs_input_grad[:5])
    # (dst, rowptr, order, scale, dropout_p, dropout_seed, dropout_seed_t, keep, weights_grad)
    return (*grads, [None] * len(fwd_args), [None] * len(bwd_args), [None] * len(slots), *[None] * 9)


_edge_terms_op.register_autograd(_edge_terms_op_backward, setup_context=_edge_terms_setup_context)


def _eager_node_fits(q: Tensor, k: Tensor, v: Tensor, head_dims, dtypes=_KERNEL_DTYPES) -> bool:
    """Whether q, k, v can go to a C++ op with its autograd in C++ as they
    are: eagerly, on CUDA, of one dtype in ``dtypes`` (default fp16 / bf16:
    no cast), a head dim in ``head_dims`` (no padding)."""
    return (not torch.compiler.is_compiling() and q.is_cuda and q.dtype in dtypes
            and k.dtype == q.dtype and v.dtype == q.dtype and q.size(-1) in head_dims)


def edge_feature_eager_fits(q: Tensor, k: Tensor, v: Tensor, w_e: Tensor, a: Tensor, drop: tuple) -> bool:
    """Whether the eager edge-feature attention on a plan takes
    ``edge_feature_eager`` (projections, kernels and their backward in one
    C++ op and autograd node): on CUDA, without dropout, q, k, v of one
    dtype, fp16 / bf16 or fp32 (cast to fp16 once in the op, as
    :func:`_cast_once`), a compiled head dim (no padding), W_e and a of the
    edge kernels' dtypes, edge_dim at most 768 (the projections' shared
    chunk of W_e: csrc/kernels/head_project.cu). Else the Python
    composition around the autograd.Function ``edge_terms._EdgeFeatureTerms``
    (the same kernels; the projections as block-diagonal GEMMs)."""
    return (not drop[0] and _eager_node_fits(q, k, v, _KERNEL_DIMS, _EDGE_KERNEL_DTYPES)
            and w_e.dtype in _EDGE_KERNEL_DTYPES and a.dtype in _EDGE_KERNEL_DTYPES
            and w_e.size(2) <= 768)


def edge_feature_eager(q: Tensor, k: Tensor, v: Tensor, w_e: Tensor, a: Tensor, plan: GraphPlan, dst: Tensor,
                       csr: tuple[Tensor, Tensor], slots: tuple, scale: float) -> tuple[Tensor, Tensor]:
    """(out, alpha) of :func:`~gt_fused3s.edge_terms.edge_feature_attention`
    as one C++ op and autograd node (where :func:`edge_feature_eager_fits`);
    ``a``, ``dst``, ``csr`` and ``slots`` in one edge order (alpha comes in
    it). The backward's graph arrays (the transposed format) are built here
    where a gradient may be asked for."""
    H, D = q.size(1), q.size(2)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w_e, a))
    bwd = list(plan.backward_args(H, D)) if grad else []
    return _op("edge_feature_eager")(q, k, v, w_e, a, list(plan.forward_args(H, D)), bwd, list(slots),
                                     dst if dst.dtype == torch.int64 else dst.long(), *csr, scale)


# ---------------------------------------------------------------------------
# Sequence attention's kernels (csrc/kernels/seq_*): the row-block contract
# they share with their callers, and their autograd, registered twice as the
# graph attention's is: an autograd.Function for eager mode (lower host time)
# and a custom op with its own autograd for torch.compile, which traces it as
# one opaque op (no trace of the kernels' backward by dynamo: see
# edge_dot_term above for what that once did to the edge products).

SEQ_HEAD_DIMS = (32, 64, 128)   # the head dims the sequence kernels are compiled for


def seq_head_dim(D: int) -> int:
    """The compiled head dim a sequence head dim D <= 128 is zero-padded to."""
    return 32 if D <= 32 else (64 if D <= 64 else 128)   # SEQ_HEAD_DIMS, without a generator per call


def seq_block_rows(head_dim: int, backward: bool = False) -> int:
    """Queries per thread block of the sequence kernels for the compiled head
    dim (seq_params.h: seq_block_rows, seq_bwd_block_rows): the backward by
    query blocks takes larger ones for D <= 64 (half the atomics on dK and
    dV); the backward by key blocks (Hopper) takes the forward's."""
    if backward:
        return 128 if head_dim <= 64 else 64
    return 64


def seq_windows(cu: Tensor, stride: int, rows: int) -> Tensor:
    """cu_windows: the first row block (of ``rows`` queries) of each document
    of ``cu`` (int32 token offsets), for mask row stride ``stride``
    (seq_params.h: SeqFwdParams)."""
    lens = (cu[1:] - cu[:-1]).long()
    per = stride * ((lens + stride - 1) // stride + rows - 1).div(rows, rounding_mode="floor")
    return torch.cat([per.new_zeros(1), per.cumsum(0)]).to(torch.int32)


def _seq_operands(q: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in the kernels' dtype (q's if fp16 / bf16, else fp16) with
    the head dim zero-padded to a compiled one (32, 64, 128)."""
    cdt = q.dtype if q.dtype in _KERNEL_DTYPES else torch.float16
    D = q.size(-1)
    Dp = seq_head_dim(D)
    if cdt == q.dtype and Dp == D and all(t.dtype == cdt and t.size(-1) == D for t in tensors):
        return tensors   # the common case: nothing to cast or pad
    return tuple(_kernel_operand(t, cdt, Dp) for t in tensors)


def _seq_forward(q, k, v, cu, cu_windows, code, scale, num_windows) -> tuple[Tensor, Tensor]:
    """(out in q's dtype and head dim, the kernel's log-sum-exp [T, H] fp32)."""
    qk, kk, vk = _seq_operands(q, q, k, v)
    out, lse = _op("seq_fwd")(qk, kk, vk, cu, cu_windows, code, scale, num_windows,
                              seq_block_rows(qk.size(-1)))
    if out.size(-1) != q.size(-1):
        out = out[..., :q.size(-1)]
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


def _seq_backward(grad_out, q, k, v, out, lse, cu, cu_windows, bwd_windows, code, scale, num_windows,
                  need) -> tuple:
    D = q.size(-1)
    gk, qk, kk, vk, ok = _seq_operands(q, grad_out, q, k, v, out)
    grads = _op("seq_bwd")(gk, qk, kk, vk, ok, lse, cu, cu_windows, bwd_windows, code, scale, num_windows)
    return tuple(_seq_grad(g, t, D) if n else None for g, t, n in zip(grads, (q, k, v), need))


def _seq_grad(g: Tensor, t: Tensor, D: int) -> Tensor:
    """A kernel gradient back in t's dtype and head dim (no op where it is)."""
    if g.size(-1) != D:
        g = g[..., :D]
    return g if g.dtype == t.dtype else g.to(t.dtype)


class _SeqAttention(torch.autograd.Function):
    """Eager-mode twin of ``gt_fused3s::seq_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, cu, cu_windows, code, scale, num_windows, bwd_windows):
        out, lse = _seq_forward(q, k, v, cu, cu_windows, code, scale, num_windows)
        ctx.save_for_backward(q, k, v, out, lse, cu, cu_windows, bwd_windows)
        ctx.code, ctx.scale, ctx.num_windows = code, scale, num_windows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = _seq_backward(grad_out, *ctx.saved_tensors, ctx.code, ctx.scale, ctx.num_windows,
                              ctx.needs_input_grad[:3])
        return grads + (None,) * 6


@torch.library.custom_op("gt_fused3s::seq_attention", mutates_args=())
def _seq_attention_op(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, cu_windows: Tensor, code: list[int],
                      scale: float, num_windows: int, bwd_windows: Tensor | None) -> tuple[Tensor, Tensor]:
    _build.load_extension()
    return _seq_forward(q, k, v, cu, cu_windows, code, scale, num_windows)


@_seq_attention_op.register_fake
def _(q, k, v, cu, cu_windows, code, scale, num_windows, bwd_windows):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def _seq_setup_context(ctx, inputs, output):
    q, k, v, cu, cu_windows, code, scale, num_windows, bwd_windows = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, output[0], output[1], cu, cu_windows, bwd_windows)
    ctx.code, ctx.scale, ctx.num_windows = code, scale, num_windows


def _seq_attention_backward(ctx, grad_out, _grad_lse):
    grads = _seq_backward(grad_out, *ctx.saved_tensors, ctx.code, ctx.scale, ctx.num_windows,
                          ctx.needs_input_grad[:3])
    return grads + (None,) * 6


_seq_attention_op.register_autograd(_seq_attention_backward, setup_context=_seq_setup_context)


def seq_eager_fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a sequence call takes ``seq_attention_eager`` (one C++ op and
    autograd node: the kernel, with [B, L, H, D] operands and global rows
    also the dense-rows kernels for those rows, at most ``DENSE_ROWS_MAX``,
    written over the kernel's, and both backwards): eagerly, on CUDA, fp16 /
    bf16 operands of one dtype, a compiled head dim (no cast, no padding)."""
    return _eager_node_fits(q, k, v, SEQ_HEAD_DIMS)


def seq_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, cu_windows: Tensor, code: list[int],
                  scale: float, num_windows: int, bwd_windows: Tensor | None = None) -> Tensor:
    """The sequence kernels on q, k, v [..., H, D], the leading dims being the
    T tokens (``gt_fused3s.sequence`` prepares the arguments: documents
    ``cu``, row blocks ``cu_windows`` of :func:`seq_block_rows` queries, the
    mask's ``kernel_code``, scale >= 0; ``bwd_windows``: the backward's
    cu_windows, if the caller has them made, else the backward makes them):
    the output in q's shape, differentiable in q, k and v.

    Eagerly on CUDA, where no cast or padding is needed, one C++ op with a C++
    autograd node (``seq_attention_eager``: no Python in the backward, no
    view nodes); else an autograd.Function, or under torch.compile the
    custom op ``gt_fused3s::seq_attention``."""
    if torch.compiler.is_compiling():
        shape, H = q.shape, q.size(-2)
        q, k, v = (t.reshape(-1, H, t.size(-1)) for t in (q, k, v))
        return _seq_attention_op(q, k, v, cu, cu_windows, code, scale, num_windows, bwd_windows)[0].reshape(shape)
    if seq_eager_fits(q, k, v):
        return _op("seq_attention_eager")(q, k, v, cu, cu_windows, bwd_windows, code, scale, num_windows)
    shape, H = q.shape, q.size(-2)
    q, k, v = (t.reshape(-1, H, t.size(-1)) for t in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _SeqAttention.apply(q, k, v, cu, cu_windows, code, scale, num_windows, bwd_windows)
    else:   # no autograd node to make (an autograd.Function's apply was ~10 us of host time)
        out = _seq_forward(q, k, v, cu, cu_windows, code, scale, num_windows)[0]
    return out.reshape(shape)


# ---------------------------------------------------------------------------
# Dense rows of sequence attention (the global rows of a mask: a few queries
# against every key), registered as the sequence kernels are: an
# autograd.Function for eager mode, a custom op with its own autograd for
# torch.compile.

DENSE_ROWS_MAX = 32   # queries the kernels take (dense_rows.h)


def dense_rows_fit(qg: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the dense-rows kernels take these operands."""
    return (kernel_available(qg.device) and qg.dtype in _KERNEL_DTYPES and k.dtype == v.dtype == qg.dtype
            and qg.size(-1) in (32, 64, 128) and 1 <= qg.size(1) <= DENSE_ROWS_MAX)


class _DenseRows(torch.autograd.Function):
    """Eager-mode twin of ``gt_fused3s::dense_rows``."""

    @staticmethod
    def forward(ctx, qg, k, v, scale):
        _build.load_extension()   # callers may reach the rows before any other op
        og, lse = _op("dense_rows_fwd")(qg.contiguous(), k, v, scale)
        ctx.save_for_backward(qg, k, v, og, lse)
        ctx.scale = scale
        return og.to(qg.dtype)

    @staticmethod
    def backward(ctx, dog):
        qg, k, v, og, lse = ctx.saved_tensors
        dqg, dk, dv = _op("dense_rows_bwd")(dog, qg.contiguous(), k, v, og, lse, ctx.scale)
        return dqg, dk, dv, None


@torch.library.custom_op("gt_fused3s::dense_rows", mutates_args=())
def _dense_rows_op(qg: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    _build.load_extension()
    og, lse = _op("dense_rows_fwd")(qg.contiguous(), k, v, scale)
    return og.to(qg.dtype), og, lse


@_dense_rows_op.register_fake
def _(qg, k, v, scale):
    B, G, H, _ = qg.shape
    return (qg.new_empty(qg.shape), qg.new_empty(qg.shape, dtype=torch.float32),
            qg.new_empty((B, H, G), dtype=torch.float32))


def _dense_rows_setup_context(ctx, inputs, output):
    qg, k, v, scale = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(qg, k, v, output[1], output[2])
    ctx.scale = scale


def _dense_rows_backward(ctx, dog, _dog32, _dlse):
    qg, k, v, og, lse = ctx.saved_tensors
    dqg, dk, dv = _op("dense_rows_bwd")(dog, qg.contiguous(), k, v, og, lse, ctx.scale)
    return dqg, dk, dv, None


_dense_rows_op.register_autograd(_dense_rows_backward, setup_context=_dense_rows_setup_context)


def dense_rows(qg: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Softmax attention of the rows qg [B, G, H, D] (G <= 32) over all of
    k, v [B, L, H, D] (fp16 / bf16, D in 32, 64, 128: :func:`dense_rows_fit`),
    [B, G, H, D] in qg's dtype; differentiable in qg, k and v. The keys are
    split over thread blocks (csrc/kernels/dense_rows.cu)."""
    if torch.compiler.is_compiling():
        return _dense_rows_op(qg, k, v, scale)[0]
    if torch.is_grad_enabled() and (qg.requires_grad or k.requires_grad or v.requires_grad):
        return _DenseRows.apply(qg, k, v, scale)
    _build.load_extension()
    return _op("dense_rows_fwd")(qg.contiguous(), k, v, scale)[0].to(qg.dtype)   # no autograd node to make
