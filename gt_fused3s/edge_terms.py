"""Two products between node tensors and per-edge features, adjoint to each
other, in bounded memory: what TransformerConv's edge features add to the
fused attention (``nn/pyg.py``).

With ``a`` [E, F] the features of the edges ``e`` and ``idx`` [E] a node of
each edge (its destination ``i``):

* :func:`edge_dot`      ``out[e, h] = <X[idx[e], h, :], a[e, :]>``       [E, H]
* :func:`edge_scatter`  ``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]``  [N, H, F]

Each one's backward is the other one (plus :func:`_edge_weighted_rows` for
the gradient of ``a``). On a CUDA device with the extension, fp16 / bf16 /
fp32 operands take one kernel each (``csrc/kernels/edge_terms.cu``, fp32
arithmetic, nothing of size [E, H, F]; the sum over a node's edges reads
them grouped by node, ``csr`` = :func:`~gt_fused3s.graph.node_csr`, which a
plan keeps: :meth:`~gt_fused3s.plan.GraphPlan.destination_csr`). Elsewhere
(the CPU, float64) the PyTorch code below, which is also the kernels'
reference: it runs over chunks of edges, so that the gathered [E, H, F]
product is never held whole (nor saved for the backward, which recomputes
it chunk by chunk): at most ``CHUNK_ELEMENTS`` elements at a time. Plain
elementwise products and sums (an einsum here becomes a batched matmul of
[H, F] x [F, 1] per edge, which measured 10x slower).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .graph import node_csr
from .ops import fused3s_attention
from .plan import GraphPlan

CHUNK_ELEMENTS = 1 << 24    # 64 MB of fp32 per temporary product
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernel(*tensors: Tensor) -> bool:
    """Whether these operands take the edge-term kernels."""
    return all(t.dtype in _KERNEL_DTYPES for t in tensors) and ops._use_kernel(tensors[0])


def _f32(t: Tensor) -> Tensor:
    return t.float().contiguous()


def _chunks(E: int, per_edge: int):
    step = max(1, CHUNK_ELEMENTS // max(per_edge, 1))
    for s in range(0, E, step):
        yield s, min(E, s + step)


def _edge_dot(X: Tensor, a: Tensor, idx: Tensor) -> Tensor:
    E, H = a.size(0), X.size(1)
    dtype = torch.promote_types(X.dtype, a.dtype)
    if _kernel(X, a):
        return ops._op("edge_dot")(_f32(X), _f32(a), idx.long().contiguous()).to(dtype)
    out = a.new_empty((E, H), dtype=dtype)
    for s, e in _chunks(E, H * a.size(1)):
        out[s:e] = (X.index_select(0, idx[s:e]) * a[s:e].unsqueeze(1)).sum(-1)
    return out


def _edge_scatter(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int,
                  csr: tuple[Tensor, Tensor] | None) -> Tensor:
    H, F = w.size(1), a.size(1)
    if _kernel(w, a):
        rowptr, order = csr if csr is not None else node_csr(idx, num_nodes)
        return ops._op("edge_scatter")(_f32(w), _f32(a), rowptr, order).to(
            torch.promote_types(w.dtype, a.dtype))
    out = a.new_zeros((num_nodes, H, F), dtype=torch.promote_types(w.dtype, a.dtype))
    for s, e in _chunks(a.size(0), H * F):
        out.index_add_(0, idx[s:e], w[s:e].unsqueeze(-1) * a[s:e].unsqueeze(1))
    return out


def _edge_weighted_rows(w: Tensor, X: Tensor, idx: Tensor) -> Tensor:
    """[E, F]: ``sum_h w[e, h] X[idx[e], h, :]`` (the gradient with respect to ``a``)."""
    E, H, F = w.size(0), X.size(1), X.size(2)
    if _kernel(w, X):
        return ops._op("edge_rows")(_f32(w), _f32(X), idx.long().contiguous()).to(
            torch.promote_types(w.dtype, X.dtype))
    out = w.new_empty((E, F), dtype=torch.promote_types(w.dtype, X.dtype))
    for s, e in _chunks(E, H * F):
        out[s:e] = (w[s:e].unsqueeze(-1) * X.index_select(0, idx[s:e])).sum(1)
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


def _save(ctx, saved, rowptr, order):
    ctx.save_for_backward(*saved)
    ctx.rowptr, ctx.order = rowptr, order       # graph structure: no gradient, not mutated


class _EdgeDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, a, idx, rowptr, order):
        _save(ctx, (X, a, idx), rowptr, order)
        return _edge_dot(X, a, idx)

    @staticmethod
    def backward(ctx, grad):
        return *_edge_dot_grads(ctx, grad), None, None, None


class _EdgeScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, a, idx, num_nodes, rowptr, order):
        _save(ctx, (w, a, idx), rowptr, order)
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
    setup_context=lambda ctx, inputs, output: _save(ctx, inputs[:3], *inputs[3:]))
_edge_scatter_term.register_autograd(
    lambda ctx, grad: (*_edge_scatter_grads(ctx, grad), None, None, None, None),
    setup_context=lambda ctx, inputs, output: _save(ctx, inputs[:3], *inputs[4:]))


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


def block_diagonal(w: Tensor) -> Tensor:
    """[H A, H B]: the heads' ``w`` [H, A, B] on the diagonal, zeros elsewhere
    (differentiable in ``w``); its transpose is the block-diagonal matrix of
    the heads' ``w[h].T``."""
    H, A, B = w.shape
    blocks = w.new_zeros((H, A, H, B))
    blocks.diagonal(0, 0, 2).copy_(w.permute(1, 2, 0))
    return blocks.view(H * A, H * B)


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
                           scale: float, *, dropout_p: float = 0.0, dropout_seed: int | None = None
                           ) -> tuple[Tensor, Tensor]:
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
    (the softmax weights, before dropout, differentiable)."""
    plan = graph if isinstance(graph, GraphPlan) else None
    edges = plan.edge_index if plan is not None else graph
    dst = edges[1].long()
    csr = plan.destination_csr() if plan is not None and _kernel(q) else None
    # one block-diagonal W_e for both terms (its transpose is W_e^T's): the
    # key term projects the queries by W_e (scaled), the value term the
    # weighted feature sums by W_e^T
    blocks = block_diagonal(w_e)
    edge_bias = edge_dot(project_heads(q, blocks * scale), edge_attr, dst, csr)
    out, alpha = fused3s_attention(q, k, v, graph, scale, edge_bias=edge_bias, return_weights=True,
                                   dropout_p=dropout_p, dropout_seed=dropout_seed)
    used = alpha
    if dropout_p:     # the kernel's mask (same seed, same hash)
        used = alpha * ops.dropout_keep(dropout_seed, dropout_p, *alpha.shape, alpha.device)
    agg = edge_scatter(used, edge_attr, dst, out.size(0), csr)
    value_term = project_heads(agg, blocks.t().to(agg.dtype))
    return out + value_term.to(out.dtype), alpha
