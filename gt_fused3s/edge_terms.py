"""Two products between node tensors and per-edge features, adjoint to each
other, in bounded memory: what TransformerConv's edge features add to the
fused attention (``nn/pyg.py``).

With ``a`` [E, F] the features of the edges ``e`` and ``idx`` [E] a node of
each edge (its destination ``i``):

* :func:`edge_dot`      ``out[e, h] = <X[idx[e], h, :], a[e, :]>``       [E, H]
* :func:`edge_scatter`  ``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]``  [N, H, F]

Each one's backward is the other one. Both are ops of ``ops.py`` (with
every other op, its fake kernel and its autograd): one kernel each on a
CUDA device (``csrc/kernels/edge_terms.cu``, fp32 arithmetic, nothing of
size [E, H, F]), chunked PyTorch elsewhere. This module composes them with
the fused attention (:func:`edge_feature_attention`) and projects the heads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .ops import edge_dot, edge_scatter, fused3s_attention
from .plan import GraphPlan

__all__ = ["edge_dot", "edge_scatter", "block_diagonal", "project_heads", "head_project",
           "edge_feature_attention"]


def block_diagonal(w: Tensor) -> Tensor:
    """[H A, H B]: the heads' ``w`` [H, A, B] on the diagonal, zeros elsewhere
    (differentiable in ``w``); its transpose is the block-diagonal matrix of
    the heads' ``w[h].T``."""
    # one aten op each way (its backward slices the gradient), where zeros
    # plus a copy into the diagonal took six small kernels per step
    return torch.block_diag(*w.unbind(0))


def project_heads(x: Tensor, blocks: Tensor) -> Tensor:
    """``out[n, h, :] = x[n, h, :] @ W_h`` for ``blocks`` the block-diagonal
    [H A, H B] matrix of the W_h (:func:`block_diagonal`): x [N, H, A] ->
    [N, H, B], one GEMM."""
    H = x.size(1)
    if not torch.is_autocast_enabled(x.device.type):      # else autocast picks the dtype
        dtype = torch.promote_types(x.dtype, blocks.dtype)
        x, blocks = x.to(dtype), blocks.to(dtype)
    return torch.matmul(x.reshape(x.size(0), -1), blocks).view(x.size(0), H, -1)


def head_project(x: Tensor, w: Tensor, scale: float = 1.0) -> Tensor:
    """``out[n, h, :] = scale x[n, h, :] @ w[h]``: x [N, H, A], w [H, A, B].

    One GEMM with the block-diagonal [H A, H B] matrix of the heads' ``w``
    (H times the flops of a GEMM per head, which are few here: A, B are a
    head dim and ``edge_dim``). Per-head GEMMs (einsum's batched GEMM) cost
    more: copies of x and of the output to and from head-major order, and a
    weight gradient (``sum_n x[n, h]^T g[n, h]``) that cuBLAS walked in a
    handful of thread blocks over all N rows, 0.73 ms at 24k nodes and
    6.5 ms at 200k on an H100 (H = 4, A = B = 16); the block-diagonal
    one's weight gradient is one [H A, H B] GEMM that cuBLAS splits over N."""
    return project_heads(x, block_diagonal(w * scale if scale != 1.0 else w))


