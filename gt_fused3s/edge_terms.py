"""Two products between node tensors and per-edge features, adjoint to each
other, in bounded memory: what TransformerConv's edge features add to the
fused attention (``nn/pyg.py``).

With ``a`` [E, F] the features of the edges ``e`` and ``idx`` [E] a node of
each edge (its destination ``i``):

* :func:`edge_dot`      ``out[e, h] = <X[idx[e], h, :], a[e, :]>``       [E, H]
* :func:`edge_scatter`  ``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]``  [N, H, F]

Both run over chunks of edges, so that the gathered [E, H, F] product is
never held whole (nor saved for the backward, which recomputes it chunk by
chunk): at most ``CHUNK_ELEMENTS`` elements at a time. Each one's backward is
the other one. Plain elementwise products and sums (an einsum here becomes
a batched matmul of [H, F] x [F, 1] per edge, which measured 10x slower).
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24    # 64 MB of fp32 per temporary product


def _chunks(E: int, per_edge: int):
    step = max(1, CHUNK_ELEMENTS // max(per_edge, 1))
    for s in range(0, E, step):
        yield s, min(E, s + step)


def _edge_dot(X: Tensor, a: Tensor, idx: Tensor) -> Tensor:
    E, H = a.size(0), X.size(1)
    out = a.new_empty((E, H), dtype=torch.promote_types(X.dtype, a.dtype))
    for s, e in _chunks(E, H * a.size(1)):
        out[s:e] = (X.index_select(0, idx[s:e]) * a[s:e].unsqueeze(1)).sum(-1)
    return out


def _edge_scatter(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int) -> Tensor:
    H, F = w.size(1), a.size(1)
    out = a.new_zeros((num_nodes, H, F), dtype=torch.promote_types(w.dtype, a.dtype))
    for s, e in _chunks(a.size(0), H * F):
        out.index_add_(0, idx[s:e], w[s:e].unsqueeze(-1) * a[s:e].unsqueeze(1))
    return out


def _edge_weighted_rows(w: Tensor, X: Tensor, idx: Tensor) -> Tensor:
    """[E, F]: ``sum_h w[e, h] X[idx[e], h, :]`` (the gradient with respect to ``a``)."""
    E, H, F = w.size(0), X.size(1), X.size(2)
    out = w.new_empty((E, F), dtype=torch.promote_types(w.dtype, X.dtype))
    for s, e in _chunks(E, H * F):
        out[s:e] = (w[s:e].unsqueeze(-1) * X.index_select(0, idx[s:e])).sum(1)
    return out


class _EdgeDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, a, idx):
        ctx.save_for_backward(X, a, idx)
        return _edge_dot(X, a, idx)

    @staticmethod
    def backward(ctx, grad):
        X, a, idx = ctx.saved_tensors
        dX = _edge_scatter(grad, a, idx, X.size(0)).to(X.dtype) if ctx.needs_input_grad[0] else None
        da = _edge_weighted_rows(grad, X, idx).to(a.dtype) if ctx.needs_input_grad[1] else None
        return dX, da, None


class _EdgeScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, a, idx, num_nodes):
        ctx.save_for_backward(w, a, idx)
        return _edge_scatter(w, a, idx, num_nodes)

    @staticmethod
    def backward(ctx, grad):
        w, a, idx = ctx.saved_tensors
        dw = _edge_dot(grad, a, idx).to(w.dtype) if ctx.needs_input_grad[0] else None
        da = _edge_weighted_rows(w, grad, idx).to(a.dtype) if ctx.needs_input_grad[1] else None
        return dw, da, None, None


def edge_dot(X: Tensor, a: Tensor, idx: Tensor) -> Tensor:
    """``out[e, h] = <X[idx[e], h, :], a[e, :]>``: X [N, H, F], a [E, F],
    idx [E] (int64) -> [E, H]. Differentiable in X and a."""
    return _EdgeDot.apply(X, a, idx)


def edge_scatter(w: Tensor, a: Tensor, idx: Tensor, num_nodes: int) -> Tensor:
    """``out[n, h, :] = sum_{e: idx[e] = n} w[e, h] a[e, :]``: w [E, H],
    a [E, F], idx [E] (int64) -> [num_nodes, H, F]. Differentiable in w and a."""
    return _EdgeScatter.apply(w, a, idx, num_nodes)