def edge_feature_attention(q: Tensor, k: Tensor, v: Tensor, graph, edge_attr: Tensor, w_e: Tensor,
                           scale: float, *, dropout_p: float = 0.0, dropout_seed: int | Tensor | None = None,
                           return_weights: bool = True) -> tuple[Tensor, Tensor | None]:
    """TransformerConv's attention with edge features, without an [E, H, C]
    tensor: ``e_ij = W_e a_ij`` is added to the key and to the value,

        s_ij = scale <q_i, k_j + e_ij> = scale <q_i, k_j> + scale <W_e^T q_i, a_ij>
        o_i  = sum_j alpha_ij (v_j + e_ij) = sum_j alpha_ij v_j + W_e sum_j alpha_ij a_ij

    so the key term is an edge bias (:func:`edge_dot` of ``W_e^T q`` [N, H, F])
    and the value term one node sum of the weights times ``a`` (:func:`edge_scatter`).
    q [N, H, C] (destinations), k, v [N, H, C], ``graph`` a
    :class:`~gt_fused3s.plan.GraphPlan` or an ``edge_index`` tensor (reference
    path), ``edge_attr`` [E, F] in the order of the graph's edges, ``w_e``
    [H, C, F] (``lin_edge.weight`` viewed per head). Dropout acts on the
    weights of both terms with one mask. Returns ``(out [N, H, C], alpha [E, H])``
    (the softmax weights, before dropout, differentiable); alpha is None
    with ``return_weights=False`` (the weights are computed all the same:
    the value term sums them)."""
    plan = graph if isinstance(graph, GraphPlan) else None
    edges = plan.edge_index if plan is not None else graph
    # one seed for both terms (drawn here if not given)
    drop = ops._dropout(dropout_p, dropout_seed, q.device)
    dst = edges[1].long()
    csr = plan.destination_csr() if plan is not None and ops._edge_kernel(q) else None
    node = csr is not None and plan.order is None      # the kernels: the three terms as one node
    if node:
        ops._check_plan_for(plan, q, k)
        ops._check_kernel_inputs(q, k, v)
    if node and ops.edge_feature_eager_fits(q, k, v, w_e, edge_attr, drop):
        # eager, the common case: the projections, the kernels and their
        # backward as one C++ op and autograd node (no Python in between)
        grouping, a, dst, csr, slots = _grouped(plan, edge_attr, dst, csr, drop)
        out, alpha = ops.edge_feature_eager(q, k, v, w_e, a, plan, dst, csr, slots, scale)
        if return_weights and grouping is not None:
            alpha = ops._permute_rows(alpha, grouping.inv, grouping.perm)
        return out, (alpha if return_weights else None)
    # one block-diagonal W_e for both terms (its transpose is W_e^T's): the
    # key term projects the queries by W_e (scaled), the value term the
    # weighted feature sums by W_e^T
    blocks = block_diagonal(w_e)
    qe = project_heads(q, blocks * scale)
    if node and torch.compiler.is_compiling():
        # compiled: the node as one opaque op with its own backward; the
        # edges grouped where an eager call or prepare() decided so (read as
        # is: deciding takes a host sync), the permutations traced as indexing
        H, Dp = q.size(1), ops.padded_head_dim(q.size(2))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, qe, edge_attr))
        bwd_args = list(plan.backward_args(H, Dp)) if grad else []
        grouping = plan.edge_grouping() if not drop[0] else None
        a, slots = edge_attr, plan.bias_args()
        if grouping is not None:
            a, dst, csr, slots = edge_attr[grouping.perm], grouping.dst, grouping.csr, grouping.slots
        # the dropout factors in the region's own code (fused into one kernel)
        keep = ops.dropout_factors(drop, edge_attr.size(0), H, q.device)
        out, agg, alpha = ops._edge_terms_op(q, k, v, qe, a, list(plan.forward_args(H, Dp)), bwd_args,
                                             list(slots), dst, *csr, scale,
                                             *drop, keep, return_weights)[:3]
        if grouping is not None:
            alpha = alpha[grouping.inv]
    elif node:
        # eager with dropout or a padded head dim: the node as
        # an autograd.Function between the projections
        grouping, a, dst, csr, slots = _grouped(plan, edge_attr, dst, csr, drop)
        out, agg, alpha = _EdgeFeatureTerms.apply(q, k, v, qe, a, plan, dst, csr, slots, scale, drop,
                                                  return_weights)
        if grouping is not None and alpha is not None:
            alpha = ops._permute_rows(alpha, grouping.inv, grouping.perm)
    else:
        edge_bias = edge_dot(qe, edge_attr, dst, csr)
        out, alpha = fused3s_attention(q, k, v, graph, scale, edge_bias=edge_bias, return_weights=True,
                                       dropout_p=drop[0], dropout_seed=ops._drop_seed(drop))
        used = alpha
        if drop[0]:     # the kernel's mask (same seed, same hash)
            used = alpha * ops.dropout_factors(drop, *alpha.shape, alpha.device)
        agg = edge_scatter(used, edge_attr, dst, out.size(0), csr)
    value_term = project_heads(agg, blocks.t().to(agg.dtype))
    return out + value_term.to(out.dtype), (alpha if return_weights else None)


def _grouped(plan: GraphPlan, edge_attr: Tensor, dst: Tensor, csr: tuple[Tensor, Tensor], drop: tuple) -> tuple:
    """(grouping or None, a, dst, csr, slots) for the eager node: the
    per-edge arrays grouped by destination where the caller's order
    scatters them (plan.edge_grouping); not with dropout (its mask is keyed
    by the caller's edge ids)."""
    grouping = plan.edge_grouping() if not drop[0] else None
    if grouping is None:
        return None, edge_attr, dst, csr, plan.bias_args()
    a = ops._permute_rows(edge_attr, grouping.perm, grouping.inv)
    return grouping, a, grouping.dst, grouping.csr, grouping.slots


class _EdgeFeatureTerms(torch.autograd.Function):
    """The attention with a key term (the bias ``<qe_i, a_e>``) and a value
    sum (``agg_i = sum_e used_e a_e``, ``used`` the weights after dropout)
    on the kernels, as one autograd node: (out, agg, alpha or None) from q, k, v,
    qe [N, H, F] (the queries projected by W_e, scaled) and a [E, F]; ``dst``,
    ``csr`` and ``slots`` (the plan's ``bias_args()``) in a's edge order: the
    caller's, or the plan's grouped one (``plan.edge_grouping()``). Eager
    mode's twin of the ``gt_fused3s::edge_feature_terms`` op (what
    torch.compile traces); both run :func:`~gt_fused3s.ops.edge_terms_forward`
    and :func:`~gt_fused3s.ops.edge_terms_backward`, the composed one's
    backward (edge_dot, the attention, edge_scatter) with what the
    composition recomputed or added up folded. Eagerly without dropout, on
    fp16 / bf16 / fp32 operands of a compiled head dim, the C++ op
    ``ops.edge_feature_eager`` runs instead (the same attention and edge
    kernels, with the projections on csrc/kernels/head_project.cu, as one
    C++ node)."""

    @staticmethod
    def forward(ctx, q, k, v, qe, a, plan, dst, csr, slots, scale, drop, return_weights):
        H, D = q.size(1), q.size(2)
        fwd_args = plan.forward_args(H, ops.padded_head_dim(D))
        q, k, v, in_dtype, out, lse, bias, alpha, keep, agg = ops.edge_terms_forward(
            q, k, v, qe, a, fwd_args, slots, dst, csr, scale, drop)
        ctx.save_for_backward(q, k, v, qe, a, out, lse, bias, alpha, keep, agg)
        ctx.plan, ctx.graph = plan, (fwd_args, slots, dst, csr, scale, drop, in_dtype)
        ctx.set_materialize_grads(False)
        return out, agg, alpha if return_weights else None

    @staticmethod
    def backward(ctx, grad_out, grad_agg, grad_alpha):
        q = ctx.saved_tensors[0]
        # the transposed format when a backward needs it (a forward alone builds none)
        bwd_args = ctx.plan.backward_args(q.size(1), ops.padded_head_dim(q.size(2)))
        fwd_args, *rest = ctx.graph
        grads = ops.edge_terms_backward(ctx.saved_tensors, (fwd_args, bwd_args, *rest), grad_out, grad_agg,
                                        grad_alpha, ctx.needs_input_grad)
        return (*grads, None, None, None, None, None, None, None)
